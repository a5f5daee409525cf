"""Rollouts and role changes in the simulated cluster, on virtual time.

The orchestrator's own pure steps decide (``rollout_steps``, ``role_steps``); this carries out their
effects on the simulated instances, as ``control/rollout.py`` and ``control/roles.py`` do on real ones,
and steps them the same way: when the registry changes (in-flight counts included) and when a
deadline passes, here an event of the simulator's loop at that virtual instant. Nothing polls.

What is modelled: the operator (a rollout started, and rolled back, at given times; role changes at
given times), the agents' answers (``set_role``: yes at once where engines serve either role, the
``routing`` way; ``restart_required`` and then a restart of the engine, the ``restart`` way), and new
engines (a rollout's new revision joining one instance at a time; a restarted engine), each ready
``engine_start_s`` after it starts. Commands cost no time, as every hop but a KV transfer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from vllm_disagg.cluster_sim.virtual_clock import WALL_ORIGIN, EventLoop
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import RequestError
from vllm_disagg.orchestrator.control import role_steps, rollout_steps
from vllm_disagg.orchestrator.control.role_steps import Answer, Limits, RoleState
from vllm_disagg.orchestrator.control.rollout_steps import MOVING, RolloutState
from vllm_disagg.orchestrator.state.registry import Registry, Unwatch
from vllm_disagg.protocol.messages import RESTART_REQUIRED, Role

RoleSwitch = Literal["routing", "restart"]


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """The operator rolls ``model`` to ``to_revision`` at ``at_s``; the new revision's instances (one
    per old instance, in its role, named ``<old id>-<revision>``) join one every ``join_every_s`` from
    then; with ``rollback_at_s`` the operator rolls it back at that time."""

    at_s: float
    to_revision: str = "r2"
    join_every_s: float = 5.0
    rollback_at_s: float | None = None
    model: str | None = None  # None: the one model served


@dataclass(frozen=True, slots=True)
class RoleChangePlan:
    """The operator changes ``instance`` to ``role`` at ``at_s`` (``vllm-disagg role``)."""

    at_s: float
    instance: str
    role: Role


@dataclass(frozen=True, slots=True)
class ControlEvent:
    """What the orchestrator's event log would say: a ``rollout`` or ``role_restart`` event, or a
    ``role_change`` when a change ends (the admin call's answer, or the planner's shift record)."""

    at_s: float
    kind: str
    fields: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The event as ``--json`` prints it."""
        return {"at_s": round(self.at_s, 3), "kind": self.kind, **self.fields}

    def describe(self) -> str:
        """One line for the table mode's report."""
        f = self.fields
        if self.kind == "rollout":
            what = f["what"] + (f" {f['instance']}" if "instance" in f else "")
            return f"{self.at_s:9.2f} s  rollout of {f['model']} {f['from']!r} -> {f['to']!r}: {what}"
        if self.kind == "role_restart":
            return f"{self.at_s:9.2f} s  {f['instance']} {f['from']} -> {f['to']}: {f['step']}"
        if self.kind != "role_change":  # refused: the admin API's answer
            return f"{self.at_s:9.2f} s  {self.kind}: {f.get('instance', '')} {f['error']}"
        timeline = ", ".join(f"{k} {v:g} s" for k, v in f.get("timeline", {}).items())
        outcome = f"{f['outcome']} by {f['how']}" if f["outcome"] == "done" else f"failed: {f.get('error')}"
        return f"{self.at_s:9.2f} s  {f['instance']} {f['from']} -> {f['to']} ({f['by']}): {outcome}" + (
            f" ({timeline})" if timeline else ""
        )


class SimCluster(Protocol):
    """What the control steps need of the simulated cluster (``cluster.Cluster``)."""

    registry: Registry
    loop: EventLoop

    def join(self, agent_id: str, role: Role, revision: str, start_s: float) -> None:
        """A new instance says Hello; its engine is ready ``start_s`` from now."""

    def restart_engine(self, agent_id: str, start_s: float) -> None:
        """Its agent stops the engine (requests on it fail over) and starts it again, ready in ``start_s``."""

    def agent_up(self, agent_id: str) -> bool:
        """Whether its agent is there to answer a command."""


@dataclass(slots=True)
class _Change:
    """A role change under way: its state, who asked for it, and the deadline a step is set for."""

    state: RoleState
    by: str  # "operator" or "planner"
    wake_at: float | None = None


class SimControl:
    """The simulated orchestrator's rollouts and role changes; ``events`` is what it published."""

    def __init__(
        self,
        cluster: SimCluster,
        config: OrchestratorConfig,
        *,
        role_switch: RoleSwitch = "routing",
        engine_start_s: float = 10.0,
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.role_switch = role_switch
        self.engine_start_s = engine_start_s
        self.rollouts: dict[str, RolloutState] = {}
        self.changes: dict[str, _Change] = {}  # under way, by agent id
        self.events: list[ControlEvent] = []
        self.last_change_at: float | None = None  # the planner's cooldown counts from it
        self._due = False  # a step is scheduled for a registry change
        self._unwatch: Unwatch | None = None

    @property
    def now(self) -> float:
        return self.cluster.loop.clock.now

    def schedule(self, rollout: RolloutPlan | None, role_changes: Sequence[RoleChangePlan]) -> None:
        """Put the operator's actions on the event loop."""
        loop = self.cluster.loop
        if rollout is not None:
            loop.at(rollout.at_s, lambda: self.start_rollout(rollout))
            if rollout.rollback_at_s is not None:
                loop.at(rollout.rollback_at_s, lambda: self.rollback(rollout))
        for plan in role_changes:
            loop.at(plan.at_s, lambda p=plan: self._operator_change(p))  # type: ignore[misc]

    # --- the operator's (and the planner's) actions ------------------------------------------------

    def start_rollout(self, plan: RolloutPlan) -> None:
        """Start the rollout, and have the new revision's instances join one at a time."""
        snap = self.cluster.registry.snapshot()
        try:
            step = rollout_steps.begin(
                snap, plan.model, plan.to_revision, self.rollouts, WALL_ORIGIN + self.now
            )
        except RequestError as exc:  # what the admin API would answer: the rollout does not start
            self._publish("rollout_refused", {"error": exc.message})
            return
        self._apply_rollout(step)
        state = step.state
        old = [
            v
            for v in snap.instances
            if v.info.model == state.model and v.info.revision == state.from_revision and v.state != "dead"
        ]
        for n, v in enumerate(old):
            new_id = f"{v.agent_id}-{plan.to_revision}"
            self.cluster.loop.after(
                n * plan.join_every_s,
                lambda a=new_id, r=v.info.role: self.cluster.join(  # type: ignore[misc]
                    a, r, plan.to_revision, self.engine_start_s
                ),
            )
        self._step()

    def rollback(self, plan: RolloutPlan) -> None:
        """Roll the rollout back (refused, as the admin API would, when it is over)."""
        state = self.rollouts.get(plan.model or next(iter(self.rollouts), ""))
        if state is None:
            return
        try:
            step = rollout_steps.rollback(state, self.cluster.registry.snapshot())
        except RequestError as exc:
            self._publish("rollout_refused", {"error": exc.message})
            return
        self._apply_rollout(step)
        self._step()

    def _operator_change(self, plan: RoleChangePlan) -> None:
        if not self.change_role(plan.instance, plan.role):
            why = "a change of it is under way" if plan.instance in self.changes else "no such instance"
            self._publish("role_change_refused", {"instance": plan.instance, "to": plan.role, "error": why})

    def change_role(self, agent_id: str, role: Role, by: str = "operator") -> bool:
        """Begin changing ``agent_id`` to ``role``; False when it cannot begin (unknown, or a change of it
        is under way: the admin API's 404 and 409)."""
        view = self.cluster.registry.get(agent_id)
        if view is None or agent_id in self.changes:
            return False
        limits = Limits(self.config.role_drain_timeout_s, self.config.role_restart_timeout_s)
        step = role_steps.begin(view, role, self.now, limits)
        self.changes[agent_id] = _Change(step.state, by)
        self._apply_role(step)
        return True

    @property
    def changing(self) -> bool:
        """Whether a role change is under way."""
        return bool(self.changes)

    # --- stepping -----------------------------------------------------------------------------------

    def _changed(self) -> None:
        """The registry changed: one step after the event under way, however many changes it made."""
        if not self._due:
            self._due = True
            self.cluster.loop.after(0.0, self._step_due)

    def _step_due(self) -> None:
        self._due = False
        self._step()

    def _step(self) -> None:
        """Step every moving rollout and every change under way by the registry as it is now."""
        snap = self.cluster.registry.snapshot()
        for state in list(self.rollouts.values()):
            if state.phase in MOVING:
                self._apply_rollout(rollout_steps.step(state, snap))
        for change in list(self.changes.values()):
            self._apply_role(role_steps.step(change.state, snap, self.now))

    def _watch(self) -> None:
        """Watch the registry only while something moves (requests pay nothing otherwise)."""
        moving = bool(self.changes) or any(r.phase in MOVING for r in self.rollouts.values())
        if moving and self._unwatch is None:
            self._unwatch = self.cluster.registry.watch(self._changed, in_flight=True)
        elif not moving and self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    # --- carrying out rollouts' effects --------------------------------------------------------------

    def _apply_rollout(self, step: rollout_steps.Step) -> None:
        state = step.state
        self.rollouts[state.model] = state
        registry = self.cluster.registry
        for effect in step.effects:
            if isinstance(effect, rollout_steps.Drain) and registry.get(effect.agent_id) is not None:
                registry.set_admin_drain(effect.agent_id, effect.draining)
            elif isinstance(effect, rollout_steps.Publish):
                fields: dict[str, Any] = {"model": state.model, "what": effect.what, "phase": effect.phase}
                fields.update({"from": state.from_revision, "to": state.to_revision})
                if effect.instance is not None:
                    fields["instance"] = effect.instance
                self._publish("rollout", fields)
            # Admit and Settle hold later Hellos to a revision's settings: the simulated agents all agree.
        self._watch()

    # --- carrying out role changes' effects ----------------------------------------------------------

    def _apply_role(self, step: role_steps.Step) -> None:
        state = step.state
        change = self.changes.get(state.agent_id)
        if change is None:
            return
        change.state = state
        registry = self.cluster.registry
        for effect in step.effects:
            if isinstance(effect, role_steps.Ask):
                self.cluster.loop.after(0.0, lambda a=effect: self._answer(a))  # type: ignore[misc]
            elif isinstance(effect, role_steps.SetDrain) and registry.get(effect.agent_id) is not None:
                registry.set_admin_drain(effect.agent_id, effect.draining)
            elif isinstance(effect, role_steps.MoveRole):
                registry.set_role(effect.agent_id, effect.role)
            elif isinstance(effect, role_steps.EngineRestarting):
                registry.engine_restarting(effect.agent_id, effect.reason)
            elif isinstance(effect, role_steps.Publish):
                self._publish("role_restart", _restart_fields(state, effect))
            elif isinstance(effect, role_steps.Done | role_steps.Fail):
                self._ended(change, effect)
        deadline = state.deadline
        if state.phase not in role_steps.ENDED and deadline is not None and deadline != change.wake_at:
            change.wake_at = deadline
            self.cluster.loop.at(deadline, self._step)  # a wake the change no longer needs does nothing
        self._watch()

    def _answer(self, ask: role_steps.Ask) -> None:
        """The simulated agent answers ``set_role`` (and, asked to restart, restarts its engine)."""
        change = self.changes.get(ask.agent_id)
        if change is None:
            return
        if not self.cluster.agent_up(ask.agent_id):
            answer = Answer(False, error=f"instance {ask.agent_id!r} has no live session", delivered=False)
        elif self.role_switch == "routing":
            answer = Answer(True)
        elif not ask.restart:
            answer = Answer(False, RESTART_REQUIRED, "the engine was launched for one role: restart it")
        else:
            self.cluster.restart_engine(ask.agent_id, self.engine_start_s)
            answer = Answer(True)
        self._apply_role(role_steps.answered(change.state, answer, self.now))

    def _ended(self, change: _Change, effect: role_steps.Done | role_steps.Fail) -> None:
        state = change.state
        del self.changes[state.agent_id]
        fields: dict[str, Any] = {"instance": state.agent_id, "from": state.old, "to": state.new}
        fields.update({"by": change.by, "how": state.how, "timeline": dict(state.timeline)})
        if isinstance(effect, role_steps.Done):
            fields["outcome"] = "done"
            self.last_change_at = self.now
        else:
            fields.update({"outcome": "failed", "error": effect.message})
        self._publish("role_change", fields)

    def _publish(self, kind: str, fields: dict[str, Any]) -> None:
        self.events.append(ControlEvent(self.now, kind, fields))


def _restart_fields(state: RoleState, effect: role_steps.Publish) -> dict[str, Any]:
    fields: dict[str, Any] = {"instance": state.agent_id, "from": state.old, "to": state.new}
    fields.update({"step": effect.step, "timeline": dict(effect.timeline)})
    if effect.left_in_flight:
        fields["left_in_flight"] = effect.left_in_flight
    if effect.error:
        fields["error"] = effect.error
    return fields
