"""ZeroMQ transport: ROUTER on the orchestrator, DEALER on each agent, on ``zmq.asyncio``.

Each socket has exactly one reader: its owner's loop calling ``recv()``. ``recv`` never raises for
bad bytes; it returns the ``CodecError`` in place of a message so the owner can refuse the frame
with a reason and keep serving. Sends never block: a peer that is gone or slow loses the message
(heartbeats are periodic, commands are retried by their issuer).

Sizes: libzmq's ``MAXMSGSIZE`` bounds each *part* of a message, not the message, and libzmq delivers
a multi-part message only once every part has arrived, so a peer can make it buffer many parts of
just under the limit each (1,000 x 2 MiB). That buffer cannot be refused here (only authenticating
peers can); what ``recv`` does is never copy it: parts are received as zero-copy frames, a message
of several parts is refused by its count and size without being read, and the one part of a good
message is decoded from a view of libzmq's buffer. With agent keys (``curve``), a peer without a
listed key is refused during the handshake and cannot make the orchestrator buffer anything.

Routing ids are the ROUTER's own, one per connection; agents never choose one. An agent id is what
a ``Hello`` says (with keys: what its key is bound to), and the control plane maps connections to
agent ids. A routing id chosen by the peer would be kept across its reconnects, and libzmq strands a
connection whose id is still held by a connection it has not finished closing (it leaves the new
pipe unread, for good, while the agent believes it is connected); ``ROUTER_HANDOVER`` would instead
let any peer take a live agent's id. ZMTP pings on both sides drop dead connections within seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import zmq
import zmq.asyncio

from vllm_disagg.errors import CodecError, MalformedFrame
from vllm_disagg.protocol.codec import DEFAULT_MAX_FRAME_BYTES, decode, encode
from vllm_disagg.protocol.curve import (
    AgentAuthenticator,
    ClientCurve,
    ServerCurve,
    setup_client,
    setup_server,
)
from vllm_disagg.protocol.messages import Message

# Messages queued per peer before sends are dropped; a heartbeat stream must never grow memory.
_SEND_HWM = 1000
_PING_IVL_MS = 1000
_PING_TIMEOUT_MS = 3000
_CONNECT_TIMEOUT_MS = 2000


def send_now(sock: zmq.asyncio.Socket, parts: list[bytes]) -> None:
    """Send without blocking; raise the ``ZMQError`` if it cannot go now.

    ``zmq.asyncio`` reports a non-blocking send's failure in the returned future instead of raising,
    and that future is already resolved (no send ever waits here), so the error is read from it.
    """
    future = cast("asyncio.Future[object]", sock.send_multipart(parts, flags=zmq.NOBLOCK))
    if not future.done():  # pragma: no cover - only if someone awaited a blocking send on this socket
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return
    error = future.exception()
    if error is not None:
        raise error


@dataclass(frozen=True, slots=True)
class Incoming:
    """One frame from a peer: the decoded message, or why it could not be decoded."""

    peer: bytes
    message: Message | None
    error: CodecError | None
    user: str = ""  # with agent keys: the agent id the sender's key belongs to
    # The ROUTER's frame naming the connection: its address is read from it only when asked (a Hello),
    # not for every heartbeat.
    origin: zmq.Frame | None = field(default=None, compare=False, repr=False)

    def peer_address(self) -> str:
        """The connection's remote IP address as libzmq saw it; "" where it has none (``ipc://``
        gives no IP, ``inproc://`` nothing)."""
        if self.origin is None:
            return ""
        try:
            return str(self.origin.get("Peer-Address"))
        except zmq.ZMQError:
            return ""


def _incoming(
    peer: bytes, parts: Sequence[zmq.Frame], max_bytes: int, user: str = "", origin: zmq.Frame | None = None
) -> Incoming:
    """Decode a message's payload parts (one, for a protocol frame) without copying them."""
    if len(parts) != 1:
        size = sum(len(part) for part in parts)
        return Incoming(
            peer,
            None,
            MalformedFrame(f"expected 1 frame part, got {len(parts)} ({size} bytes in all)"),
            user,
            origin,
        )
    try:
        return Incoming(peer, decode(parts[0].buffer, max_bytes=max_bytes), None, user, origin)
    except CodecError as exc:
        return Incoming(peer, None, exc, user, origin)


class RouterTransport:
    """The orchestrator's socket: many agents, one routing id per connection (libzmq's, not the peer's)."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        curve: ServerCurve | None = None,
        on_denied: Callable[[], None] = lambda: None,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._auth: AgentAuthenticator | None = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        if curve is not None:
            self._auth = AgentAuthenticator(self._ctx, curve.agents, on_denied)
            self._auth.start()
            setup_server(self._sock, curve)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> EHOSTUNREACH, not silence
        self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, _PING_IVL_MS)  # a dead connection frees its agent id
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _PING_TIMEOUT_MS)
        # libzmq drops the connection of a peer that sends a part over this; up to it, the codec
        # refuses an oversized frame with a reason the peer can read (see the module docstring).
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes * 2)
        self._max = max_frame_bytes
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def admit(self, public_key: bytes, agent_id: str) -> None:
        """With agent keys: admit one more agent's key from now on (``RuntimeError`` without keys)."""
        if self._auth is None:
            raise RuntimeError("this socket admits any agent: it has no agent keys")
        self._auth.admit(public_key, agent_id)

    async def recv(self) -> Incoming:
        """The next frame from any agent."""
        parts = await self._sock.recv_multipart(copy=False)
        user = str(parts[0].get("User-Id")) if self._auth is not None else ""
        return _incoming(parts[0].bytes, parts[1:], self._max, user, parts[0])

    def send(self, peer: bytes, message: Message) -> bool:
        """Send to one connection; False when it is closed (or closing) or its queue is full."""
        return self.send_raw(peer, encode(message))

    def send_raw(self, peer: bytes, frame: bytes) -> bool:
        """Send bytes as they are (tests use this to send garbage)."""
        try:
            send_now(self._sock, [peer, frame])
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise
        return True

    def close(self, *, linger_ms: int = 0) -> None:
        """Close the socket and its context; ``linger_ms`` > 0 first flushes queued messages (a Goodbye)."""
        self._sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class DealerTransport:
    """An agent's socket to the orchestrator. libzmq reconnects by itself, with backoff."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 2000,
        curve: ClientCurve | None = None,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        if curve is not None:
            setup_client(self._sock, curve)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while the orchestrator is away
        self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, reconnect_ivl_max_ms)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        # A partition leaves TCP retransmitting with backoff (about 50 s to notice a link healed after a
        # 60 s cut): ZMTP pings drop the dead connection and bounded connects retry, so a healed link
        # is used within seconds.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, _PING_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _PING_TIMEOUT_MS)
        self._sock.setsockopt(zmq.CONNECT_TIMEOUT, _CONNECT_TIMEOUT_MS)
        self._max = max_frame_bytes
        self._sock.connect(endpoint)

    async def recv(self) -> Incoming:
        """The next frame from the orchestrator."""
        return _incoming(b"", await self._sock.recv_multipart(copy=False), self._max)

    def send(self, message: Message) -> bool:
        """Send to the orchestrator; False when it is not connected (the message is dropped)."""
        return self.send_raw(encode(message))

    def send_raw(self, frame: bytes) -> bool:
        """Send bytes as they are (tests use this to send garbage)."""
        try:
            send_now(self._sock, [frame])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                return False
            raise
        return True

    def close(self, *, linger_ms: int = 0) -> None:
        """Close the socket and its context; ``linger_ms`` > 0 first flushes queued messages (a Goodbye)."""
        self._sock.close(linger=linger_ms)
        self._ctx.term()
