"""The local link between an engine's connector and its agent's pool: one request, one answer.

The connector runs inside vLLM's processes (the scheduler's and the worker's), which are synchronous,
so its side is a blocking ZeroMQ REQ socket with a deadline (``LocalClient``); the agent's side is an
asyncio ROUTER (``service.py``). Messages are msgpack maps ``{"op": ..., ...}``; every answer has
``ok`` and, when not ok, ``error``. The socket is an ``ipc://`` path in a directory only the agent's
user can enter (``local_endpoint``): the bytes behind it are prompts' KV, so no other user may ask.

Ops (connector -> agent):

- ``open {geometry, engine, pid}``: the worker's KV geometry; the answer names the arena (``path``,
  ``capacity``) the worker maps. Engines sharing a node's pool name their requests and saves
  ``ENGINE:...``; a new ``pid`` for an engine is a restart: the references the old process held go.
- ``lookup {req, keys}``: pin the leading keys held for request ``req`` (again: replaces its pins);
  answers ``slots`` and ``ready`` (False while a transfer is landing it).
- ``release {reqs}``: the requests loaded or finished; their pins go.
- ``reserve {owner, blocks: [[key, parent, token_ids], ...]}``: slots to save new blocks into.
- ``commit {owner, keys}``: the owner wrote them; they are ready, and its other reservations go.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import zmq

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
    return Path(directory or tempfile.gettempdir()) / f"vllm-disagg-{os.getuid()}"


def make_local_dir(endpoint: str) -> None:
    """Create the endpoint's directory with mode 0700 (again, if another run made it looser)."""
    base = Path(endpoint.removeprefix("ipc://")).parent
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(base, 0o700)


class LocalError(Exception):
    """The agent did not answer in time, or said no."""


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

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; ``LocalError`` on timeout or refusal."""
        sock = self._socket()
        try:
            sock.send(msgpack.packb({"op": op, **fields}, use_bin_type=True))
            raw = sock.recv()
        except zmq.Again:
            sock.close()
            self._sock = None
            raise LocalError(f"agent at {self.endpoint} did not answer {op!r} in time") from None
        answer = msgpack.unpackb(raw, raw=False)
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else repr(answer)
            raise LocalError(f"agent refused {op!r}: {error}")
        return answer

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
