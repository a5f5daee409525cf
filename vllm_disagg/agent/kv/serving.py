"""The holder's side of agent-to-agent transfers: a ROUTER that serves granted blocks, layer by layer.

A fetch is one connection from the receiver and one ``FetchRequest`` (``frames.py``). The request is
refused, with a reason, unless a live grant (``grants.py``) covers it: its token, only keys it named,
the same KV geometry as this pool, and, with agent keys, the grant's own public key on the connection
(the ZAP handler has already kept out every key no live grant names). A served request gets ``Start``
and then chunks: for each layer, that layer of every block, as many blocks per message as fit in
``chunk_bytes``. Every block part is a memoryview of the arena sent with ``copy=False``: libzmq reads
the pool's memory itself, and the grant's pins keep those slots from being reused until the receiver
says ``Done`` (or is found gone, or its deadline passed).

Flow control is by credit: the holder has at most the request's ``window`` chunks unlanded, and sends
one more for each the receiver hands back. A stream waiting on a quiet receiver pings it every
``_PROBE_S``: with ``ROUTER_MANDATORY`` the send fails once the connection is gone, so a receiver that
died without a word is found out in about a second and its pins let go.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from vllm_disagg.agent.kv.frames import (
    MAX_KEYS,
    MAX_WINDOW,
    Chunk,
    Credit,
    Done,
    FetchRequest,
    Ping,
    Refused,
    Start,
    decode,
    encode,
)
from vllm_disagg.agent.kv.grants import Grants, refusal, servable
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool
from vllm_disagg.clock import Clock
from vllm_disagg.errors import MalformedFrame, UnsupportedVersion
from vllm_disagg.private_files import mask
from vllm_disagg.protocol.curve import Keypair, ServerCurve, setup_server
from vllm_disagg.protocol.kv_pool import MAX_FETCH_TIMEOUT_S, MAX_GRANT_TTL_S
from vllm_disagg.protocol.transport import send_now

log = logging.getLogger(__name__)

PING_IVL_MS = 1000  # ZMTP pings on both sides: a silent peer's connection is closed within seconds
PING_TIMEOUT_MS = 3000
_MAX_REQUEST_BYTES = MAX_KEYS * 40 + 4096
_PROBE_S = 1.0

Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass(slots=True)
class _Stream:
    """The holder's side of one fetch: what it sends, and the receiver's credit."""

    peer: bytes  # the ROUTER's routing id of the receiver's connection
    token: str = field(repr=False)
    slots: tuple[int, ...]
    credit: int
    finished: bool = False  # the receiver sent Done
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class _GrantedKeys:
    """The ZAP handler's check: a client key is admitted while a live grant names it."""

    def __init__(self, grants: Grants, clock: Clock) -> None:
        self._grants = grants
        self._clock = clock

    def callback(self, domain: str, key: bytes) -> bool:
        return self._grants.admits(key, self._clock.monotonic())


class GrantServer:
    """Grants, and the ROUTER that serves them; runs on the agent's loop (``spawn`` tracks its tasks)."""

    def __init__(
        self,
        node: PoolNode,
        ctx: zmq.asyncio.Context,
        clock: Clock,
        spawn: Spawn,
        *,
        keys: Keypair | None,
        chunk_bytes: int,
    ) -> None:
        self._node = node
        self._ctx = ctx
        self._clock = clock
        self._spawn = spawn
        self._keys = keys
        self._chunk_bytes = chunk_bytes
        self._grants = Grants(node)
        self._streams: dict[bytes, _Stream] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._sock: zmq.asyncio.Socket | None = None

    def bind(self, endpoint: str) -> str:
        """Bind (with keys, after the ZAP handler is up) and serve; the endpoint bound."""
        sock = self._ctx.socket(zmq.ROUTER)
        if self._keys is not None:
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(
                "*", credentials_provider=_GrantedKeys(self._grants, self._clock)
            )
            setup_server(sock, ServerCurve(self._keys, {}))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone receiver -> EHOSTUNREACH: its stream ends
        sock.setsockopt(zmq.SNDHWM, MAX_WINDOW + 16)  # never reached: credit bounds each stream
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, PING_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PING_TIMEOUT_MS)
        sock.bind(endpoint)
        self._sock = sock
        self._spawn(self._serve())
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def grant(self, token: str, keys: Sequence[bytes], peer_public_key: bytes | None, ttl_s: float) -> int:
        """Pin the leading held ``keys`` for ``token``'s one fetch, for ``ttl_s`` (at most
        ``MAX_GRANT_TTL_S``, whatever the orchestrator says); how many held."""
        ttl_s = min(ttl_s, MAX_GRANT_TTL_S)
        grant = self._grants.add(token, keys, peer_public_key, self._clock.monotonic() + ttl_s)
        self._arm()
        return 0 if grant is None else len(grant.pinned)

    def expire_grants(self) -> list[str]:
        """End the unused grants whose TTL has passed, and those in use past their hard deadline
        (a timer calls this); their tokens."""
        gone = self._grants.expire(self._clock.monotonic())
        for stream in self._streams.values():
            if stream.token in gone:  # its receiver stalled: its pins are gone, so is the stream
                log.warning("kv stream of grant %s: ended at the grant's hard deadline", mask(stream.token))
                stream.finished = True
                stream.wake.set()
        self._arm()
        return gone

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        at = self._grants.next_expiry()
        if at is not None:
            delay = max(0.0, at - self._clock.monotonic())
            self._timer = asyncio.get_running_loop().call_later(delay, self.expire_grants)

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            parts = await self._sock.recv_multipart(copy=False)
            self._on_message(parts)

    def _on_message(self, parts: list[zmq.Frame]) -> None:
        peer = parts[0].bytes
        if len(parts) != 2:
            self._refuse(peer, f"expected one header part, got {len(parts) - 1}")
            return
        try:
            frame = decode(parts[1].buffer, _MAX_REQUEST_BYTES)
        except UnsupportedVersion as exc:  # a receiver of a later release: it may ask again in ours
            self._refuse(peer, str(exc), exc.code)
            return
        except MalformedFrame as exc:
            self._refuse(peer, str(exc))
            return
        stream = self._streams.get(peer)
        match frame:
            case FetchRequest():
                client_key = str(parts[1].get("User-Id")).encode() if self._auth is not None else None
                self._on_request(peer, frame, client_key)
            case Credit() if stream is not None:
                stream.credit += frame.chunks
                stream.wake.set()
            case Done() if stream is not None:
                stream.finished = True
                stream.wake.set()
            case Credit() | Done():
                pass  # a stream that already ended
            case _:
                self._refuse(peer, f"a receiver does not send {type(frame).__name__}")

    def _on_request(self, peer: bytes, request: FetchRequest, client_key: bytes | None) -> None:
        node, grant = self._node, self._grants.get(request.token)
        if peer in self._streams:
            reason: str | None = "this connection is already fetching"
        elif node.pool is None or node.geometry is None:
            reason = "no KV pool is open on this agent"
        elif request.geometry != node.geometry:
            reason = f"geometry mismatch: yours {request.geometry}, mine {node.geometry}"
        elif grant is not None and grant.pool is not node.pool:
            reason = "this agent's pool was reopened since the grant"
        else:
            now, curve = self._clock.monotonic(), self._auth is not None
            reason = refusal(grant, request.keys, client_key, now, curve)
        self.expire_grants()
        if reason is not None:
            self._refuse(peer, reason)
            return
        assert grant is not None and node.pool is not None and node.geometry is not None
        n = servable(grant, request.keys)
        slots = tuple(node.pool.slot_of(key) for key in request.keys[:n])
        tokens = tuple(_tokens(node.pool, key) for key in request.keys[:n])
        extras = tuple(node.pool.extra_of(key) for key in request.keys[:n])
        grant.in_use = True
        self._arm()  # from now on it ends by its hard deadline
        if not self._send(peer, Start(n, node.geometry, tokens, request.version, extras)) or n == 0:
            self._grants.end(request.token)
            return
        stream = _Stream(peer, request.token, tuple(s for s in slots if s is not None), request.window)
        self._streams[peer] = stream
        # The receiver's word on how long it waits is capped: by the most any receiver waits, and by
        # the grant's hard deadline.
        timeout_s = min(request.timeout_s, MAX_FETCH_TIMEOUT_S, grant.ends_by - self._clock.monotonic())
        self._spawn(self._stream(stream, max(0.0, timeout_s)))

    async def _stream(self, stream: _Stream, timeout_s: float) -> None:
        """Send the blocks layer by layer on credit; the pins last until the receiver is done."""
        arena, sock = self._node.arena, self._sock
        assert arena is not None and sock is not None
        per = max(1, self._chunk_bytes // arena.geometry.layer_block_bytes)
        try:
            # The receiver has given up by its deadline; nothing sent after it can land anywhere.
            async with asyncio.timeout(timeout_s):
                for layer in range(arena.geometry.num_layers):
                    for first in range(0, len(stream.slots), per):
                        while stream.credit == 0 and not stream.finished:
                            await self._wait(stream)
                        if stream.finished:
                            return  # cancelled by the receiver
                        if self._node.arena is not arena:
                            self._send(stream.peer, Refused("the holder's pool was reopened"))
                            return
                        stream.credit -= 1
                        views = [arena.layer_view(s, layer) for s in stream.slots[first : first + per]]
                        header = encode(Chunk(layer, first))
                        await sock.send_multipart([stream.peer, header, *views], copy=False)
                while not stream.finished:
                    await self._wait(stream)
        except TimeoutError:
            log.warning(
                "kv stream of grant %s: the receiver did not finish in %gs", mask(stream.token), timeout_s
            )
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.warning("kv stream of grant %s: the receiver is gone", mask(stream.token))
        finally:
            self._streams.pop(stream.peer, None)
            self._grants.end(stream.token)

    async def _wait(self, stream: _Stream) -> None:
        """Until the receiver says something; a ping on each quiet ``_PROBE_S`` finds it gone."""
        assert self._sock is not None
        stream.wake.clear()
        try:
            await asyncio.wait_for(stream.wake.wait(), _PROBE_S)
        except TimeoutError:
            await self._sock.send_multipart([stream.peer, encode(Ping())])

    def _refuse(self, peer: bytes, reason: str, code: str = "") -> None:
        log.info("kv fetch refused: %s", reason)
        self._send(peer, Refused(reason, code))

    def _send(self, peer: bytes, frame: Start | Refused) -> bool:
        assert self._sock is not None
        try:
            send_now(self._sock, [peer, encode(frame)])
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise
        return True

    def close(self) -> None:
        """End every grant (the streams were cancelled with the agent's tasks); stop the ZAP handler."""
        if self._timer is not None:
            self._timer.cancel()
        self._grants.close()
        if self._auth is not None:
            self._auth.stop()


def _tokens(pool: PrefixPool, key: BlockKey) -> tuple[int, ...]:
    info = pool.info(key)
    return () if info is None else info[1]
