"""The receiver's side of one fetch: land the holder's chunks in reserved slots, layer by layer.

``KvTransfer.fetch`` reserves the slots and sends the request; ``receive`` then runs as its own task
until the fetch ends. Each part of a chunk is copied from libzmq's buffer into its slot's layer (the
one copy on this side: ZeroMQ cannot receive into a buffer of ours) and that slot's ``layers_ready``
is raised at once, so the engine may load layer ``l`` while ``l + 1`` is on the wire. Every block
lands only with the last layer, so a transfer that dies lands nothing: its slots are marked
``FAILED`` (what the engine's load waits on says it will never come) and released, which drops the
pending blocks from the pool. What was committed is what ``done`` counts.

A dead holder is noticed without waiting for the deadline: the socket's monitor reports the
connection closed (or a handshake refused, or no connection at all), and ZMTP pings close a
connection whose peer went silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vllm_disagg.agent.kv.arena import FAILED, SlotArena
from vllm_disagg.agent.kv.frames import Chunk, Credit, Done, Ping, Refused, Start, decode, encode
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool
from vllm_disagg.errors import MalformedFrame, UnsupportedVersion
from vllm_disagg.protocol.transport import send_now
from vllm_disagg.wire.block_hash import block_hash, none_hash

log = logging.getLogger(__name__)

ChunkHook = Callable[[int, Sequence[int]], None]  # (layer, slots whose layer just landed)

# Monitor events after which the holder can send nothing more on this fetch's connection.
_FATAL: dict[int, str] = {
    zmq.EVENT_DISCONNECTED: "the holder's connection closed",
    zmq.EVENT_CONNECT_RETRIED: "cannot connect to the holder",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the holder refused this agent's key (no live grant names it)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CurveZMQ handshake with the holder failed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "CurveZMQ handshake with the holder failed (wrong key?)",
}
MONITOR_EVENTS = sum(_FATAL)
_MAX_HEADER_BYTES = 1 << 16
_DONE_LINGER_MS = 200  # time for the last Done to leave; the holder's ping finds the rest out


class Failed(Exception):
    """The fetch cannot land any more blocks; the message says why."""


@dataclass(frozen=True, slots=True)
class FetchEnded:
    """How one fetch ended: kept (a few) for the log, the agent's report and the tests."""

    token: str = field(repr=False)
    endpoint: str
    reserved: int
    landed: int
    reason: str  # "" when every reserved block landed
    failed: bool  # the transfer broke (a holder that had fewer blocks did not fail)


@dataclass(slots=True)
class Fetch:
    """One fetch under way: its pool reservation and its connection."""

    owner: str  # the pool owner of the reserved (pending) blocks
    token: str = field(repr=False)
    endpoint: str
    keys: tuple[BlockKey, ...]  # requested = reserved, in prompt order
    slots: tuple[int, ...]
    pool: PrefixPool  # the pool the reservation is in (a reopened pool holds none of it)
    arena: SlotArena
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    timeout_s: float
    window: int
    done: asyncio.Future[int]
    peer_gone: bool = False  # the connection is known closed: nothing more can be sent on it
    # Each key's parent key (None: the prompt's first block), so the holder's token ids are checked.
    parents: tuple[BlockKey | None, ...] = ()


class _Landing:
    """Where the next chunk must start, and what has landed; raises ``Failed`` on anything else."""

    def __init__(self, fetch: Fetch, node: PoolNode, on_chunk: ChunkHook | None) -> None:
        self._f = fetch
        self._node = node
        self._on_chunk = on_chunk
        self._geometry = fetch.arena.geometry
        self.served: int | None = None  # blocks the holder will send, once it said so
        self.complete = False
        self._layer = 0
        self._first = 0
        self._unacked = 0
        self._credit_every = max(1, fetch.window // 4)  # few credit frames, holder never starved

    def take(self, parts: list[zmq.Frame]) -> None:
        try:
            frame = decode(parts[0].buffer, _MAX_HEADER_BYTES)
        except UnsupportedVersion as exc:  # never sent by a holder that answers in our version
            raise Failed(f"the holder speaks a later version: {exc}") from None
        except MalformedFrame as exc:
            raise Failed(f"garbage from the holder: {exc}") from None
        match frame:
            case Chunk() if self.served is not None:
                self._chunk(frame, parts[1:])
            case Start() if self.served is None:
                self._start(frame)
            case Refused():
                raise Failed(f"refused: {frame.reason}")
            case Ping():
                pass
            case _:
                raise Failed(f"unexpected {type(frame).__name__} from the holder")

    def _start(self, start: Start) -> None:
        if start.geometry != self._geometry:
            raise Failed(f"geometry mismatch: the holder's {start.geometry}, ours {self._geometry}")
        if start.blocks > len(self._f.keys):
            raise Failed(f"the holder would send {start.blocks} of {len(self._f.keys)} blocks")
        self.served = start.blocks
        _check_tokens(self._f, start)
        extras = start.extras or (None,) * len(start.tokens)
        for key, tokens, extra in zip(self._f.keys, start.tokens, extras, strict=False):
            if tokens:
                self._f.pool.describe(self._f.owner, key, tokens, extra)
        for slot in self._f.slots[start.blocks :]:  # will never come: let a waiting load give up now
            self._f.arena.set_layers_ready(slot, FAILED)
        self.complete = start.blocks == 0

    def _chunk(self, chunk: Chunk, parts: list[zmq.Frame]) -> None:
        assert self.served is not None
        if self._node.arena is not self._f.arena:
            raise Failed("the pool was reopened during the fetch")
        if (chunk.layer, chunk.first) != (self._layer, self._first):
            raise Failed(
                f"chunk out of order: layer {chunk.layer} block {chunk.first}, "
                f"expected layer {self._layer} block {self._first}"
            )
        end = self._first + len(parts)
        if not parts or end > self.served:
            raise Failed(f"chunk of {len(parts)} blocks at {self._first} of {self.served}")
        size = self._geometry.layer_block_bytes
        arena, layer = self._f.arena, self._layer
        slots = self._f.slots[self._first : end]
        for slot, part in zip(slots, parts, strict=True):
            data = part.buffer
            if len(data) != size:
                raise Failed(f"a layer's block of {len(data)} bytes, expected {size}")
            arena.layer_view(slot, layer)[:] = data
            arena.set_layers_ready(slot, layer + 1)
        if self._on_chunk is not None:
            self._on_chunk(layer, slots)
        self._first = end
        if end == self.served:
            self._layer, self._first = layer + 1, 0
            self.complete = self._layer == self._geometry.num_layers
        self._unacked += 1
        if self._unacked >= self._credit_every and not self.complete:
            _try_send(self._f.sock, Credit(self._unacked))
            self._unacked = 0


def _check_tokens(fetch: Fetch, start: Start) -> None:
    """``Failed`` unless each block's token ids hash, with its parent's key (and its extra keys: a
    LoRA adapter's, multimodal inputs', a cache salt's), to the key asked for.

    The pool reports a block with the holder's token ids, and the orchestrator indexes it by them: a
    holder naming other tokens than its key's would make this pool claim a prompt it does not hold.
    The KV bytes themselves cannot be checked here (only an engine computing them again could).
    Blocks the holder sends no token ids for are not checked, and not indexed either (too short).
    """
    extras = start.extras or (None,) * len(start.tokens)
    for i, (key, parent, tokens, extra) in enumerate(
        zip(fetch.keys, fetch.parents, start.tokens, extras, strict=False)
    ):
        if tokens and block_hash(none_hash() if parent is None else parent, tokens, extra) != key:
            raise Failed(f"block {i}: the holder's token ids do not hash to the key asked for")


async def receive(
    fetch: Fetch, node: PoolNode, on_chunk: ChunkHook | None, record: Callable[[FetchEnded], None]
) -> None:
    """Land the fetch, commit what landed, release the rest; ``fetch.done`` and ``record`` hear how it
    ended whatever happens (a cancelled fetch too)."""
    landed, reason, failed = 0, "", True
    try:
        async with asyncio.timeout(fetch.timeout_s):
            landed = await _land(fetch, node, on_chunk)
        failed = False
        if landed < len(fetch.keys):  # not a failure: a holder's blocks may be evicted before a grant
            reason = f"the holder had {landed} of the {len(fetch.keys)} blocks"
    except TimeoutError:
        reason = f"timed out after {fetch.timeout_s:g}s"
    except Failed as exc:
        reason = str(exc)
    except asyncio.CancelledError:
        reason = "cancelled (the agent is closing)"
        raise
    finally:
        _finish(fetch, node, landed, reason, failed)
        record(FetchEnded(fetch.token, fetch.endpoint, len(fetch.keys), landed, reason, failed))


async def _land(fetch: Fetch, node: PoolNode, on_chunk: ChunkHook | None) -> int:
    landing = _Landing(fetch, node, on_chunk)
    gone = asyncio.ensure_future(_watch(fetch.monitor))  # why the connection ended, when it does
    pending: list[asyncio.Future[list[zmq.Frame]]] = []  # the one receive not yet done
    try:
        while not landing.complete:
            incoming = cast("asyncio.Future[list[zmq.Frame]]", fetch.sock.recv_multipart(copy=False))
            pending[:] = [incoming]
            if not incoming.done():  # nothing queued: wait for a message or the connection's end
                await asyncio.wait((incoming, gone), return_when=asyncio.FIRST_COMPLETED)
            if incoming.done():
                landing.take(incoming.result())
                continue
            incoming.cancel()
            await _drain(fetch.sock, landing)  # what arrived before the connection closed
            if not landing.complete:
                fetch.peer_gone = True
                raise Failed(gone.result())
    finally:
        gone.cancel()
        for incoming in pending:
            incoming.cancel()
    if node.pool is not fetch.pool:
        raise Failed("the pool was reopened during the fetch")
    served = landing.served or 0
    return len(fetch.pool.commit(fetch.owner, fetch.keys[:served]))


async def _watch(monitor: zmq.asyncio.Socket) -> str:
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if event in _FATAL:
            return _FATAL[event]


async def _drain(sock: zmq.asyncio.Socket, landing: _Landing) -> None:
    """Take every message already queued."""
    while not landing.complete and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        landing.take(await sock.recv_multipart(copy=False))


def _finish(fetch: Fetch, node: PoolNode, landed: int, reason: str, failed: bool) -> None:
    if node.pool is fetch.pool:
        for slot in fetch.slots[landed:]:
            fetch.arena.set_layers_ready(slot, FAILED)
        fetch.pool.release(fetch.owner)  # drops what is still pending: nothing half-written stays
        node.changed()
    _try_send(fetch.sock, Done(landed))  # lets the holder unpin now, not at its next ping
    fetch.sock.disable_monitor()
    fetch.monitor.close(linger=0)
    fetch.sock.close(linger=0 if fetch.peer_gone else _DONE_LINGER_MS)
    if reason:
        log.log(
            logging.WARNING if failed else logging.INFO,
            "kv fetch %s from %s: %d of %d landed: %s",
            fetch.token,
            fetch.endpoint,
            landed,
            len(fetch.keys),
            reason,
        )
    if not fetch.done.done():
        fetch.done.set_result(landed)


def _try_send(sock: zmq.asyncio.Socket, frame: Credit | Done) -> None:
    with contextlib.suppress(zmq.ZMQError):  # the holder is gone: its own pings end its side
        send_now(sock, [encode(frame)])
