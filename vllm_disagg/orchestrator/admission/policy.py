"""The admission queue's policy, pure: time is an argument, the scheduler's view comes in as a ``Fit``.

One queue per model. A request is admitted at once while its model's queue is empty and its pair
fits (``fit.py``); otherwise it waits here, where it costs nothing, rather than in an engine's queue,
where it slows every request already there. Whenever the caller drains (a request finished, metrics
moved, a timer), the best-ranked waiting request is checked again and admitted if it fits, and so on
until one does not: head of line, so no lower-ranked request ever overtakes a higher one (no priority
inversion).

Rank: the most important priority first (vLLM's numbers: lower is sooner); within a priority, the
tenant furthest behind its weighted share (start-time fair queuing: each tenant's virtual time grows
by a request's cost over its weight when one is admitted, and a tenant that was idle starts at the
system's virtual time, so it banks no credit); among tenants level with their share, the earliest
deadline (arrival plus TTFT target). With one tenant this is earliest-deadline-first.

Standing: a tenant offering more than its weighted share of the recent load (its part of the last
``DEMAND_WINDOW`` arrivals, past its weight's part by ``OVER_SHARE_TOLERANCE``) may fill the engines
only to 1 - ``RESERVE_PER_LOAD`` x (the within-share tenants' part of those arrivals) of the usual
depth, never below ``over_share_fill`` (``Ticket.fill``, set before each check). The headroom
left is for the tenants within their share: a request of theirs goes in at once instead of queueing
behind the flood, and, where the head of the queue is an over-share tenant's request held back at its
lower fill, the best of theirs in the same priority is checked next (it may go before the head; a
request of another priority never does).

Refusals (``Shed``), each with the reason a client reads in ``X-Disagg-Shed-Reason``:

- ``sheddable``: a request of the sheddable class that cannot go at once (its pair is saturated, or
  others already wait): that class never waits;
- ``tenant_over_share``: the queue is full and the request's tenant holds more than its weighted
  share of it;
- ``queue_full``: the queue is full and no one is over their share: the worst-ranked request;
- ``deadline_unreachable``: its TTFT target cannot be met any more (waited plus its own prefill);
- ``queue_timeout``: it waited ``max_wait_s``.

Every ticket offered ends exactly once, admitted or shed; nothing that was admitted is shed (the
gateway admits before the first byte is sent, so nothing is shed after it).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeAlias, TypeVar

from vllm_disagg.config import AdmissionConfig

P = TypeVar("P")

ShedReason = Literal[
    "sheddable", "tenant_over_share", "queue_full", "deadline_unreachable", "queue_timeout", "no_capacity"
]
SHED_REASONS: tuple[ShedReason, ...] = (
    "sheddable",
    "tenant_over_share",
    "queue_full",
    "deadline_unreachable",
    "queue_timeout",
    "no_capacity",
)
Stage = Literal["prefill", "decode", ""]
MAX_RETRY_AFTER_S = 60
DEMAND_WINDOW = 256  # arrivals per model that a tenant's share of the offered load is measured over
# Over its share only past this multiple of it: tenants offering equal loads do not flap in and out.
OVER_SHARE_TOLERANCE = 1.2
# The headroom kept from over-share tenants, per part of the load the tenants within their share offer:
# their requests need room in proportion to how many come (a quarter of the load: the floor).
RESERVE_PER_LOAD = 3.0


@dataclass(frozen=True, slots=True)
class Fit:
    """Whether a request's pair has room now (``fit.py``); else the stage that binds, and whether its
    TTFT target is out of reach whatever happens."""

    ok: bool
    stage: Stage = ""
    unreachable: bool = False
    # The prefill stage's predicted TTFT on the pair (0 where none was made): kept with an admitted
    # request, so that what its client then sees measures the prediction (``slack.py``).
    predicted_s: float = field(default=0.0, compare=False)


FITS = Fit(True)


@dataclass(frozen=True, slots=True)
class Shed:
    """A refusal: why, the stage that was saturated ("" where none was), and when to come back."""

    reason: ShedReason
    stage: Stage
    retry_after_s: int


ADMITTED: Literal["admitted"] = "admitted"
Verdict: TypeAlias = Literal["admitted"] | Shed


@dataclass(eq=False, slots=True)
class Ticket(Generic[P]):
    """One request's place in the queue; ``payload`` is the caller's (the gateway's pending request)."""

    payload: P
    model: str
    priority: int
    tenant: str
    arrival: float
    deadline: float  # arrival plus the TTFT target (or the default budget): the order in a priority
    has_target: bool  # the deadline is its own TTFT target: past it the request misses its SLO
    cost: float = 1.0  # what admitting it adds to its tenant's virtual time, times the tenant's weight
    # The fraction of the engines' usual depth it may fill (below 1 while its tenant offers more than
    # its share: ``_fill``): set by the queue before each check, read by the check.
    fill: float = 1.0
    seq: int = 0
    state: Literal["new", "queued", "admitted", "shed", "withdrawn"] = "new"

    def rank(self) -> tuple[int, float, int]:
        """Worse is larger: the least important priority, then the latest deadline, then the newest."""
        return (self.priority, self.deadline, self.seq)


@dataclass(slots=True)
class _ModelQueue(Generic[P]):
    # priority -> tenant -> heap of (deadline, seq, ticket); tickets no longer queued are skipped lazily
    classes: dict[int, dict[str, list[tuple[float, int, Ticket[P]]]]] = field(default_factory=dict)
    live: dict[tuple[int, str], int] = field(default_factory=dict)  # queued tickets by (priority, tenant)
    by_tenant: dict[str, int] = field(default_factory=dict)
    size: int = 0
    expiry: list[tuple[float, int, Ticket[P]]] = field(default_factory=list)
    vt: dict[str, float] = field(default_factory=dict)  # tenants' virtual times
    v: float = 0.0  # the system's: the start tag of the last admitted request
    blocked: Stage = ""  # the stage that held the head back at the last drain ("" when none did)
    interval_s: float | None = None  # moving mean of the time between admissions from the queue
    last_admit: float | None = None
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=DEMAND_WINDOW))  # arrivals' tenants
    offered: Counter[str] = field(default_factory=Counter)  # ... counted by tenant


class AdmissionQueue(Generic[P]):
    """Every model's queue of ``Ticket`` s; ``offer`` a new one, ``drain`` whenever room may have come."""

    def __init__(self, config: AdmissionConfig, weights: Mapping[str, float] | None = None) -> None:
        self.config = config
        self._weights: dict[str, float] = dict(config.tenant_weights)
        if weights is not None:
            self._weights.update(weights)
        self._models: dict[str, _ModelQueue[P]] = {}
        self._seq = 0

    # --- configuration ----------------------------------------------------------------------------

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def weights(self) -> dict[str, float]:
        """The tenants' weights set so far (others weigh 1.0)."""
        return dict(self._weights)

    def set_weight(self, tenant: str, weight: float) -> None:
        if not weight > 0 or math.isinf(weight):
            raise ValueError(f"a tenant's weight must be a finite number > 0, got {weight}")
        self._weights[tenant] = weight

    # --- the two operations -----------------------------------------------------------------------

    def offer(self, ticket: Ticket[P], fit: Fit, now: float) -> list[tuple[Ticket[P], Verdict]]:
        """A new request and whether its pair fits now: its verdict if it has one at once (admitted or
        shed), and any queued request it pushed out; nothing for it when it waits (``drain`` says)."""
        if ticket.state != "new":
            raise ValueError(f"ticket of {ticket.model!r} offered twice")
        self._seq += 1
        ticket.seq = self._seq
        mq = self._model(ticket.model)
        self._arrived(mq, ticket.tenant)
        if mq.size == 0 and fit.ok:
            self._admit(mq, ticket, now, from_queue=False)
            return [(ticket, ADMITTED)]
        if not fit.ok and ticket.has_target and fit.unreachable:
            return [(ticket, self._shed(mq, ticket, "deadline_unreachable", fit.stage))]
        if self.sheddable(ticket):  # it never waits: it goes now or not at all
            return [(ticket, self._shed(mq, ticket, "sheddable", fit.stage or mq.blocked))]
        out: list[tuple[Ticket[P], Verdict]] = []
        if mq.size >= self.config.max_queue:
            victim, reason = self._victim(mq, ticket)
            out.append((victim, self._shed(mq, victim, reason, fit.stage)))
            if victim is ticket:
                return out
        self._enqueue(mq, ticket)
        return out

    def drain(
        self, now: float, check: Callable[[Ticket[P]], Fit], *, max_admit: int | None = None
    ) -> list[tuple[Ticket[P], Verdict]]:
        """Shed what waited too long, then admit the best-ranked waiting requests while they fit
        (``check`` asks the scheduler about each, in rank order); stop at the first that does not, or
        after ``max_admit`` admissions (the caller lets those take their places, then drains again)."""
        out: list[tuple[Ticket[P], Verdict]] = []
        budget = [max_admit if max_admit is not None else -1]
        for mq in self._models.values():
            if mq.size and budget[0]:
                self._drain_model(mq, now, check, out, budget)
        return out

    def _drain_model(
        self,
        mq: _ModelQueue[P],
        now: float,
        check: Callable[[Ticket[P]], Fit],
        out: list[tuple[Ticket[P], Verdict]],
        budget: list[int],
    ) -> None:
        self._expire(mq, now, out)
        mq.blocked = ""
        while budget[0] and (head := self._head(mq)) is not None:
            fit = self._try(mq, head, now, check, out, budget)
            if fit is None:  # admitted or refused: the next head
                continue
            # Held back at its tenant's lower fill: the best request of a tenant within its share goes
            # next if it fits (the same priority only: no inversion of priorities).
            within = self._best_within(mq, head.priority) if head.fill < 1 else None
            if within is not None and self._try(mq, within, now, check, out, budget) is None:
                continue
            mq.blocked = fit.stage
            return

    def _try(
        self,
        mq: _ModelQueue[P],
        ticket: Ticket[P],
        now: float,
        check: Callable[[Ticket[P]], Fit],
        out: list[tuple[Ticket[P], Verdict]],
        budget: list[int],
    ) -> Fit | None:
        """Check a waiting ticket at its tenant's fill: admitted if it fits (one of ``budget``),
        refused if its deadline is out of reach (None for both); else the verdict that held it."""
        ticket.fill = self._fill(mq, ticket.tenant)
        fit = check(ticket)
        if fit.ok:
            self._dequeue(mq, ticket)
            self._admit(mq, ticket, now, from_queue=True)
            out.append((ticket, ADMITTED))
            budget[0] -= 1
            return None
        if ticket.has_target and fit.unreachable:
            out.append((ticket, self._shed(mq, ticket, "deadline_unreachable", fit.stage)))
            return None
        return fit

    def withdraw(self, ticket: Ticket[P]) -> None:
        """Take a waiting ticket out (its client left, or the gateway stops): it ends ``withdrawn``."""
        if ticket.state != "queued":
            raise ValueError(f"only a waiting ticket can be withdrawn, not one {ticket.state}")
        self._dequeue(self._models[ticket.model], ticket)
        ticket.state = "withdrawn"

    # --- standing --------------------------------------------------------------------------------

    def fill(self, ticket: Ticket[P]) -> float:
        """The fraction of the engines' usual depth ``ticket`` may fill now (``Ticket.fill``): the
        caller's first check, before ``offer``, reads it; the queue sets it before its own checks."""
        mq = self._models.get(ticket.model)
        return self._fill(mq, ticket.tenant) if mq is not None else 1.0

    def _fill(self, mq: _ModelQueue[P], tenant: str) -> float:
        """1, or less for a tenant over its share: the more of the load the tenants within theirs
        offer, the more headroom is kept for them, down to ``over_share_fill``."""
        if not self._over_share(mq, tenant):
            return 1.0
        within = sum(n for t, n in mq.offered.items() if not self._over_share(mq, t)) / len(mq.recent)
        return max(self.config.over_share_fill, 1.0 - RESERVE_PER_LOAD * within)

    def _over_share(self, mq: _ModelQueue[P], tenant: str) -> bool:
        """Does ``tenant`` offer more than its weighted share of the recent load (among the tenants
        that offered any of it)?"""
        if len(mq.offered) < 2 or not mq.offered[tenant]:
            return False
        share = self.weight(tenant) / sum(self.weight(t) for t in mq.offered)
        return mq.offered[tenant] / len(mq.recent) > share * OVER_SHARE_TOLERANCE

    def _arrived(self, mq: _ModelQueue[P], tenant: str) -> None:
        if len(mq.recent) == DEMAND_WINDOW:
            gone = mq.recent[0]
            mq.offered[gone] -= 1
            if not mq.offered[gone]:
                del mq.offered[gone]
        mq.recent.append(tenant)
        mq.offered[tenant] += 1

    def _best_within(self, mq: _ModelQueue[P], priority: int) -> Ticket[P] | None:
        """The best-ranked waiting ticket of ``priority`` whose tenant is within its share."""
        tenants = mq.classes.get(priority, {}).items()
        return self._best(mq, ((t, heap) for t, heap in tenants if not self._over_share(mq, t)))

    # --- what the gateway shows -------------------------------------------------------------------

    def sheddable(self, ticket: Ticket[P]) -> bool:
        return ticket.priority >= self.config.sheddable_priority

    def depth(self, model: str | None = None) -> int:
        if model is not None:
            mq = self._models.get(model)
            return mq.size if mq else 0
        return sum(mq.size for mq in self._models.values())

    def blocked(self, model: str) -> Stage:
        """The stage that held ``model``'s queue back at the last drain ("" when none did)."""
        mq = self._models.get(model)
        return mq.blocked if mq and mq.size else ""

    def waiting(self) -> Iterator[Ticket[P]]:
        """Every ticket waiting now, in no particular order."""
        for mq in self._models.values():
            for tenants in mq.classes.values():
                for heap in tenants.values():
                    yield from (t for _, _, t in heap if t.state == "queued")

    def virtual_times(self, model: str) -> dict[str, float]:
        """Each tenant's virtual time minus the system's (how far ahead of its share it has been served)."""
        mq = self._models.get(model)
        return {t: vt - mq.v for t, vt in mq.vt.items()} if mq else {}

    def retry_after(self, model: str) -> int:
        """Whole seconds a refused client should wait: the queue's depth at its recent admission pace,
        1..60; the default TTFT budget before any admission was seen."""
        mq = self._models.get(model)
        pace = mq.interval_s if mq is not None else None
        guess = self.config.ttft_s if mq is None or pace is None else (mq.size + 1) * pace
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(guess)))

    # --- the queue itself -------------------------------------------------------------------------

    def _model(self, model: str) -> _ModelQueue[P]:
        mq = self._models.get(model)
        if mq is None:
            mq = self._models[model] = _ModelQueue()
        return mq

    def _enqueue(self, mq: _ModelQueue[P], ticket: Ticket[P]) -> None:
        ticket.state = "queued"
        heap = mq.classes.setdefault(ticket.priority, {}).setdefault(ticket.tenant, [])
        heapq.heappush(heap, (ticket.deadline, ticket.seq, ticket))
        key = (ticket.priority, ticket.tenant)
        mq.live[key] = mq.live.get(key, 0) + 1
        mq.by_tenant[ticket.tenant] = mq.by_tenant.get(ticket.tenant, 0) + 1
        mq.size += 1
        expire_at = ticket.arrival + self.config.max_wait_s
        if ticket.has_target:
            expire_at = min(expire_at, ticket.deadline)
        heapq.heappush(mq.expiry, (expire_at, ticket.seq, ticket))

    def _dequeue(self, mq: _ModelQueue[P], ticket: Ticket[P]) -> None:
        """Take a queued ticket out of the counts (its heap entries go lazily)."""
        key = (ticket.priority, ticket.tenant)
        mq.live[key] -= 1
        if not mq.live[key]:
            del mq.live[key]
            del mq.classes[ticket.priority][ticket.tenant]
            if not mq.classes[ticket.priority]:
                del mq.classes[ticket.priority]
        mq.by_tenant[ticket.tenant] -= 1
        if not mq.by_tenant[ticket.tenant]:
            del mq.by_tenant[ticket.tenant]
        mq.size -= 1
        if not mq.size:
            mq.expiry.clear()

    def _head_of(self, heap: list[tuple[float, int, Ticket[P]]]) -> Ticket[P]:
        while heap[0][2].state != "queued":
            heapq.heappop(heap)
        return heap[0][2]

    def _head(self, mq: _ModelQueue[P]) -> Ticket[P] | None:
        """The best-ranked waiting ticket: top priority, then the tenant furthest behind, then deadline."""
        if not mq.size:
            return None
        return self._best(mq, mq.classes[min(mq.classes)].items())

    def _best(
        self, mq: _ModelQueue[P], tenants: Iterable[tuple[str, list[tuple[float, int, Ticket[P]]]]]
    ) -> Ticket[P] | None:
        """The best-ranked head of these tenants' heaps: the tenant furthest behind, then deadline."""
        best: Ticket[P] | None = None
        best_key: tuple[float, float, int] | None = None
        for tenant, heap in tenants:
            head = self._head_of(heap)
            key = (max(mq.vt.get(tenant, mq.v), mq.v), head.deadline, head.seq)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def _expire(self, mq: _ModelQueue[P], now: float, out: list[tuple[Ticket[P], Verdict]]) -> None:
        while mq.expiry and mq.expiry[0][0] <= now:
            _, _, ticket = heapq.heappop(mq.expiry)
            if ticket.state != "queued":
                continue
            missed = ticket.has_target and ticket.deadline <= ticket.arrival + self.config.max_wait_s
            reason: ShedReason = "deadline_unreachable" if missed else "queue_timeout"
            out.append((ticket, self._shed(mq, ticket, reason, mq.blocked)))

    def _victim(self, mq: _ModelQueue[P], newcomer: Ticket[P]) -> tuple[Ticket[P], ShedReason]:
        """Who leaves a full queue for ``newcomer`` (maybe the newcomer itself), and why."""
        candidates = [*self.waiting_in(mq), newcomer]
        over = self._most_over_share(mq, newcomer)
        if over is not None:
            return max((t for t in candidates if t.tenant == over), key=Ticket.rank), "tenant_over_share"
        return max(candidates, key=Ticket.rank), "queue_full"

    def waiting_in(self, mq: _ModelQueue[P]) -> Iterator[Ticket[P]]:
        for tenants in mq.classes.values():
            for heap in tenants.values():
                yield from (t for _, _, t in heap if t.state == "queued")

    def _most_over_share(self, mq: _ModelQueue[P], newcomer: Ticket[P]) -> str | None:
        """The tenant holding the most more than its weighted share of the queue (the newcomer
        counted), if any holds more."""
        counts = dict(mq.by_tenant)
        counts[newcomer.tenant] = counts.get(newcomer.tenant, 0) + 1
        if len(counts) < 2:
            return None
        total = sum(counts.values())
        weights = {t: self.weight(t) for t in counts}
        all_weight = sum(weights.values())
        excess = {t: n / total - weights[t] / all_weight for t, n in counts.items()}
        tenant = max(excess, key=lambda t: (excess[t], t))
        return tenant if excess[tenant] > 1e-9 else None

    # --- outcomes ---------------------------------------------------------------------------------

    def _admit(self, mq: _ModelQueue[P], ticket: Ticket[P], now: float, *, from_queue: bool) -> None:
        ticket.state = "admitted"
        start = max(mq.vt.get(ticket.tenant, mq.v), mq.v)
        mq.vt[ticket.tenant] = start + ticket.cost / self.weight(ticket.tenant)
        mq.v = start
        if from_queue and mq.last_admit is not None:
            gap = now - mq.last_admit
            mq.interval_s = gap if mq.interval_s is None else 0.8 * mq.interval_s + 0.2 * gap
        mq.last_admit = now

    def _shed(self, mq: _ModelQueue[P], ticket: Ticket[P], reason: ShedReason, stage: Stage) -> Shed:
        if ticket.state == "queued":
            self._dequeue(mq, ticket)
        ticket.state = "shed"
        return Shed(reason, stage, self.retry_after(ticket.model))
