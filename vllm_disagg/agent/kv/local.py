"""The local link between an engine's connector and its agent's pool: one request, one answer.

The connector runs inside vLLM's processes (the scheduler's and the worker's), which are synchronous,
so its side is a blocking ZeroMQ REQ socket with a deadline (``LocalClient``); the agent's side is an
asyncio ROUTER (``service.py``). The messages are typed and versioned (``local_messages.py``): on the
wire msgpack maps ``{"op": ..., "v": ..., ...}``, and every answer has ``ok`` and, when not ok,
``error``. The socket is an ``ipc://`` path in a directory only the agent's user can enter
(``local_endpoint``): the bytes behind it are prompts' KV, so no other user may ask.

Requests (connector -> agent), each answered by its own message:

- ``Open {geometry, engine, pid}`` -> ``Opened {path, capacity}``: the worker's KV geometry, and the
  arena the worker maps. Engines sharing a node's pool name their requests and saves
  ``ENGINE:...``; a new ``pid`` for an engine is a restart: the references the old process held go.
- ``Lookup {req, keys}`` -> ``Pinned {slots, ready}``: pin the leading keys held for request ``req``
  (again: replaces its pins); ``ready`` is False while a transfer is landing a block.
- ``Release {reqs}`` -> ``Released``: the requests loaded or finished; their pins go.
- ``Reserve {owner, blocks: [[key, parent, token_ids], ...]}`` -> ``Reserved {slots, orphans}``:
  slots to save new blocks into; ``orphans``, blocks whose parent the pool no longer holds (not
  reserved: the engine sends their chain again). An engine sends a prompt's chain once, then only
  the blocks each step completes: the pool keeps the chain a new block continues from eviction.
- ``Commit {owner, keys}`` -> ``Committed {committed}``: the owner wrote them; they are ready, and
  its other reservations go.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack
import zmq

from vllm_disagg.agent.kv.local_messages import A, LocalRequest, read_answer, request_to_wire
from vllm_disagg.private_files import private_dir, runtime_dir

DEFAULT_TIMEOUT_S = 2.0
_MAX_IPC_PATH = 100  # sun_path is 108 bytes with its NUL; keep a margin
# What operators call the connector (``--kv-connector vllm-disagg``), and what vLLM loads for it.
CONNECTOR_NAME = "vllm-disagg"
CONNECTOR_CLASS = "VllmDisaggConnector"
CONNECTOR_MODULE = "vllm_disagg.agent.kv.connector"


def local_endpoint(agent_id: str, directory: str | None = None) -> str:
    """``ipc://DIR/kv-AGENT.sock``, DIR a directory only this user may enter (``make_local_dir``).

    A socket path holds at most 107 bytes: a long agent id (up to 128 characters) is named by its
    hash instead."""
    path = local_dir(directory) / f"kv-{agent_id}.sock"
    if len(str(path).encode()) > _MAX_IPC_PATH:
        path = path.with_name(f"kv-{hashlib.sha256(agent_id.encode()).hexdigest()[:24]}.sock")
    return f"ipc://{path}"


def local_dir(directory: str | None = None) -> Path:
    """This user's runtime directory (``private_files.runtime_dir``), under ``directory`` if given."""
    return runtime_dir(directory)


def make_local_dir(endpoint: str) -> None:
    """Create the endpoint's directory with mode 0700 (again, if another run made it looser)."""
    # Owner checked too: in a shared /tmp another user could have made it first (``private_dir``).
    private_dir(Path(endpoint.removeprefix("ipc://")).parent)


class LocalError(Exception):
    """The agent did not answer in time, said no, or answered what this side cannot read. ``code``
    is the agent's machine-readable reason, where it gave one (``unsupported_version``)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class LocalClient:
    """A blocking REQ socket to the agent; a new socket after a timeout (REQ cannot skip an answer)."""

    def __init__(self, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self._timeout_ms = int(timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def call(self, request: LocalRequest, answer: type[A]) -> A:
        """Send one request and wait for its answer, read as ``answer``; ``LocalError`` on timeout,
        refusal, or an answer that is not one."""
        sock = self._socket()
        op = request.OP
        try:
            sock.send(msgpack.packb(request_to_wire(request), use_bin_type=True))
            raw = sock.recv()
        except zmq.Again:
            sock.close()
            self._sock = None
            raise LocalError(f"agent at {self.endpoint} did not answer {op!r} in time") from None
        try:
            reply = msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException):
            raise LocalError(f"agent answered {op!r} with bytes that are not msgpack") from None
        if not isinstance(reply, dict) or not reply.get("ok"):
            error = reply.get("error") if isinstance(reply, dict) else repr(reply)
            code = reply.get("code") if isinstance(reply, dict) else ""
            raise LocalError(f"agent refused {op!r}: {error}", code if isinstance(code, str) else "")
        try:
            return read_answer(reply, answer)
        except ValueError as e:
            raise LocalError(f"agent answered {op!r} with what is not one: {e}") from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
