"""The admission queue in the gateway's event loop (the policy is ``orchestrator.admission``).

``Admission.enter`` takes a request the scheduler has just decided: admitted at once, it returns the
decision; otherwise the request waits here for ``pump`` to admit it (with a fresh decision) or to
refuse it (``Overloaded``, 429 with its reason and ``Retry-After``). The pump drains the queue whenever
``kick`` says room may have come (a request finished) and every ``POLL_S`` while anything waits (a leg
ended, metrics moved, a deadline passed). A client that leaves while it waits is withdrawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg.clock import Clock
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import NoCapacity, Overloaded, RequestError
from vllm_disagg.orchestrator.admission.classify import TenantLabels
from vllm_disagg.orchestrator.admission.metrics import AdmissionMetrics, QueueCollector
from vllm_disagg.orchestrator.admission.policy import (
    ADMITTED,
    SHED_REASONS,
    AdmissionQueue,
    Fit,
    Shed,
    Ticket,
    Verdict,
)
from vllm_disagg.orchestrator.admission.room import LOADED, find_room
from vllm_disagg.orchestrator.admission.slack import Slack
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.scheduling.framework import Decision, Scheduler, SchedulingRequest
from vllm_disagg.orchestrator.state.registry import GatewayRegistry
from vllm_disagg.orchestrator.state.views import RegistrySnapshot

log = logging.getLogger(__name__)

POLL_S = 0.01  # while anything waits: how often room is looked for without a kick

_WHY = {
    "sheddable": "the request is in the sheddable class and its {stage} stage is saturated",
    "tenant_over_share": "the admission queue is full and this tenant holds more than its share of it",
    "queue_full": "the admission queue is full",
    "deadline_unreachable": "its TTFT target can no longer be met",
    "queue_timeout": "it waited the admission queue's longest wait",
    "no_capacity": "no instance can take it",
}


@dataclass(eq=False, slots=True)
class Pending:
    """A request in admission: what the scheduler knows of it, and its latest decision."""

    scheduling: SchedulingRequest
    decision: Decision | None  # None: the scheduler found every ready instance too loaded (``loaded``)
    error: RequestError | None = None  # the scheduler's refusal at its last check (raised once admitted)
    future: asyncio.Future[Verdict] | None = None
    queued_at: float | None = None
    admitted_at: float | None = None
    held_by: str = ""  # the stage that held it back last ("prefill" or "decode"; "" if none did)
    predicted_s: float = 0.0  # the prefill stage's predicted TTFT at its last check (``Fit.predicted_s``)
    extra: dict[str, Any] = field(default_factory=dict)


def check(
    ticket: Ticket[Pending],
    now: float,
    scheduler: Scheduler,
    snapshot: RegistrySnapshot,
    config: AdmissionConfig,
    slack_s: float = 0.0,
) -> Fit:
    """A waiting request's pair, decided again on the registry as it is now (``find_room``), and
    whether it fits; its payload keeps the decision (or the scheduler's refusal, which is admitted to
    get that answer) and the prediction. The gateway's pump and the simulator's both check this way."""
    pending = ticket.payload
    waited = now - ticket.arrival
    room = find_room(
        scheduler, pending.scheduling, snapshot, now, waited, config, slack_s=slack_s, fill=ticket.fill
    )
    pending.decision, pending.error, pending.predicted_s = room.decision, room.error, room.fit.predicted_s
    return room.fit


def tell_held(queue: AdmissionQueue[Pending], on_held: Callable[[int, int], None] | None) -> None:
    """After a drain: how many wait for each stage, to ``on_held`` (the planner's window), and each
    waiting request's ``held_by``."""
    if on_held is None:
        return
    held = {"prefill": 0, "decode": 0, "": 0}
    for ticket in queue.waiting():
        stage = queue.blocked(ticket.model)
        held[stage] += 1
        ticket.payload.held_by = stage or ticket.payload.held_by
    on_held(held["prefill"], held["decode"])


def refusal(ticket: Ticket[Pending], shed: Shed) -> Overloaded:
    """The client's 429 for a shed ticket."""
    why = _WHY[shed.reason].format(stage=shed.stage or "prefill")
    return Overloaded(
        f"request refused by admission ({shed.reason}): {why}; retry after {shed.retry_after_s} s",
        reason=shed.reason,
        retry_after_s=shed.retry_after_s,
        stage=shed.stage,
    )


class Admission:
    """One gateway's admission queue, its pump, and its counts."""

    def __init__(
        self,
        config: AdmissionConfig,
        scheduler: Scheduler,
        registry: GatewayRegistry,
        clock: Clock,
        metrics: OrchestratorMetrics,
    ) -> None:
        self.config = config
        self.queue: AdmissionQueue[Pending] = AdmissionQueue(config)
        self.tenants = TenantLabels(config)
        self._scheduler = scheduler
        self._registry = registry
        self._clock = clock
        self._metrics = AdmissionMetrics(metrics.registry)
        metrics.registry.register(
            QueueCollector(self.queue.waiting, self.queue.blocked, self.tenants.name, clock.monotonic)
        )
        self._kick: asyncio.Event | None = None
        self._pump: asyncio.Task[None] | None = None
        # Told after each drain how many wait for each stage (the planner's signals).
        self.on_held: Callable[[int, int], None] | None = None
        self._tenant_weights = dict(config.tenant_weights)  # those set; any other tenant weighs 1.0
        self._counts: Counter[tuple[str, str, str]] = Counter()  # (model, outcome, reason), for operators
        self.slack = Slack()  # how late first tokens came against their predictions: fit's margin

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the pump, in the running event loop."""
        self._kick = asyncio.Event()
        self._pump = asyncio.create_task(self._run(), name="admission-pump")

    async def close(self) -> None:
        """Stop the pump; whatever still waits is refused (the gateway is stopping)."""
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
            self._pump = None
        for ticket in list(self.queue.waiting()):
            self.queue.withdraw(ticket)
            future = ticket.payload.future
            if future is not None and not future.done():
                future.set_exception(NoCapacity("the gateway is stopping"))

    def kick(self) -> None:
        """Room may have come (a request finished): drain soon."""
        if self._kick is not None and self.queue.depth():
            self._kick.set()

    # --- one request ------------------------------------------------------------------------------

    async def enter(self, ticket: Ticket[Pending]) -> Decision:
        """Admit ``ticket`` (its payload holds its first decision) now or once room comes: the decision
        to act on. Raises ``Overloaded`` when it is refused, or what the scheduler raised for it."""
        pending = ticket.payload
        now = self._clock.monotonic()
        ticket.fill = self.queue.fill(ticket)
        first = self._first_fit(pending, now, ticket.fill)
        self._settle(self.queue.offer(ticket, first, now))
        if ticket.state == "queued":
            pending.queued_at = now
            self._count(ticket, "queued", first.stage)
            future: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
            pending.future = future
            if self._kick is not None:
                self._kick.set()
            try:
                await future
            except asyncio.CancelledError:  # the client left while it waited
                if ticket.state == "queued":
                    self.queue.withdraw(ticket)
                    self._count(ticket, "withdrawn", "")
                raise
        return self._outcome(ticket)

    def _outcome(self, ticket: Ticket[Pending]) -> Decision:
        pending = ticket.payload
        verdict = pending.extra.get("verdict")
        if isinstance(verdict, Shed):
            raise refusal(ticket, verdict)
        if pending.error is not None:
            raise pending.error
        assert pending.decision is not None
        return pending.decision

    # --- the pump ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._kick is not None
        kick = self._kick
        while True:
            if self.queue.depth():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(kick.wait(), POLL_S)
            else:
                await kick.wait()
            kick.clear()
            try:
                await self.drain()
            except Exception:  # a bug here must not strand every waiting request
                log.exception("admission: draining the queue failed")

    async def drain(self) -> None:
        """Admit what fits now, one at a time, refuse what waited too long. Each admitted request's
        task runs before the next check (``sleep(0)``: its future's callback is queued first), and so
        takes its place in the registry's in-flight counts on its pair: the scheduler and ``fit`` see
        it, and the next head goes elsewhere or waits."""
        while True:
            now = self._clock.monotonic()
            outcomes = self.queue.drain(now, functools.partial(self._check, now=now), max_admit=1)
            self._settle(outcomes)
            if not any(verdict == ADMITTED for _, verdict in outcomes):
                break
            await asyncio.sleep(0)
        self._tell_held()

    def _tell_held(self) -> None:
        tell_held(self.queue, self.on_held)

    def _check(self, ticket: Ticket[Pending], now: float) -> Fit:
        return check(ticket, now, self._scheduler, self._registry.snapshot(), self.config, self.slack.value())

    def _first_fit(self, pending: Pending, now: float, fill: float) -> Fit:
        """On arrival: its pair as the gateway decided it, or another with room (``find_room``)."""
        if pending.decision is None:
            return LOADED
        snapshot = self._registry.snapshot()
        room = find_room(
            self._scheduler, pending.scheduling, snapshot, now, 0.0, self.config, pending.decision, fill=fill
        )
        pending.decision, pending.predicted_s = room.decision, room.fit.predicted_s
        return room.fit

    def _settle(self, outcomes: list[tuple[Ticket[Pending], Verdict]]) -> None:
        now = self._clock.monotonic()
        for ticket, verdict in outcomes:
            pending = ticket.payload
            pending.extra["verdict"] = verdict
            if verdict == ADMITTED:
                pending.admitted_at = now
                waited = now - pending.queued_at if pending.queued_at is not None else 0.0
                self._count(ticket, "admitted", "", waited)
            else:
                assert isinstance(verdict, Shed)
                self._count(ticket, "shed", verdict.stage, reason=verdict.reason)
            future = pending.future
            if future is not None and not future.done():
                future.set_result(verdict)

    def _count(
        self, ticket: Ticket[Pending], outcome: str, stage: str, waited: float | None = None, reason: str = ""
    ) -> None:
        tenant = self.tenants.name(ticket.tenant)
        self._counts[(ticket.model, outcome, reason)] += 1
        self._metrics.count(ticket.model, outcome, reason, stage, ticket.priority, tenant)
        if waited is not None:
            self._metrics.waited(ticket.model, ticket.priority, tenant, waited)

    # --- what operators read and set (the admin API) ----------------------------------------------

    def tenant_weights(self) -> dict[str, float]:
        """The tenants' weights in force, configured or set since (any other tenant weighs 1.0)."""
        return dict(sorted(self._tenant_weights.items()))

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Make ``weights`` (checked by the caller) the tenants' weights: one left out weighs 1.0 again."""
        for tenant in self._tenant_weights.keys() - weights.keys():
            self.queue.set_weight(tenant, 1.0)
        for tenant, weight in weights.items():
            self.queue.set_weight(tenant, weight)
            self.tenants.add(tenant)
        self._tenant_weights = dict(weights)

    def snapshot(self) -> dict[str, Any]:
        """This process's queues now and its counts so far, as JSON: per model, the depth by priority
        and by tenant (named as in the metrics), the oldest wait, the stage holding the queue back, the
        outcomes (shed ones by reason) and each tenant's lead on its share; and the tenants' weights."""
        now = self._clock.monotonic()
        waiting = list(self.queue.waiting())
        names = {t.model for t in waiting} | {model for model, _, _ in self._counts}
        models = {model: self._model_view(model) for model in sorted(names)}
        for ticket in waiting:
            view = models[ticket.model]
            view["depth"] += 1
            _bump(view["by_priority"], str(ticket.priority))
            _bump(view["by_tenant"], self.tenants.name(ticket.tenant))
            view["oldest_wait_s"] = max(view["oldest_wait_s"], round(now - ticket.arrival, 3))
        for (model, outcome, reason), n in self._counts.items():
            counts = models[model]["counts"]
            if outcome == "shed":
                _bump(counts["shed"], reason, n)
            else:
                _bump(counts, outcome, n)
        return {"models": models, "tenant_weights": self.tenant_weights()}

    def _model_view(self, model: str) -> dict[str, Any]:
        """One model's entry in ``snapshot``, before its waiting requests and counts are added: the
        tenants' leads are their virtual times over the queue's (tokens over weight; 0 or less: none)."""
        ahead: dict[str, float] = {}
        for tenant, lead in self.queue.virtual_times(model).items():
            name = self.tenants.name(tenant)  # tenants past the metrics' limit: "other", the largest lead
            ahead[name] = round(max(ahead.get(name, lead), lead), 3)
        counts = {"queued": 0, "admitted": 0, "withdrawn": 0, "shed": dict.fromkeys(SHED_REASONS, 0)}
        return {
            "depth": 0,
            "by_priority": {},
            "by_tenant": {},
            "oldest_wait_s": 0.0,
            "saturated": self.queue.blocked(model),
            "counts": counts,
            "ahead_of_share": ahead,
        }


def _bump(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def ticket_of(
    pending: Pending, *, priority: int, tenant: str, arrival: float, config: AdmissionConfig
) -> Ticket[Pending]:
    """The queue's ticket of a request: its deadline from its TTFT target (else the default budget),
    its cost its tokens (prompt and the most it may generate)."""
    request = pending.scheduling
    target = request.slo_ttft_s
    budget = target if target is not None else config.ttft_s
    cost = max(1, request.prompt_len) + (request.max_tokens or 0)
    return Ticket(
        payload=pending,
        model=request.model,
        priority=priority,
        tenant=tenant,
        arrival=arrival,
        deadline=arrival + budget,
        has_target=target is not None,
        cost=float(cost),
    )
