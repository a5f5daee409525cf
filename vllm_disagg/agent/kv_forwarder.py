"""Forwarding the engine's KV-cache events to the orchestrator, which indexes who caches what.

A SUB socket on the engine's KV-events PUB (vLLM's ``--kv-events-config``, an ``ipc://`` socket in the
agent's runtime directory; the sim's ``--kv-events-port``, on loopback). Each loop drains everything
readable: every engine batch is decoded (``decode_frames``), turned into protocol ``KvEvent``s, applied to
the agent's ``KvMirror`` of the engine's blocks and queued; then, while a session is registered, its queue
goes out as ``KvEvents`` messages of at most ``MAX_MESSAGE_EVENTS`` events and ``MAX_MESSAGE_ITEMS`` token
ids plus hashes, far below the orchestrator's 1 MiB frame limit (an event too big for one message is split
into chained pieces first).

Each session (one per orchestrator replica) has a *lane* of its own: its queue, its resync, its
``missed`` count and its messages' ``seq``. A batch is queued once and shared by every lane's queue.

Every ``Welcome`` starts a session whose index of this instance is empty (the orchestrator drops it at
each Hello, and a restarted one never had it): that session's queue is discarded and a *resync* goes
first to it alone, the mirror's ``snapshot()`` (a ``cleared``, then every block the engine holds), so
its index is rebuilt whatever was lost before; the other sessions go on with their queues. The same
resync replaces a lane's queue when it outgrows its bound (that orchestrator unreachable for long), so
no engine batch is ever dropped for want of room.

Nothing here is fatal. A batch that does not decode is logged and counted (``bad_batches``); a gap in
the engine's sequence numbers adds to the next message's ``missed``. An engine restart (the
supervisor's ``on_restart``, or the engine's sequence going back) is a ``cleared``: the new engine's
cache starts empty.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from vllm_disagg.agent.engine_command import kv_events_endpoint
from vllm_disagg.agent.kv_mirror import KvMirror
from vllm_disagg.config import AgentConfig
from vllm_disagg.errors import KvEventsError
from vllm_disagg.protocol.messages import MEDIUM_DISK, MEDIUM_GPU, MEDIUM_POOL, KvEvent, KvEvents
from vllm_disagg.wire import kv_events

log = logging.getLogger(__name__)

MAX_MESSAGE_ITEMS = 50_000  # token ids + block hashes in one KvEvents (~450 KB at worst)
MAX_MESSAGE_EVENTS = 2_000
MAX_QUEUED_ITEMS = 1_000_000  # held while they cannot be sent; beyond it a resync replaces them
FLUSH_INTERVAL_S = 0.01  # engine batches published within this long go out as one message
POLL_MS = 100  # a queue held back (not registered, not connected) is retried this often
MAX_DRAIN = 10_000  # engine batches read per loop before sending, so a flood cannot starve the sends
_RCV_HWM = 10_000  # engine batches the SUB socket holds before libzmq drops (seen as sequence gaps)
_CLEARED = KvEvent(kind="cleared")


def forwarder_endpoint(cfg: AgentConfig) -> str:
    """The engine's KV-events endpoint the agent subscribes to; "" for none (attach mode without one)."""
    if cfg.attach_url:
        return cfg.kv_events_listen or cfg.kv_events_endpoint
    # The agent launched the engine on this host, where it publishes for this agent alone.
    return kv_events_endpoint(cfg)


def _items(event: KvEvent) -> int:
    return len(event.block_hashes) + len(event.token_ids) + 1


def medium_of(engine_medium: str) -> str:
    """The index's medium for blocks an engine reports in ``engine_medium``: its prefix cache; a
    connector's host-memory tier, which the engine loads on a hit as from a pool; any other tier of
    its connector (storage), as from a disk tier (``protocol/kv_connectors.py``)."""
    if engine_medium == kv_events.GPU:
        return MEDIUM_GPU
    return MEDIUM_POOL if engine_medium == "cpu" else MEDIUM_DISK


def to_protocol(event: kv_events.KvEvent, max_items: int = MAX_MESSAGE_ITEMS) -> Iterator[KvEvent]:
    """One engine event as protocol events of at most ``max_items`` items each (chained pieces)."""
    if isinstance(event, kv_events.BlockStored):
        if event.keyed:
            return  # not indexable by tokens; its children then have an unknown parent and are skipped too
        medium = medium_of(event.medium)
        size = event.block_size
        per_piece = max(1, (max_items - 1) // (size + 1))
        parent = event.parent_block_hash
        hashes = event.block_hashes
        for start in range(0, len(hashes), per_piece):
            piece = hashes[start : start + per_piece]
            tokens = event.token_ids[start * size : (start + len(piece)) * size]
            yield KvEvent("stored", list(piece), parent, list(tokens), size, medium)
            parent = piece[-1]  # the next piece chains to this one's last block
    elif isinstance(event, kv_events.BlockRemoved):
        hashes = event.block_hashes
        per_piece = max(1, max_items - 1)
        for start in range(0, len(hashes), per_piece):
            yield KvEvent("removed", list(hashes[start : start + per_piece]), medium=medium_of(event.medium))
    else:
        yield _CLEARED


@dataclass(slots=True)
class _Batch:
    """Queued events: of one engine batch, or a resync (``counted`` False: bounded by the mirror)."""

    events: list[KvEvent]
    counted: bool = True


class KvSink(Protocol):
    """Where a lane's messages go: one of the agent's sessions (``AgentSession``)."""

    registered: bool

    def send_kv_events(self, message: KvEvents) -> bool:
        """Send ``message``; False when not registered or not connected (nothing was sent)."""
        ...


class _Lane:
    """What one session's orchestrator has yet to receive."""

    def __init__(self, sink: KvSink) -> None:
        self.sink = sink
        self.queue: deque[_Batch] = deque()
        self.offset = 0  # events of the front batch already sent
        self.queued_items = 0  # of counted batches
        self.resync = False  # its orchestrator's index needs the whole mirror before anything else
        self.missed = 0  # not yet reported
        self.seq = 0  # of the last KvEvents sent on it; grows for the agent's whole life

    @property
    def queued_events(self) -> int:
        return sum(len(b.events) for b in self.queue) - self.offset

    def discard(self) -> None:
        self.queue.clear()
        self.offset = 0
        self.queued_items = 0


class KvEventForwarder:
    """Subscribes to the engine's KV events and sends them through each of the agent's sessions."""

    def __init__(
        self,
        endpoint: str,
        sessions: KvSink | Sequence[KvSink],
        *,
        max_message_items: int = MAX_MESSAGE_ITEMS,
        max_message_events: int = MAX_MESSAGE_EVENTS,
        max_queued_items: int = MAX_QUEUED_ITEMS,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        mirror: KvMirror | None = None,
        bind: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self._bind = bind  # bind ``endpoint`` and let the engine's PUB connect (``--kv-events-listen``)
        self._flush_interval_s = flush_interval_s
        sinks = list(sessions) if isinstance(sessions, Sequence) else [sessions]
        self._lanes = [_Lane(sink) for sink in sinks]
        self._max_items = max_message_items
        self._max_events = max_message_events
        self._max_queued = max_queued_items
        self._last_seq: int | None = None  # the engine's, of the last batch read
        self._sub: zmq.Socket[bytes] | None = None  # a blocking view of the SUB socket, for draining
        self.mirror = mirror if mirror is not None else KvMirror()
        # Other sources' whole state, appended to each resync (the KV pool's ``pool_snapshot``).
        self.snapshots: list[Callable[[], list[KvEvent]]] = []
        self.batches = 0  # engine batches decoded
        self.bad_batches = 0  # engine batches that did not decode
        self.missed_total = 0  # engine batches lost, over the agent's life
        self.events_sent = 0  # over every session
        self.resyncs = 0  # resyncs started, over the agent's life and every session

    @property
    def engine_seq(self) -> int | None:
        """The engine's sequence number of the last batch read (None before one, and after a restart)."""
        return self._last_seq

    @property
    def seq(self) -> int:
        """KvEvents messages sent, over every session (each session's messages count on their own)."""
        return sum(lane.seq for lane in self._lanes)

    @property
    def queued_events(self) -> int:
        """Events waiting to be sent, to the session furthest behind."""
        return max((lane.queued_events for lane in self._lanes), default=0)

    @property
    def resync_pending(self) -> bool:
        """True while a resync is due to some session but could not start (not registered)."""
        return any(lane.resync for lane in self._lanes)

    async def run(self) -> None:
        """Subscribe, then drain and forward until cancelled."""
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, _RCV_HWM)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if self._bind:  # the engine's PUB connects here, and again after its restarts
                sock.bind(self.endpoint)
            else:
                sock.connect(self.endpoint)  # connects whenever the engine binds, and again after restarts
            self._sub = zmq.Socket.shadow(sock.underlying)
            log.info("forwarding KV events from %s", self.endpoint)
            while True:
                if await sock.poll(timeout=POLL_MS) and self._flush_interval_s > 0:
                    # Gather what the engine publishes in the next moment into one message: a
                    # busy engine publishes a batch per step, and each message costs the
                    # orchestrator a frame to decode. The index lags by this much at most.
                    await asyncio.sleep(self._flush_interval_s)
                self.drain()
                self.flush()
                await asyncio.sleep(0)  # a flood keeps the socket readable: let the session talk
        finally:
            self._sub = None
            sock.close(linger=0)
            ctx.term()

    def drain(self) -> int:
        """Read and queue every engine batch readable now (at most ``MAX_DRAIN``); how many were read."""
        sub = self._sub
        read = 0
        while sub is not None and read < MAX_DRAIN:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            read += 1
            self.feed(frames)
        return read

    def feed(self, frames: list[bytes]) -> None:
        """Take one engine batch as the engine published it."""
        try:
            batch = kv_events.decode_frames(frames)
        except KvEventsError as exc:
            self.bad_batches += 1
            if self.bad_batches & (self.bad_batches - 1) == 0:  # the 1st, 2nd, 4th, 8th...: no flood
                log.warning(
                    "dropped a KV event batch that does not decode (%d so far): %s", self.bad_batches, exc
                )
            return
        self.batches += 1
        last, self._last_seq = self._last_seq, batch.seq
        if last is not None and batch.seq <= last:
            log.info("the engine's KV event sequence went back (%d -> %d): it restarted", last, batch.seq)
            self._record([_CLEARED])
        elif last is not None and batch.seq > last + 1:
            self._lost(batch.seq - last - 1)
        events = [piece for event in batch.events for piece in to_protocol(event, self._max_items)]
        engine = [e for e in events if e.medium == MEDIUM_GPU]
        if engine:
            self._record(engine)
        if len(engine) < len(events):  # a connector's tiers: indexed apart, never mirrored (lost at a resync)
            self.forward([e for e in events if e.medium != MEDIUM_GPU])

    def engine_restarted(self) -> None:
        """The supervisor replaced the engine: what the old one published is read first, then cleared."""
        self.drain()
        self._last_seq = None  # the new engine counts from 0
        self._record([_CLEARED])

    def session_started(self, session: KvSink | None = None) -> None:
        """A ``Welcome`` on ``session`` (None: on every one): its orchestrator knows nothing of this
        instance's blocks; resync it first. The other sessions' queues go on untouched."""
        lanes = [lane for lane in self._lanes if session is None or lane.sink is session]
        if not lanes:
            raise ValueError("a Welcome on a session this forwarder does not send to")
        for lane in lanes:
            lane.discard()
            lane.resync = True
            self._flush(lane)

    def _lost(self, batches: int) -> None:
        for lane in self._lanes:
            lane.missed += batches
        self.missed_total += batches

    def forward(self, events: list[KvEvent]) -> None:
        """Queue events of another source (the agent's KV pool, medium ``pool``) with the engine's:
        never mirrored; every resync asks ``snapshots`` for that source's whole state instead."""
        self._enqueue(events)

    def _record(self, events: list[KvEvent]) -> None:
        self.mirror.apply(events)
        self._enqueue(events)

    def _enqueue(self, events: list[KvEvent]) -> None:
        batch = _Batch(events)  # one for every lane: they only read it
        items = sum(map(_items, events))
        for lane in self._lanes:
            if lane.resync:
                continue  # the resync is built from the mirror when it starts: it will hold these
            lane.queue.append(batch)
            lane.queued_items += items
            if lane.queued_items > self._max_queued:
                # That orchestrator has been unreachable for long: the mirror holds the state in
                # less room than the history of how it came about.
                log.warning(
                    "%d KV event items could not be sent; a resync of the index will replace them",
                    lane.queued_items,
                )
                lane.discard()
                lane.resync = True

    def _start_resync(self, lane: _Lane) -> None:
        events = self.mirror.snapshot(self._max_items)
        for snapshot in self.snapshots:
            events += snapshot()
        lane.discard()
        lane.queue.append(_Batch(events, counted=False))
        lane.resync = False
        self.resyncs += 1
        log.info(
            "resyncing the orchestrator's KV index: %d blocks in %d events", len(self.mirror), len(events)
        )

    def flush(self) -> int:
        """Send what is queued to every session that is registered and connected; messages sent."""
        return sum(self._flush(lane) for lane in self._lanes)

    def _flush(self, lane: _Lane) -> int:
        if not lane.sink.registered:
            return 0
        if lane.resync:
            self._start_resync(lane)
        sent = 0
        while lane.queue or lane.missed:
            events, counted, batches, offset = self._next_message(lane)
            message = KvEvents(seq=lane.seq + 1, events=events, missed=lane.missed)
            if not lane.sink.send_kv_events(message):
                break  # not connected, or its queue is full: keep everything for the next try
            lane.seq += 1
            self.events_sent += len(events)
            lane.missed = 0
            for _ in range(batches):
                lane.queue.popleft()
            lane.offset = offset
            lane.queued_items -= counted
            sent += 1
        return sent

    def _next_message(self, lane: _Lane) -> tuple[list[KvEvent], int, int, int]:
        """The lane's next message: its events, their counted items, the batches it finishes, the new
        front offset."""
        events: list[KvEvent] = []
        items = counted = 0
        offset = lane.offset
        batches = 0
        for batch in lane.queue:
            while offset < len(batch.events):
                event = batch.events[offset]
                cost = _items(event)
                if events and (len(events) >= self._max_events or items + cost > self._max_items):
                    return events, counted, batches, offset
                events.append(event)
                items += cost
                counted += cost if batch.counted else 0
                offset += 1
            batches += 1
            offset = 0
        return events, counted, batches, offset
