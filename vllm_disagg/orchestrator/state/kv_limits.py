"""Bounds on what one agent may make the KV index hold: blocks per medium, and stored blocks per second.

An agent's KV events are claims: the scheduler routes by them, and a pool claim can send a request
straight to decode. A keyed agent that floods ``stored`` events could grow the index without bound
(memory, and the cost of every lookup) or churn it; so each agent may have at most ``max_blocks``
blocks indexed per medium, and its ``stored`` blocks are admitted through a token bucket of
``rate`` blocks per second (``burst`` at most at once). What is beyond either is dropped.

Only ``stored`` blocks are ever dropped, and a ``stored`` event is cut to its leading blocks, never
split: the index stays a prefix-closed subset of what the agent holds. A later event chained to a
dropped block is skipped by the index (its parent is unknown), and a ``removed`` of a dropped block is
a no-op, so nothing dropped leaves an entry behind; an agent can only be under-claimed (a lost cache
hit, a prompt computed again), never over-claimed (a request sent where the KV is not). ``removed`` and
``cleared`` are always applied: they only shrink the index, and dropping one would leave a claim the
agent has withdrawn. Dropping the agent's whole entries instead would also be consistent, but would
cost an honest agent with a burst of stores (a pool resynced after a reconnect) all its hits.

``admit`` is the decision: a pure function of one event, what the agent already has indexed and its
bucket's level (``refill``: a pure function of the bucket and ``now``). ``KvGate`` keeps the
buckets, logs once per agent per session, and tells a sink (the orchestrator's metrics) what it
dropped and why.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import KvEvent

log = logging.getLogger(__name__)

DropSink = Callable[[str, str, str, int], None]  # (agent id, medium, reason, blocks dropped)
REASONS = ("over_cap", "over_rate")


@dataclass(frozen=True, slots=True)
class KvLimits:
    """Per agent: blocks indexed per medium, and stored blocks admitted per second (and at once)."""

    max_blocks: int = 1_000_000  # per agent and medium: 16M tokens of 16-token blocks
    rate: float = 50_000.0  # stored blocks per second, sustained (a prefill of ~1M tokens/s)
    burst: float = 1_000_000.0  # stored blocks at once: a whole pool reported after a reconnect

    def __post_init__(self) -> None:
        if type(self.max_blocks) is not int or self.max_blocks < 1:
            raise ConfigError(f"kv_limits.max_blocks must be an integer >= 1, got {self.max_blocks!r}")
        for name in ("rate", "burst"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"kv_limits.{name} must be a number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: ``level`` blocks may be stored now, as of ``at`` (clock seconds)."""

    level: float
    at: float


def refill(bucket: Bucket, limits: KvLimits, now: float) -> Bucket:
    """The bucket at ``now`` (a clock that went back refills nothing)."""
    if now <= bucket.at:
        return bucket
    return Bucket(min(limits.burst, bucket.level + (now - bucket.at) * limits.rate), now)


@dataclass(frozen=True, slots=True)
class Admitted:
    """``admit``'s answer for one event: what to apply of it (None: nothing), the blocks it takes of
    the bucket, and the blocks dropped and why."""

    event: KvEvent | None
    used: int = 0
    dropped: int = 0
    reason: str = ""  # one of ``REASONS`` when some were dropped


def admit(event: KvEvent, indexed: int, level: float, limits: KvLimits) -> Admitted:
    """What the index applies of one of an agent's events: a ``stored`` one is cut to the blocks the
    cap (``indexed``: blocks the agent has indexed in the event's medium now) and the bucket's
    ``level`` allow; anything else as it is."""
    n = len(event.block_hashes)
    if event.kind != "stored" or n == 0:
        return Admitted(event)
    room = max(0, limits.max_blocks - indexed)
    allowed = min(n, room, int(level))
    if allowed == n:
        return Admitted(event, n)
    reason = "over_cap" if room < min(n, int(level)) else "over_rate"
    if allowed == 0:
        return Admitted(None, 0, n, reason)
    # Its leading blocks: the index stays prefix-closed.
    tokens = event.token_ids[: allowed * event.block_size] if event.block_size > 0 else []
    cut = replace(event, block_hashes=event.block_hashes[:allowed], token_ids=tokens)
    return Admitted(cut, allowed, n - allowed, reason)


class KvGate:
    """The buckets of every agent, and the one warning per agent and session."""

    def __init__(self, limits: KvLimits, clock: Callable[[], float], sink: DropSink | None = None) -> None:
        self.limits = limits
        self._clock = clock
        self.sink = sink  # set once the metrics exist (they read the index the gate guards)
        self._buckets: dict[str, Bucket] = {}
        self._warned: set[str] = set()

    def admit(
        self, agent_id: str, events: Sequence[KvEvent], indexed: Callable[[str], int]
    ) -> Iterator[KvEvent]:
        """The events of ``agent_id`` the index may apply (see ``admit``), one at a time: the caller
        applies each before the next is judged (``indexed(medium)`` then counts it, and a removal
        earlier in the batch makes room). Drops are counted and logged once the batch is done."""
        now = self._clock()
        bucket = refill(self._buckets.get(agent_id) or Bucket(self.limits.burst, now), self.limits, now)
        level = bucket.level
        dropped: dict[tuple[str, str], int] = {}
        try:
            for event in events:
                got = admit(event, indexed(event.medium), level, self.limits)
                level -= got.used
                if got.dropped:
                    key = (event.medium, got.reason)
                    dropped[key] = dropped.get(key, 0) + got.dropped
                if got.event is not None:
                    yield got.event
        finally:
            self._buckets[agent_id] = Bucket(level, bucket.at)
            if dropped:
                self._dropped(agent_id, dropped)

    def _dropped(self, agent_id: str, dropped: dict[tuple[str, str], int]) -> None:
        if self.sink is not None:
            for (medium, reason), blocks in dropped.items():
                self.sink(agent_id, medium, reason, blocks)
        if agent_id not in self._warned:
            self._warned.add(agent_id)
            limits = self.limits
            log.warning(
                "instance %s: KV events beyond its limits dropped (%s; at most %d blocks per medium, "
                "%g stored blocks/s): its cache is under-reported from now on; further drops are only "
                "counted (vllm_disagg_kv_events_dropped_total)",
                agent_id,
                ", ".join(
                    f"{blocks} {medium} blocks {reason}" for (medium, reason), blocks in dropped.items()
                ),
                limits.max_blocks,
                limits.rate,
            )

    def forget(self, agent_id: str) -> None:
        """A new session (or none): warn again if it floods too. The bucket stays, so that saying
        Hello again does not refill it."""
        self._warned.discard(agent_id)
