"""The gateway's admission queue in the simulator: the orchestrator's ``AdmissionQueue`` and ``fit``,
driven on virtual time as ``orchestrator/gateway/admit.py`` drives them on the event loop.

- A request the scheduler has just decided is offered with its pair's ``Fit`` (``Admission.enter``):
  admitted at once, refused at once, or queued, which kicks the pump.
- The pump drains when kicked (a queued arrival, an admitted request that ended) and ``POLL_S`` after
  its last drain while anything waits, as the gateway's ``asyncio.wait_for(kick.wait(), POLL_S)``
  does: kicks at one instant are one drain. Each check decides the head's pair again with
  ``route_request`` on the registry as it is now, and asks ``fit`` about it.
- A drain admits one request at a time and starts its flow before it checks the next head, as the
  gateway lets an admitted request's task run before its next check: the registry counts it in
  flight on its pair, so the scheduler and ``fit`` see it, and the next head goes elsewhere or waits
  (without that, a pair with room for one took every head routed to it in one drain).
- A request the scheduler finds no room for although the model has ready instances (``loaded``)
  waits, held by its decode stage, rather than being refused; after each drain the planner is told
  how many wait for each stage (``on_held``).

The ``Pending`` and ``ticket_of`` are the gateway's own (the deadline from the TTFT target, the cost
from the tokens), so the queue orders and shares exactly as in production.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_disagg.cluster_sim.virtual_clock import EventLoop
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.orchestrator.admission.policy import (
    ADMITTED,
    AdmissionQueue,
    Fit,
    Shed,
    Ticket,
    Verdict,
)
from vllm_disagg.orchestrator.admission.room import LOADED, find_room
from vllm_disagg.orchestrator.admission.slack import Slack
from vllm_disagg.orchestrator.gateway.admit import POLL_S, Pending, check, tell_held
from vllm_disagg.orchestrator.scheduling.framework import Scheduler
from vllm_disagg.orchestrator.state.registry import Registry

Admit = Callable[[Ticket[Pending]], None]
Refuse = Callable[[Ticket[Pending], Shed], None]


class SimAdmission:
    """One simulated gateway's admission queue and its pump; ``admit`` and ``refuse`` carry the verdicts
    out (the flow starts, or the client gets its 429)."""

    def __init__(
        self,
        config: AdmissionConfig,
        scheduler: Scheduler,
        registry: Registry,
        loop: EventLoop,
        admit: Admit,
        refuse: Refuse,
    ) -> None:
        self.config = config
        self.queue: AdmissionQueue[Pending] = AdmissionQueue(config)
        self._scheduler = scheduler
        self._registry = registry
        self._loop = loop
        self._admit = admit
        self._refuse = refuse
        self.on_held: Callable[[int, int], None] | None = None  # (held for prefill, held for decode)
        self._kicked = False
        self._drains = 0  # a poll scheduled after drain n runs only if no drain came since
        self.checks = 0  # heads decided again while draining (each a ``route_request`` and a ``fit``)
        self.slack = Slack()  # fit's margin, fed by the cluster with each first token, as the gateway's

    @property
    def now(self) -> float:
        return self._loop.clock.now

    def enter(self, ticket: Ticket[Pending]) -> None:
        """A request the scheduler has just decided (its payload holds the decision): admitted or
        refused now, through ``admit``/``refuse``, or queued for the pump."""
        pending = ticket.payload
        now = self.now
        decision = pending.decision
        snapshot = self._registry.snapshot()
        first = LOADED
        ticket.fill = self.queue.fill(ticket)
        if decision is not None:  # its pair, or another with room, as the gateway's ``_first_fit``
            room = find_room(
                self._scheduler, pending.scheduling, snapshot, now, 0.0, self.config, decision,
                fill=ticket.fill,
            )  # fmt: skip
            pending.decision, pending.predicted_s, first = room.decision, room.fit.predicted_s, room.fit
        self._settle(self.queue.offer(ticket, first, now), now)
        if ticket.state == "queued":
            pending.queued_at = now
            self.kick()

    def kick(self) -> None:
        """Room may have come (a request ended): drain at this instant, once however many kick."""
        if self.queue.depth() and not self._kicked:
            self._kicked = True
            self._loop.after(0.0, self._kick)

    def _kick(self) -> None:
        self._kicked = False
        self.drain()

    def _poll(self, drains: int) -> None:
        if drains == self._drains:
            self.drain()

    def drain(self) -> None:
        """Admit what fits now, refuse what waited too long; poll again in ``POLL_S`` while any waits."""
        now = self.now
        while True:  # one at a time, its flow started (its legs counted) before the next check
            outcomes = self.queue.drain(now, lambda t: self._check(t, now), max_admit=1)
            self._settle(outcomes, now)
            if not any(verdict == ADMITTED for _, verdict in outcomes):
                break
        tell_held(self.queue, self.on_held)
        self._drains += 1
        if self.queue.depth():
            drains = self._drains
            self._loop.after(POLL_S, lambda: self._poll(drains))

    def _check(self, ticket: Ticket[Pending], now: float) -> Fit:
        self.checks += 1
        return check(ticket, now, self._scheduler, self._registry.snapshot(), self.config, self.slack.value())

    def _settle(self, outcomes: list[tuple[Ticket[Pending], Verdict]], now: float) -> None:
        for ticket, verdict in outcomes:
            if verdict == ADMITTED:
                ticket.payload.admitted_at = now
                self._admit(ticket)
            else:
                assert isinstance(verdict, Shed)
                self._refuse(ticket, verdict)
