"""The cluster's event log: joins, state changes, breakers, fallbacks, resumes, KV recomputes.

The registry and the gateway ``publish`` as things happen (synchronously, never blocking); the admin
API streams the log as server-sent events (``GET /admin/v1/events``) to the dashboard and
``vllm-disagg events --follow``. The last ``capacity`` events are kept, each with a sequence number,
so a client that reconnects with ``Last-Event-ID`` misses nothing that is still kept. A subscriber too
slow to keep up is dropped (told how far it got) rather than letting its queue grow.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.state.views import InstanceView

EVENT_KINDS = (
    "joined",
    "not_resumable",
    "state",
    "role",
    "breaker",
    "link",
    "fallback",
    "resume",
    "kv_recomputed",
    "removed",
    "supervisor",  # what started a process (``up``) restarted it or gave up on it
    "leader",  # this replica began or stopped leading (orchestrator/replicas)
)


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened; ``fields`` depend on ``kind`` (docs/operations.md, "Events")."""

    seq: int
    at: float  # wall seconds
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "at": round(self.at, 3), "kind": self.kind, **self.fields}

    def sse(self) -> bytes:
        """The event as one server-sent event."""
        return b"id: %d\nevent: %s\ndata: %s\n\n" % (
            self.seq,
            self.kind.encode(),
            jsonutil.dumps(self.to_json()),
        )


class Subscription:
    """One reader of the live log: ``next()`` waits for the next event; None once dropped."""

    def __init__(self, log: EventLog, capacity: int) -> None:
        self._log = log
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue(capacity)
        self.dropped = False

    def offer(self, event: Event) -> None:
        if self.dropped:
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped = True  # too slow: end its stream (it may reconnect with Last-Event-ID)
            self._queue.get_nowait()
            self._queue.put_nowait(None)

    async def next(self) -> Event | None:
        return await self._queue.get()

    def close(self) -> None:
        self._log.unsubscribe(self)


class EventLog:
    """The last ``capacity`` events and the live subscribers."""

    def __init__(self, wall: Callable[[], float], capacity: int = 1000, per_subscriber: int = 1000) -> None:
        self._wall = wall
        self._events: deque[Event] = deque(maxlen=capacity)
        self._seq = 0
        self._subscribers: set[Subscription] = set()
        self._per_subscriber = per_subscriber

    def publish_fields(self, kind: str, fields: dict[str, Any]) -> None:
        """``publish`` for callers holding the fields as a dict (the registry's hook)."""
        self.publish(kind, **fields)

    def publish(self, kind: str, **fields: Any) -> Event:
        """Record an event and hand it to every subscriber (never blocks)."""
        self._seq += 1
        event = Event(self._seq, self._wall(), kind, fields)
        self._events.append(event)
        for sub in self._subscribers:
            sub.offer(event)
        return event

    def since(self, seq: int) -> Iterator[Event]:
        """Kept events after ``seq``, oldest first."""
        return (e for e in self._events if e.seq > seq)

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self._per_subscriber)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    @property
    def last_seq(self) -> int:
        return self._seq


def instance_events(old: InstanceView | None, new: InstanceView) -> list[tuple[str, dict[str, Any]]]:
    """The events a change of one instance's view makes (kind, fields): a new session joined (and, once
    per session, an engine that cannot resume streams), a state changed, a breaker moved."""
    events: list[tuple[str, dict[str, Any]]] = []
    agent_id = new.agent_id
    if old is None or old.session != new.session:
        info = new.info
        joined = {"instance": agent_id, "session": new.session, "role": info.role, "model": info.model}
        events.append(("joined", {**joined, "url": info.url}))
        missing = info.capabilities.missing()
        if missing:  # said once per session, not per request (docs/operations.md, "Engines")
            events.append(("not_resumable", {"instance": agent_id, "url": info.url, "missing": missing}))
    if old is None or old.state != new.state:
        reason = new.dead_reason if new.state == "dead" else new.suspect_reason
        state = {"instance": agent_id, "from": old.state if old else None, "to": new.state, "reason": reason}
        events.append(("state", state))
    if old is not None and old.breaker.state != new.breaker.state:
        breaker = {"instance": agent_id, "from": old.breaker.state, "to": new.breaker.state}
        events.append(("breaker", {**breaker, "failures": new.breaker.failures}))
    return events
