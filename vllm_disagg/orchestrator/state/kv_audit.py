"""Did each decode engine load the KV it was handed, or compute the prompt itself? From its counters.

A decode engine whose KV pull fails may compute the prompt itself (vLLM's
``kv_load_failure_policy: recompute``): the answer is right but slow, and nothing errors. vLLM 0.32's
per-request figure cannot tell (D reports P's cache hits as its own ``cached_tokens``), but its
lifetime counters can: every prompt token it did not compute is either pulled from a prefill engine
(``prompt_tokens_by_source{source="external_kv_transfer"}``) or found in its own prefix cache
(``local_cache_hit``). The agent reports both in each heartbeat (``MetricsSnapshot``).

So each disaggregated decode leg that answered is a ``Handover`` of its prompt's tokens, and a
``DecodeAudit`` per decode instance keeps a balance: the tokens handed over in legs the counters must
already include, minus what the counters grew by. A shortfall of a block or more was computed
instead of loaded: a ``Recomputed`` verdict naming the legs it may come from.

Why the comparison is sound (no verdict on a healthy engine):

- vLLM counts a request's prompt tokens when it emits the request's first token, before the gateway
  sees that token; a leg that answered by ``scraped - SETTLE_S`` (``scraped``: when the scrape began,
  from the snapshot's ``age_s``) is in that scrape's counters. A heartbeat may wait in the socket
  while the orchestrator is starved of CPU (seconds, on a busy host): that wait is the heartbeat's
  wall-clock delay (``sent_at`` to arrival) beyond the least delay seen from that agent, which absorbs
  any clock offset between the hosts; it is taken off the horizon too.
- Only legs sent after the baseline scrape arrived count, so none is in the baseline.
- Legs are known from when they are sent, so tokens counted before a leg answered are never taken for
  other traffic's.
- Tokens counted early (legs not yet settled) or from other traffic (colocated requests' cache hits)
  only make the counters run ahead: a surplus, never a shortfall. A surplus beyond what the unsettled
  legs can explain is permanent and is dropped, so it cannot hide a later shortfall for long.
- A counter that goes back (the engine restarted) starts the audit afresh, dropping legs in doubt.

A shortfall of less than a block, or of one token per candidate leg, is rounding, not a recompute:
it is forgiven. Which leg of several recomputed cannot be told from counters: a verdict names every
leg settled in this check or the one before (``candidates``); the others are then clean.
A partial load (some blocks failed, the rest recomputed) keeps vLLM's first count and is not seen.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from vllm_disagg.protocol.messages import MetricsSnapshot

SETTLE_S = 1.0  # slack between a leg's answer and a scrape sure to include it (loop lag, transit)
_KEYS = itertools.count(1)  # leg keys, unique across sessions: a late answer never hits a new session's leg


@dataclass(frozen=True, slots=True)
class Handover:
    """A disaggregated decode leg that answered: ``tokens`` of prompt its engine should not compute."""

    request_id: str
    prefill: str
    tokens: int
    sent_at: float  # orchestrator monotonic time the leg was sent
    answered_at: float  # ... and when its answer (at least its first byte) was back


@dataclass(frozen=True, slots=True)
class Recomputed:
    """A decode instance computed ``tokens`` prompt tokens that were handed over to it, in one of ``legs``."""

    decode: str
    tokens: int
    legs: tuple[Handover, ...]

    @property
    def prefills(self) -> tuple[str, ...]:
        """The prefill instances of the legs in question, each once, in order."""
        return tuple(dict.fromkeys(leg.prefill for leg in self.legs))

    def note(self) -> str:
        """What the request records say about it."""
        others = len(self.legs) - 1
        among = f" (this request or one of {others} others settled with it)" if others else ""
        return (
            f"decode instance '{self.decode}' computed {self.tokens} prompt tokens it was handed by "
            f"prefill{'s' if len(self.prefills) > 1 else ''} {', '.join(self.prefills)} instead of "
            f"loading them{among}: its prompt_tokens_by_source counters fell short"
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one snapshot settled: legs now known loaded, and a verdict on the others (or None)."""

    decode: str = ""
    loaded: tuple[Handover, ...] = ()
    recomputed: Recomputed | None = None


NOTHING = Outcome()


def loaded_tokens(m: MetricsSnapshot) -> int | None:
    """Prompt tokens the engine did not compute (pulled or its own cache hits); None if not exported."""
    if m.prompt_tokens_transferred is None or m.prompt_tokens_cached is None:
        return None
    return m.prompt_tokens_transferred + m.prompt_tokens_cached


class DecodeAudit:
    """The balance of one decode instance's session. Plain state; ``now`` always comes from the caller.

    A leg is ``dispatch``ed when sent (its tokens may be counted from then on), ``answered`` once it
    answered, or ``abandon``ed when it failed (whatever it counted stays as surplus).
    """

    def __init__(self, decode: str, block_size: int) -> None:
        self.decode = decode
        self._block = max(1, block_size)
        self._base: int | None = None  # counter value that ``_handed`` is measured from
        self._last = 0  # the counter's last value (a smaller one means the engine restarted)
        self._in_flight: dict[int, Handover] = {}  # sent, not answered yet
        self._pending: list[Handover] = []  # answered, not yet surely in a scrape
        self._handed = 0  # tokens of the legs settled since the baseline
        self._recent: list[Handover] = []  # settled at the check before this one, not yet judged
        self._least_delay = math.inf  # the least (arrival wall - sent_at) seen: clock offset + transit

    @property
    def active(self) -> bool:
        """Does the audit judge this instance's legs (it exports the counters and has a baseline)?"""
        return self._base is not None

    def dispatch(
        self, request_id: str, prefill: str, tokens: int, now: float, key: int | None = None
    ) -> int | None:
        """A leg is sent: its key (``key`` when given: a gateway worker's), or None when the audit
        cannot judge it (no baseline yet)."""
        if self._base is None:
            return None
        if key is None:
            key = next(_KEYS)
        self._in_flight[key] = Handover(request_id, prefill, tokens, now, now)
        return key

    def answered(self, key: int, now: float) -> None:
        """The leg answered: it is judged once a scrape surely includes it."""
        leg = self._in_flight.pop(key, None)
        if leg is not None:
            self._pending.append(dataclasses.replace(leg, answered_at=now))

    def abandon(self, key: int) -> None:
        """The leg failed: it is not judged."""
        self._in_flight.pop(key, None)

    def observe(self, snapshot: MetricsSnapshot, now: float, wall: float | None = None) -> Outcome:
        """Fold in a heartbeat's snapshot (handled at ``now``, monotonic; ``wall`` the same instant on the
        wall clock) and judge the legs it settles."""
        queued = self._queued(snapshot, wall)  # every heartbeat teaches the least delay
        loaded = loaded_tokens(snapshot)
        if loaded is None or self._base is None or loaded < self._last:
            self._restart(loaded)
            return NOTHING
        self._last = loaded
        horizon = now - snapshot.age_s - queued - SETTLE_S
        settled = [leg for leg in self._pending if leg.answered_at <= horizon]
        if settled:
            self._pending = [leg for leg in self._pending if leg.answered_at > horizon]
            self._handed += sum(leg.tokens for leg in settled)
        candidates = self._recent + settled
        balance = self._handed - (loaded - self._base)  # > 0: handed over, yet not counted as loaded
        if candidates and balance >= max(self._block, len(candidates)):
            self._base -= balance  # reported once
            self._recent = []
            return Outcome(self.decode, recomputed=Recomputed(self.decode, balance, tuple(candidates)))
        if balance > 0:
            self._base -= balance  # rounding: forgiven
        else:
            unsettled = sum(leg.tokens for leg in self._pending)
            unsettled += sum(leg.tokens for leg in self._in_flight.values())
            if -balance > unsettled:  # more surplus than early counts explain: other traffic's
                self._base += -balance - unsettled
        cleared, self._recent = self._recent, settled
        return Outcome(self.decode, loaded=tuple(cleared)) if cleared else NOTHING

    def _queued(self, snapshot: MetricsSnapshot, wall: float | None) -> float:
        """How long this heartbeat waited beyond the least wait seen from this agent (>= 0)."""
        if wall is None or not snapshot.sent_at:
            return 0.0
        delay = wall - snapshot.sent_at
        self._least_delay = min(self._least_delay, delay)
        return delay - self._least_delay

    def _restart(self, loaded: int | None) -> None:
        """Start afresh from this counter value (None: the engine does not export it); legs in doubt go."""
        self._base = loaded
        self._last = loaded or 0
        self._in_flight.clear()
        self._pending = []
        self._handed = 0
        self._recent = []
