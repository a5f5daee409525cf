"""Agent-to-agent KV transfers over ZeroMQ: the ``KvPlane`` an agent's session drives.

This module moves KV bytes between two agents' pools over TCP with ZeroMQ (CurveZMQ with agent
keys); it does not use NIXL. NIXL (RDMA / UCX, GPU memory to GPU memory) is what the engines' own
KV connector uses between engines; a NIXL path between agents' pools, where present, would be another
``KvPlane`` beside this one, and this one stays the path that works between any two hosts with TCP.

Each agent serves its pool to the agents it granted blocks to (``serving.py``) and fetches from
others (``landing.py``); the frames between them are in ``frames.py``. A fetch is one DEALER
connection, one request, then the blocks layer by layer, on credit: at most ``window`` chunks of
about ``chunk_bytes`` unlanded at once, so neither side ever queues a whole transfer, while enough is
in flight to keep the link busy. Each block part leaves the holder's arena without a copy and is
copied once, from libzmq's buffer, into the receiver's slot.

Authorization: a fetch names the token of a live grant, and only keys the grant named. With agent
keys, the holder is a CurveZMQ server that admits only a public key some live grant names, and a
fetch must come from its own grant's key; without keys, the token alone authorizes, so it must be
secret and the link trusted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import zmq
import zmq.asyncio

from vllm_disagg.agent.kv.frames import FetchRequest, encode
from vllm_disagg.agent.kv.landing import MONITOR_EVENTS, ChunkHook, Fetch, FetchEnded, receive
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.plane import FetchStarted
from vllm_disagg.agent.kv.serving import PING_IVL_MS, PING_TIMEOUT_MS, GrantServer
from vllm_disagg.clock import Clock, SystemClock
from vllm_disagg.protocol.curve import ClientCurve, Keypair, setup_client
from vllm_disagg.protocol.kv_pool import MAX_FETCH_TIMEOUT_S
from vllm_disagg.protocol.messages import MAX_KV_LINKS, KvLinkCount
from vllm_disagg.protocol.transport import send_now

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 16  # chunks unlanded at once: 16 MiB at the default chunk size
DEFAULT_CHUNK_BYTES = 1 << 20  # one layer of as many blocks as fit, at least one
_ENDED_KEPT = 64
_CURVE_OVERHEAD = 1024  # a CurveZMQ MESSAGE adds a nonce, a MAC and flags to each part (33 bytes)


class KvTransfer:
    """One agent's KV data plane over ZeroMQ: serves granted blocks, fetches from other agents."""

    def __init__(
        self,
        node: PoolNode,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        keys: Keypair | None = None,
        clock: Clock | None = None,
        window: int = DEFAULT_WINDOW,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_chunk: ChunkHook | None = None,
    ) -> None:
        self._node = node
        self._bind = f"tcp://{host}:{port}"  # host: the address other agents reach this one at
        self._keys = keys
        self._clock = clock or SystemClock()
        self._window = window
        self._chunk_bytes = chunk_bytes
        self._on_chunk = on_chunk  # after each chunk lands (tests watch layers rise with it)
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._ctx: zmq.asyncio.Context | None = None  # made by ``start``, on the loop that uses it
        self._server: GrantServer | None = None
        self._endpoint = ""
        self.ended: deque[FetchEnded] = deque(maxlen=_ENDED_KEPT)  # recent fetches, newest last
        self._received: dict[str, KvLinkCount] = {}  # lifetime, by source endpoint

    async def start(self) -> KvTransfer:
        """Bind and serve; fetches may start from now on."""
        self._ctx = zmq.asyncio.Context()
        self._server = GrantServer(
            self._node, self._ctx, self._clock, self._spawn, keys=self._keys, chunk_bytes=self._chunk_bytes
        )
        self._endpoint = self._server.bind(self._bind)
        return self

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` where this agent serves granted blocks (after ``start``)."""
        return self._endpoint

    def grant(self, token: str, keys: Sequence[bytes], peer_public_key: bytes | None, ttl_s: float) -> int:
        """Let the holder of ``token`` fetch ``keys`` (pinned until fetched or ``ttl_s``); how many held."""
        if self._server is None:
            raise RuntimeError("KvTransfer.start() first")
        return self._server.grant(token, keys, peer_public_key, ttl_s)

    def expire_grants(self) -> list[str]:
        """End the unused grants whose TTL has passed (a loop timer calls this); their tokens."""
        return [] if self._server is None else self._server.expire_grants()

    # --- receiver ----------------------------------------------------------------------------------
    async def fetch(
        self,
        endpoint: str,
        peer_public_key: bytes | None,
        token: str,
        keys: Sequence[bytes],
        timeout_s: float,
    ) -> FetchStarted:
        """Start fetching ``keys`` from another agent's pool into this one, for ``timeout_s`` at most
        (and never longer than ``MAX_FETCH_TIMEOUT_S``, whatever the orchestrator says)."""
        timeout_s = min(timeout_s, MAX_FETCH_TIMEOUT_S)
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        pool, arena = self._node.pool, self._node.arena
        if pool is None or arena is None:
            done.set_result(0)
            self.ended.append(FetchEnded(token, endpoint, 0, 0, "no KV pool is open on this agent", True))
            return FetchStarted(len(keys), 0, 0, done)
        # The connection first: a bad endpoint raises here, before any slot is reserved.
        sock, monitor = self._connect(endpoint, peer_public_key, arena.geometry.layer_block_bytes)
        owner = f"xfer:{next(self._ids)}"
        # The prefix held here stays while its continuation lands: without the pin, reserving slots
        # for the continuation could evict that very prefix and leave blocks no prompt can reach.
        held = pool.lookup(keys)
        pool.pin(owner, keys[:held])  # (not all of ``keys``: a fetch is not the pool's miss)
        # kv_fetch names keys only: the holder's Start says each block's token ids (``describe``).
        wanted = [(keys[i], keys[i - 1] if i else None, ()) for i in range(held, len(keys))]
        parent_of = {key: parent for key, parent, _ in wanted}
        got = pool.reserve(owner, wanted)
        if not got:  # all held here already, or no slot free: nothing to fetch
            pool.release(owner)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            done.set_result(0)
            return FetchStarted(len(keys), held, 0, done)
        for slot in got.values():
            arena.set_layers_ready(slot, 0)  # a reused slot: nothing of the new block is there yet
        fetch = Fetch(
            owner,
            token,
            endpoint,
            tuple(got),
            tuple(got.values()),
            pool,
            arena,
            sock,
            monitor,
            timeout_s,
            self._window,
            done,
            parents=tuple(parent_of[key] for key in got),
        )
        ended = self._recorder(arena.geometry.block_bytes)  # from now: the request leaves next
        # Queued until the connection is up (ZeroMQ connects in the background).
        send_now(sock, [encode(FetchRequest(token, fetch.keys, arena.geometry, self._window, timeout_s))])
        self._spawn(receive(fetch, self._node, self._on_chunk, ended))
        return FetchStarted(len(keys), held, len(got), done)

    def _recorder(self, block_bytes: int) -> Callable[[FetchEnded], None]:
        """What a fetch starting now records when it ends: itself, and what it landed in its source's
        count (the time until the last block landed)."""
        started = self._clock.monotonic()

        def ended(end: FetchEnded) -> None:
            self.ended.append(end)
            if not end.landed:  # a fetch that moved nothing says nothing of the link's rate
                return
            was = self._received.get(end.endpoint) or KvLinkCount(end.endpoint)
            self._received[end.endpoint] = KvLinkCount(
                end.endpoint,
                was.nbytes + end.landed * block_bytes,
                was.seconds + self._clock.monotonic() - started,
                was.transfers + 1,
            )

        return ended

    def received(self) -> list[KvLinkCount]:
        """The KV fetched in, lifetime, per source pool (bytes landed, seconds from request to last
        byte, fetches that landed any): the ``MAX_KV_LINKS`` sources that sent the most bytes."""
        by_bytes = sorted(self._received.values(), key=lambda c: c.nbytes, reverse=True)
        return by_bytes[:MAX_KV_LINKS]

    def _connect(
        self, endpoint: str, peer_public_key: bytes | None, part_bytes: int
    ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """A fetch's DEALER, connecting, and its monitor (attached first: no event is missed)."""
        if self._ctx is None:
            raise RuntimeError("KvTransfer.start() first")
        sock = self._ctx.socket(zmq.DEALER)
        monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        try:
            if self._keys is not None and peer_public_key is not None:
                setup_client(sock, ClientCurve(self._keys, peer_public_key))
            sock.setsockopt(zmq.LINGER, 0)
            # No part bigger than a layer's block (plus what CurveZMQ adds to each on the wire).
            sock.setsockopt(zmq.MAXMSGSIZE, max(part_bytes, 1 << 16) + _CURVE_OVERHEAD)
            sock.setsockopt(zmq.RCVHWM, 2 * self._window + 16)  # credit keeps it at the window
            sock.setsockopt(zmq.HEARTBEAT_IVL, PING_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PING_TIMEOUT_MS)
            sock.connect(endpoint)
        except (zmq.ZMQError, ValueError, TypeError):
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise
        return sock, monitor

    # --- lifecycle ---------------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kv transfer task failed", exc_info=task.exception())

    async def close(self) -> None:
        """Stop serving and fetching: fetches under way fail (their slots FAILED), grants end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
