"""A simulated cluster: engines on virtual time, and the orchestrator's own parts deciding everything.

What is the orchestrator's code, not a copy: the ``Registry`` (instance states, heartbeats, timeouts,
breakers, in-flight counts), the ``KvIndex`` fed by the engines' KV events as agents forward them,
the scheduler (``route_request``: the plugin scheduler, or a baseline policy), its retry picks
(``pick_prefill``/``pick_decode``), and the planner's pure decision (``planner.decide.plan`` on
``pool_signals`` of an ``SloWindow``). What is modelled: the engines (``engine.Engine``), the network
(a KV transfer's time; every other hop is free) and the gateway's I/O, which follows
``orchestrator.gateway.flow`` step for step, with its recovery decisions (``scheduling/recovery.py``):

- a prefill leg that fails is retried on another prefill instance, up to ``prefill_attempts``; then
  the request runs colocated on its decode instance;
- a decode leg that fails before its first token is retried on another decode instance, up to
  ``decode_attempts``, after a new prefill (the failed one may have pulled the KV);
- a stream cut after its first token resumes colocated elsewhere, up to ``max_resumes``, carrying
  the tokens it had (its TPOT includes the gap).

Rollouts and role changes (the operator's, and the planner's shifts) are the orchestrator's pure
control steps, carried out on the simulated instances (``control.SimControl``). With admission on
(``config.admission``, as in the orchestrator), a decided request goes through the gateway's
admission queue first (``admission.SimAdmission``): it may wait there, its wait counting in its TTFT,
or be refused (status 429 and the reason, as the gateway's ``Overloaded``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from vllm_disagg.cluster_sim.admission import SimAdmission
from vllm_disagg.cluster_sim.control import RoleChangePlan, RoleSwitch, RolloutPlan, SimControl
from vllm_disagg.cluster_sim.engine import Engine, Leg
from vllm_disagg.cluster_sim.network import Network
from vllm_disagg.cluster_sim.profile import EngineProfile
from vllm_disagg.cluster_sim.topology import Topology
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest, prompt_token_ids
from vllm_disagg.cluster_sim.virtual_clock import EventLoop, VirtualClock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import SHED_REASON_HEADER, NoCapacity, RequestError
from vllm_disagg.orchestrator.admission.policy import Shed, Ticket
from vllm_disagg.orchestrator.admission.room import loaded
from vllm_disagg.orchestrator.gateway.admit import Pending, refusal, ticket_of
from vllm_disagg.orchestrator.planner.config import PlannerConfig
from vllm_disagg.orchestrator.planner.decide import Memory, remember_change
from vllm_disagg.orchestrator.planner.decide import plan as plan_shift
from vllm_disagg.orchestrator.planner.signals import SloWindow, pool_signals
from vllm_disagg.orchestrator.scheduling.framework import Decision, Scheduler, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.recovery import (
    may_resume,
    may_retry_decode,
    may_retry_prefill,
    next_decode,
    resume_pick,
)
from vllm_disagg.orchestrator.scheduling.routing import route_request
from vllm_disagg.orchestrator.state.health import BreakerPolicy
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, KvEvent, Role

MODEL = "sim-model"
REVISION = "r1"  # the revision the cluster starts with (a rollout moves it to another)
FaultKind = Literal["engine", "node", "slow-link"]


@dataclass(frozen=True, slots=True)
class Fault:
    """Something that goes wrong at ``at_s`` and, with ``for_s``, comes right again.

    ``engine``: the engine dies, its agent reports it at once; ``node``: engine and agent vanish (the
    registry notices by the heartbeat timeout); ``slow-link``: KV transfers on the way of ``instance``
    (an instance, a ``P->D`` link, or a node's or rack's uplink: ``faults``) take ``slowdown`` x as long.
    """

    at_s: float
    kind: FaultKind
    instance: str
    for_s: float | None = None
    slowdown: float = 10.0


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The cluster's shape and the orchestrator's settings."""

    prefill: int
    decode: int
    profile: EngineProfile
    config: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    planner: PlannerConfig | None = None  # None: roles stay as they are
    slo_ttft_s: float | None = None  # every request's targets (``x-slo-*`` headers), if any
    slo_tpot_s: float | None = None
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    rollout: RolloutPlan | None = None  # an operator's rollout to a new revision, if any
    role_changes: tuple[RoleChangePlan, ...] = ()  # an operator's role changes
    role_switch: RoleSwitch = "routing"  # how the agents change an engine's role (the planner's too)
    engine_start_s: float = 10.0  # a new or restarted engine is ready this long after it starts
    topology: Topology | None = None  # where instances run, KV links by tier, learned (``network``)


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    tenant: str = "default"
    ok: bool = False
    status: int = 0  # the HTTP status the client got: 200, 429 (refused by admission), 503, 502
    shed_reason: str = ""  # why it was refused (``X-Disagg-Shed-Reason``): admission's, or no_capacity
    queued_s: float | None = None  # seconds it waited in the admission queue (None: it never queued)
    ttft_s: float | None = None
    tpot_s: float | None = None
    end_s: float | None = None
    mode: str = ""
    prefill: str | None = None
    decode: str = ""
    retries: int = 0
    resumes: int = 0
    fallback: bool = False
    error: str = ""


class _Request:
    """A request's state in the gateway (``flow.Flow``'s, without the I/O)."""

    __slots__ = (
        "decode",
        "decode_tries",
        "failed",
        "had",
        "held_by",
        "kv",
        "out",
        "predicted_s",
        "prefill",
        "prefill_tries",
        "sched",
        "tokens",
    )

    def __init__(self, out: Outcome, tokens: PromptTokens, sched: SchedulingRequest) -> None:
        self.out = out
        self.tokens = tokens
        self.sched = sched
        self.prefill: str | None = None
        self.decode = ""
        self.failed: set[str] = set()
        self.prefill_tries = 0
        self.decode_tries = 0
        self.kv = False  # a prefill's KV waits for the decode leg
        self.had = 0  # output tokens the client has from legs cut before (a resume goes on from them)
        self.held_by = ""  # the stage admission held it back for, if it waited ("prefill", "decode")
        self.predicted_s: float | None = None  # admission's prediction of its TTFT, for its margin


class Cluster:
    """Engines, the orchestrator's parts, and the gateway's flow, on one event loop."""

    def __init__(self, spec: ClusterSpec, scheduler: Scheduler) -> None:
        self.spec = spec
        self.config = spec.config
        self.clock = VirtualClock()
        self.loop = EventLoop(self.clock)
        self.scheduler = scheduler
        cfg = self.config
        self.registry = Registry(
            cfg.heartbeat_timeout_s,
            suspect_after_s=cfg.suspect_after_s,
            breaker=BreakerPolicy(failures_to_open=cfg.breaker_failures, open_s=cfg.breaker_open_s),
        )
        self.kv_index = KvIndex()
        self.engines: dict[str, Engine] = {}
        self.agent_alive: dict[str, bool] = {}
        self.net = Network(spec.profile, spec.topology, (spec.prefill, spec.decode), self.registry, self.loop)
        self.outcomes: list[Outcome] = []
        self.shifts: list[tuple[float, str, Role, Role]] = []
        self.revisions: dict[str, str] = {}  # agent id -> its engine's revision
        self.ready_at: dict[str, float] = {}  # an engine starting: its heartbeat says ready from then
        self.control = SimControl(self, cfg, role_switch=spec.role_switch, engine_start_s=spec.engine_start_s)
        self.window = SloWindow(spec.planner.window_s if spec.planner else 60.0, self.clock.monotonic)
        self._memory = Memory()
        self._beats = 0
        self._unfinished = 0  # requests of the trace not yet answered (arrived or not)
        self._rng = random.Random(spec.seed)
        admission = cfg.admission
        self.admission = (
            SimAdmission(admission, scheduler, self.registry, self.loop, self._admitted, self._refused)
            if admission.enabled
            else None
        )
        if self.admission is not None and spec.planner is not None:  # the planner's held counts
            self.admission.on_held = self.window.admission_held
        # What a request in admission will need once admitted (its outcome and prompt), by ticket.
        self._entering: dict[Ticket[Pending], tuple[Outcome, PromptTokens]] = {}
        for i in range(spec.prefill):
            self._join(f"prefill-{i}", "prefill")
        for i in range(spec.decode):
            self._join(f"decode-{i}", "decode")

    # --- instances --------------------------------------------------------------------------------

    def _join(self, agent_id: str, role: Role, revision: str | None = None) -> None:
        engine = self.engines.get(agent_id) or Engine(agent_id, self.spec.profile, self.loop, self._kv_events)
        self.engines[agent_id] = engine
        self.net.start(engine)
        self.agent_alive[agent_id] = True
        revision = self.revisions[agent_id] = revision or self.revisions.get(agent_id, REVISION)
        p = self.spec.profile
        info = InstanceInfo(
            url=f"http://{agent_id}", role=role, model=MODEL, engine="sim", revision=revision,
            block_size=p.block_size, max_model_len=p.max_model_len, labels=self.net.labels(agent_id),
        )  # fmt: skip
        self.registry.hello(agent_id, info, self.clock.now)
        self.kv_index.drop(agent_id)  # a new session: the index starts empty, as the control plane does
        self._heartbeat(agent_id)

    def _kv_events(self, agent_id: str, events: list[KvEvent]) -> None:
        if self.agent_alive.get(agent_id):
            self.kv_index.apply(agent_id, events)

    def join(self, agent_id: str, role: Role, revision: str, start_s: float) -> None:
        """A new instance says Hello (``SimControl``: a rollout's new revision); ready in ``start_s``."""
        self.ready_at[agent_id] = self.clock.now + start_s
        self._join(agent_id, role, revision)

    def restart_engine(self, agent_id: str, start_s: float) -> None:
        """Its agent restarts the engine (a role change): what is on it fails over, and a new, empty
        engine is ready ``start_s`` from now."""
        self.engines[agent_id].kill()
        self.loop.after(start_s, lambda: self._restarted(agent_id))

    def _restarted(self, agent_id: str) -> None:
        if self.agent_alive.get(agent_id):
            self.engines[agent_id].revive()
            self.kv_index.drop(agent_id)  # its cache went with the old engine

    def agent_up(self, agent_id: str) -> bool:
        """Whether its agent is there to answer a command (a node fault takes it away)."""
        return self.agent_alive.get(agent_id, False)

    def _heartbeat(self, agent_id: str) -> None:
        engine = self.engines[agent_id]
        state: EngineState = "ready" if engine.alive else "restarting"
        if self.clock.now < self.ready_at.get(agent_id, 0.0):
            state = "starting"
        self._beats += 1
        beat = Heartbeat(seq=self._beats, engine_state=state, metrics=engine.snapshot(self.clock.now))
        self.registry.heartbeat(agent_id, beat, self.clock.now)

    def _beat_all(self) -> None:
        for agent_id, alive in self.agent_alive.items():
            if alive:
                self._heartbeat(agent_id)
        self.loop.after(self.config.heartbeat_interval_s, self._beat_all)

    def _tick(self) -> None:
        for agent_id in self.registry.tick(self.clock.now):
            self.kv_index.drop(agent_id)
        self.loop.after(self.config.heartbeat_interval_s / 2, self._tick)

    # --- faults -----------------------------------------------------------------------------------

    def _fault(self, fault: Fault) -> None:
        name = fault.instance
        if fault.kind == "slow-link":
            self.net.fault(name, fault.slowdown, fault.for_s)
            return
        engine = self.engines[name]
        if fault.kind == "node":
            self.agent_alive[name] = False  # silent from now: the registry's timeout finds out
        engine.kill()
        if fault.kind == "engine":
            self._heartbeat(name)  # the agent reports its engine at once
        if fault.for_s is not None:
            self.loop.after(fault.for_s, lambda: self._recover(name))

    def _recover(self, name: str) -> None:
        engine = self.engines[name]
        engine.revive()
        view = self.registry.get(name)
        role: Role = view.info.role if view is not None else "decode"
        if not self.agent_alive[name] or view is None or view.state == "dead":
            self._join(name, role)  # a new session, as an agent's Hello after a restart
        else:
            self.kv_index.drop(name)  # a new engine behind the same session: its cache is empty
            self._heartbeat(name)

    # --- the planner ------------------------------------------------------------------------------

    def _look(self) -> None:
        planner = self.spec.planner
        assert planner is not None
        if not self.control.changing:  # one change at a time: a look while one is under way decides nothing
            self._decide(planner)
        self.loop.after(planner.interval_s, self._look)

    def _decide(self, planner: PlannerConfig) -> None:
        prefill, decode = pool_signals(self.registry.snapshot(), self.window)
        memory = remember_change(self._memory, self.control.last_change_at)
        result = plan_shift(prefill, decode, memory, planner, self.clock.now)
        self._memory = result.memory
        shift = result.shift
        if shift is not None and not planner.dry_run:
            # The same role change as an operator's (``role_steps``): by routing or by restart.
            self.control.change_role(shift.agent_id, shift.to_role, by="planner")
            self.shifts.append((self.clock.now, shift.agent_id, shift.from_role, shift.to_role))

    # --- requests ---------------------------------------------------------------------------------

    def run(self, trace: Trace, on_progress: Callable[[float], None] | None = None) -> list[Outcome]:
        """Replay ``trace``; every request's outcome, in arrival order."""
        self.loop.after(0.0, self._beat_all)
        self.loop.after(0.0, self._tick)
        if self.spec.planner is not None and self.spec.planner.enabled:
            self.loop.after(self.spec.planner.interval_s, self._look)
        self.control.schedule(self.spec.rollout, self.spec.role_changes)
        for fault in self.spec.faults:
            self.loop.at(fault.at_s, lambda f=fault: self._fault(f))  # type: ignore[misc]
        start = trace.requests[0].at_s if trace.requests else 0.0
        self._unfinished = len(trace.requests)
        for i, req in enumerate(trace.requests):
            self.loop.at(req.at_s - start, lambda r=req, n=i: self._arrive(r, n))  # type: ignore[misc]
        end = (trace.requests[-1].at_s - start if trace.requests else 0.0) + 3600.0
        self.loop.run(until=end, on_progress=on_progress)
        return self.outcomes

    def _arrive(self, trace_req: TraceRequest, n: int) -> None:
        """A request arrives: decided, then admitted (at once, or later from the admission queue)."""
        now = self.clock.now
        tokens = PromptTokens(prompt_token_ids(trace_req))
        out = Outcome(
            f"req-{n}", now, len(tokens), trace_req.output_tokens, trace_req.priority, trace_req.tenant
        )
        self.outcomes.append(out)
        spec = self.spec
        sched = SchedulingRequest(
            out.request_id, MODEL, len(tokens), False, True, self.kv_index.cached_tokens(tokens), True,
            max_tokens=trace_req.output_tokens, slo_ttft_s=spec.slo_ttft_s, slo_tpot_s=spec.slo_tpot_s,
        )  # fmt: skip
        snapshot = self.registry.snapshot()
        try:
            pending = Pending(sched, route_request(self.scheduler, sched, snapshot, now))
        except NoCapacity as exc:  # too loaded for it (with admission, it waits) or none at all
            if self.admission is None or not loaded(exc, snapshot, MODEL):
                self._error(out, exc)
                return
            pending = Pending(sched, None, exc)
        except RequestError as exc:  # refused before admission, as the gateway refuses it
            self._error(out, exc)
            return
        if self.admission is None:
            assert pending.decision is not None
            self._start(out, tokens, sched, pending.decision)
            return
        ticket = ticket_of(
            pending,
            priority=trace_req.priority,
            tenant=trace_req.tenant,
            arrival=now,
            config=self.admission.config,
        )
        self._entering[ticket] = (out, tokens)
        self.admission.enter(ticket)

    def _admitted(self, ticket: Ticket[Pending]) -> None:
        """Admission let the request through: its flow runs on its latest decision."""
        out, tokens = self._entering.pop(ticket)
        pending = ticket.payload
        if pending.queued_at is not None and pending.admitted_at is not None:
            out.queued_s = pending.admitted_at - pending.queued_at
        if pending.error is not None:  # the scheduler refused it at its last check
            self._error(out, pending.error)
            return
        assert pending.decision is not None  # no error: decided
        self._start(out, tokens, pending.scheduling, pending.decision, pending.held_by, pending.predicted_s)

    def _refused(self, ticket: Ticket[Pending], shed: Shed) -> None:
        """Admission refused the request: the client's 429, with its reason."""
        out, _ = self._entering.pop(ticket)
        pending = ticket.payload
        if pending.queued_at is not None:
            out.queued_s = self.clock.now - pending.queued_at
        self._error(out, refusal(ticket, shed))

    def _error(self, out: Outcome, exc: RequestError) -> None:
        """The request is answered with an error before any engine saw it."""
        out.error, out.status, out.end_s = exc.message, exc.status, self.clock.now
        out.shed_reason = exc.headers.get(SHED_REASON_HEADER, "")
        self._answered()

    def _start(
        self,
        out: Outcome,
        tokens: PromptTokens,
        sched: SchedulingRequest,
        decision: Decision,
        held_by: str = "",
        predicted_s: float | None = None,
    ) -> None:
        """The request's flow, from its first leg (``Flow.run``)."""
        r = _Request(out, tokens, sched)
        r.held_by, r.predicted_s = held_by, predicted_s
        out.mode, out.prefill, out.decode = decision.mode, decision.prefill, decision.decode
        r.prefill, r.decode = decision.prefill, decision.decode
        self.registry.hold(r.decode)  # D counts it from the decision on (``Flow.held``)
        if r.prefill is not None:
            self._prefill(r)
        else:
            self._decode(r)

    def _excluding(self, r: _Request) -> SchedulingRequest:
        return SchedulingRequest(
            r.sched.request_id, MODEL, r.sched.prompt_len, False, True, r.sched.cached_tokens, True,
            max_tokens=r.sched.max_tokens, exclude=frozenset(r.failed), slo_ttft_s=r.sched.slo_ttft_s,
            slo_tpot_s=r.sched.slo_tpot_s,
        )  # fmt: skip

    def _usable(self, agent_id: str) -> bool:
        view = self.registry.get(agent_id)
        return view is not None and view.state != "dead"

    def _prefill(self, r: _Request) -> None:
        """One prefill attempt on ``r.prefill`` (``Flow._prefill``)."""
        p = r.prefill
        assert p is not None
        engine = self.engines[p]
        r.prefill_tries += 1
        if not engine.alive or not self._usable(p):  # connect refused: fails at once
            self._prefill_failed(r, p)
            return
        self.registry.acquire(p)

        def done(leg: Leg, now: float) -> None:
            self.registry.release(p)
            self.registry.leg_succeeded(p)
            r.kv = True
            self._decode(r)

        def failed(leg: Leg, produced: int) -> None:
            self.registry.release(p)
            self._prefill_failed(r, p)

        engine.submit(Leg(r.out.request_id, r.tokens, 1, hold=True, on_done=done, on_fail=failed))

    def _prefill_failed(self, r: _Request, p: str) -> None:
        self.registry.leg_failed(p, self.clock.now)
        r.failed.add(p)
        nxt = None
        if may_retry_prefill(r.prefill_tries, False, self.config):
            nxt = self.scheduler.pick_prefill(
                self._excluding(r), self.registry.snapshot(), self.clock.now, r.decode
            )
        if nxt is not None:
            r.out.retries += 1
            r.prefill = r.out.prefill = nxt
            self._prefill(r)
            return
        # No prefill instance could do it: the decode instance computes the prompt itself.
        r.out.fallback = True
        r.prefill, r.out.prefill, r.out.mode, r.kv = None, None, "colocated", False
        self._decode(r)

    def _decode(self, r: _Request) -> None:
        """One decode attempt on ``r.decode`` (``Flow._decode``): KV pulled first when prefilled."""
        d, p = r.decode, r.prefill
        engine = self.engines[d]
        if not r.decode_tries:  # the decision's hold gives way to its first leg
            self.registry.unhold(d)
        r.decode_tries += 1
        if not engine.alive or not self._usable(d):
            self._decode_failed(r, d, 0, connected=False)
            return
        self.registry.acquire(d)
        out, external, delay = r.out, 0, 0.0
        if r.kv and p is not None:
            external = len(r.tokens)
            delay = self.net.pull(p, engine, external, r.sched.cached_tokens.get(d, 0), self.clock.now)

        def first(leg: Leg, now: float) -> None:
            if out.ttft_s is None:
                out.ttft_s = now - out.arrival_s
                if self.admission is not None and r.predicted_s is not None:  # as the gateway measures
                    self.admission.slack.observe(out.ttft_s, out.queued_s or 0.0, r.predicted_s)
                if out.mode == "disaggregated":  # less a wait for its decode stage: not the prefill pool's
                    waited = out.queued_s if r.held_by == "decode" and out.queued_s else 0.0
                    self.window.ttft(out.ttft_s - waited)

        def done(leg: Leg, now: float) -> None:
            self.registry.release(d)
            self.registry.leg_succeeded(d, partner=p)
            self._finished(r, now)

        def failed(leg: Leg, produced: int) -> None:
            self.registry.release(d)
            self._decode_failed(r, d, produced, connected=True)

        tokens = r.tokens
        if r.had:  # a resume: the prompt and the output so far, computed anew (``resume.StreamState``)
            tokens = PromptTokens([*r.tokens, *range(1, r.had + 1)])
        leg = Leg(out.request_id, tokens, out.output_tokens - r.had, external=external,
                  on_first=first, on_done=done, on_fail=failed)  # fmt: skip

        def arrive() -> None:
            if not engine.alive:  # died during the pull: the prefill engine still holds the KV
                self.registry.release(d)
                self._decode_failed(r, d, 0, connected=False)
                return
            if p is not None and r.kv:
                prefill_engine = self.engines[p]
                if prefill_engine.alive:
                    prefill_engine.release_hold(out.request_id)
                r.kv = False
            engine.submit(leg)

        if delay > 0:
            self.loop.after(delay, arrive)
        else:
            arrive()

    def _decode_failed(self, r: _Request, d: str, produced: int, *, connected: bool) -> None:
        now = self.clock.now
        self.registry.leg_failed(d, now, r.prefill, instance_fault=True)
        r.failed.add(d)
        if produced > 0 or r.out.ttft_s is not None:
            self._resume(r, produced)
            return
        picked = None
        if may_retry_decode(r.decode_tries, False, self.config):
            picked = next_decode(self.scheduler, self._excluding(r), self.registry.snapshot(), now, r.prefill)
        if picked is None:
            self._fail(r, "no decode instance could serve it")
            return
        r.out.retries += 1
        r.decode, prefill = picked
        r.out.decode = r.decode
        if prefill is None and r.prefill is not None:  # none can take KV from it: colocated
            r.prefill, r.out.prefill, r.out.mode, r.kv = None, None, "colocated", False
        if r.prefill is not None and connected:
            r.prefill_tries = 0
            self._prefill(r)  # the failed instance may have pulled the KV, and the prefill freed it
        else:
            self._decode(r)

    def _resume(self, r: _Request, produced: int) -> None:
        """A stream cut after its first token goes on colocated elsewhere (``Flow._resume``)."""
        out = r.out
        had = r.had + produced
        if not may_resume(out.resumes, False, self.config) or had >= out.output_tokens:
            self._fail(r, "stream cut")
            return
        nxt = resume_pick(self.scheduler, self._excluding(r), self.registry.snapshot(), self.clock.now)
        if nxt is None:
            self._fail(r, "stream cut, no instance to resume on")
            return
        out.resumes += 1
        r.prefill, r.decode, out.decode, out.mode = None, nxt, nxt, "colocated"
        r.kv, r.had = False, had
        self._decode(r)

    @property
    def unanswered(self) -> int:
        """Requests of the trace not answered yet (arrived or not): 0 once a run is over."""
        return self._unfinished

    def _answered(self) -> None:
        self._unfinished -= 1
        if not self._unfinished:
            self.loop.stop()  # heartbeats and the planner would tick on for ever

    def _ended(self) -> None:
        """An admitted request is over: room may have come for the queue (the gateway's ``kick``)."""
        if self.admission is not None:
            self.admission.kick()

    def _finished(self, r: _Request, now: float) -> None:
        self._answered()
        out = r.out
        out.ok, out.status, out.end_s = True, 200, now
        self._ended()
        n = out.output_tokens
        if out.ttft_s is not None and n > 1:
            out.tpot_s = (now - out.arrival_s - out.ttft_s) / (n - 1)
            self.window.tpot(out.tpot_s)

    def _fail(self, r: _Request, why: str) -> None:
        r.out.ok, r.out.error, r.out.status, r.out.end_s = False, why, 502, self.clock.now
        self._answered()
        self._ended()
