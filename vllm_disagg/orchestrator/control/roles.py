"""The one way an instance changes role: the operator's (``vllm-disagg role``, the admin API) and the
planner's. What a change does, step by step, is decided by ``role_steps`` (pure); this carries it out:
it asks the agent over the control plane, changes the registry, publishes the ``role_restart``
events, and steps again when the registry changes (a request ending during the drain, the new engine's
ready heartbeat) or a deadline passes on the injected clock. Nothing polls.

Every change feeds ``vllm_disagg_role_change_seconds{how}``; the planner's cooldown counts from the
last one (``last_change_at``).

With replicas (``record``), each new state of a change is recorded in etcd with its drain before it
is acted on, and every replica keeps what is recorded (``adopt``). A replica that begins to lead goes
on with each change left under way (``take_over``): from its recorded state, asking the agent again
what it may already have been asked, which it answers the same way twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from vllm_disagg.clock import Clock, wait_event
from vllm_disagg.errors import Conflict, NotFound, RequestError, TimedOut
from vllm_disagg.orchestrator.control import role_steps as steps
from vllm_disagg.orchestrator.control.role_steps import (
    Answer,
    Ask,
    EngineRestarting,
    Fail,
    Limits,
    MoveRole,
    Publish,
    RoleState,
    SetDrain,
)
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.intent import IntentRecorder
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.commands import CommandPayload, SetRole, Undrain
from vllm_disagg.protocol.messages import Ack, Role

log = logging.getLogger(__name__)


class Commands(Protocol):
    """What a role change needs of the control plane (``ControlPlane``): a command sent, its Ack back."""

    async def send_command(
        self, agent_id: str, payload: CommandPayload, timeout_s: float | None = None
    ) -> Ack: ...


@dataclass(slots=True)
class RoleChange:
    """What a role change did: the old role, the instance now, how, and when each step ended."""

    old: Role
    view: InstanceView
    how: Literal["none", "routing", "restart"]
    # Seconds since the change was asked: "drained", "restarting" (the agent said yes), "ready".
    timeline: dict[str, float] = field(default_factory=dict)
    left_in_flight: int = 0  # requests still on it when the drain timed out (they failed over)


class RoleChanger:
    """Changes roles, and remembers when it last did (the planner's cooldown counts from it)."""

    def __init__(
        self,
        registry: Registry,
        control: Commands,
        metrics: OrchestratorMetrics,
        clock: Clock,
        events: EventLog | None = None,
        *,
        drain_timeout_s: float = 30.0,
        restart_timeout_s: float = 600.0,
        record: IntentRecorder | None = None,
    ) -> None:
        self._record = record
        self.recorded: dict[str, Any] = {}  # agent id -> a change under way, as etcd holds it
        self._resumed: set[asyncio.Task[None]] = set()
        self._registry = registry
        self._control = control
        self._metrics = metrics
        self._clock = clock
        self._events = events
        self.drain_timeout_s = drain_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.last_change_at: float | None = None  # monotonic
        self._changing: set[str] = set()  # instances whose change is under way

    async def change(self, agent_id: str, role: Role) -> RoleChange:
        """Serve ``agent_id`` as ``role``; when it does not, the ``RequestError`` that says why (the
        admin API's answer): ``NotFound``, ``Conflict``, ``TimedOut`` or the agent's ``CommandError``."""
        view = self._registry.get(agent_id)
        if view is None:
            raise NotFound(f"no instance {agent_id!r}")
        if role == view.info.role:
            return RoleChange(view.info.role, view, "none")
        if agent_id in self._changing:
            raise Conflict(f"a role change of {agent_id} is under way")
        self._changing.add(agent_id)
        try:
            limits = Limits(self.drain_timeout_s, self.restart_timeout_s)
            state = await self._drive(steps.begin(view, role, self._clock.monotonic(), limits))
        finally:
            self._changing.discard(agent_id)
        now = self._clock.monotonic()
        self._metrics.role_changed(agent_id, state.old, role, state.how, now - state.started)
        self.last_change_at = now
        return RoleChange(
            state.old,
            self._registry.get(agent_id) or view,
            state.how,
            dict(state.timeline),
            state.left_in_flight,
        )

    async def _drive(self, step: steps.Step) -> RoleState:
        """Carry out each step's effects and take the next: on the agent's answer, on a change of the
        registry (in-flight counts included), or at the state's deadline. Returns the ended state, or
        raises the failure's error; a cancelled change puts back the drain it made."""
        changed = asyncio.Event()
        unwatch = self._registry.watch(changed.set, in_flight=True)
        state = step.state
        error: RequestError | None = None  # the last command's, raised as is on ``Fail("agent")``
        saved: RoleState | None = None
        try:
            while True:
                state = step.state
                if self._record is not None and state != saved:
                    await self._save(step)
                    saved = state
                self._carry_out(step, error)
                if state.phase in steps.ENDED:
                    return state
                ask = step.ask
                if ask is not None:
                    answer, error = await self._answer(ask)
                    step = steps.answered(state, answer, self._clock.monotonic())
                    continue
                changed.clear()
                step = steps.step(state, self._registry.snapshot(), self._clock.monotonic())
                while step.state == state and not step.effects:  # nothing yet: wait for a reason to look
                    timeout = None if state.deadline is None else state.deadline - self._clock.monotonic()
                    await wait_event(self._clock, changed, timeout)
                    changed.clear()
                    step = steps.step(state, self._registry.snapshot(), self._clock.monotonic())
        except asyncio.CancelledError:
            self._carry_out(steps.cancel(state), None)
            raise
        finally:
            unwatch()

    async def _save(self, step: steps.Step) -> None:
        """Record the step's state (gone once the change ended) and its drain, before acting on it."""
        assert self._record is not None
        state = step.state
        record = None
        if state.phase not in steps.ENDED:
            record = state.record(self._clock.monotonic(), self._clock.wall())
        intents = {
            e.agent_id: dataclasses.replace(self._registry.intent_of(e.agent_id), drained=e.draining)
            for e in step.effects
            if isinstance(e, SetDrain)
        }
        await self._record.save_role(state.agent_id, record, intents)

    def adopt(self, agent_id: str, record: Any) -> None:
        """A change under way as etcd holds it (None: it ended): kept, for this replica to go on with
        if it comes to lead."""
        if record is None:
            self.recorded.pop(agent_id, None)
        else:
            self.recorded[agent_id] = record

    def take_over(self) -> None:
        """This replica now leads: go on with every change the last leader left under way."""
        for agent_id, record in list(self.recorded.items()):
            view = self._registry.get(agent_id)
            if agent_id in self._changing or view is None:
                continue
            try:
                state = steps.RoleState.from_record(
                    record, view.session, self._clock.monotonic(), self._clock.wall()
                )
            except ValueError as exc:
                log.error("a recorded role change of %s cannot go on: %s", agent_id, exc)
                continue
            task = asyncio.get_running_loop().create_task(self._resume(state))
            self._resumed.add(task)
            task.add_done_callback(self._resumed.discard)

    async def _resume(self, state: RoleState) -> None:
        self._changing.add(state.agent_id)
        log.info("going on with the role change of %s to %s (%s)", state.agent_id, state.new, state.phase)
        try:
            ended = await self._drive(steps.resume(state))
        except RequestError as exc:
            log.warning("the role change of %s to %s failed: %s", state.agent_id, state.new, exc.message)
            return
        finally:
            self._changing.discard(state.agent_id)
        now = self._clock.monotonic()
        self._metrics.role_changed(state.agent_id, state.old, state.new, ended.how, now - state.started)
        self.last_change_at = now

    async def close(self) -> None:
        """Stop the changes this replica went on with (the next leader goes on with them in turn)."""
        for task in list(self._resumed):
            task.cancel()
        await asyncio.gather(*self._resumed, return_exceptions=True)

    def _undrain_agent(self, agent_id: str) -> None:
        async def tell() -> None:
            try:
                await self._control.send_command(agent_id, Undrain())
            except RequestError as exc:
                log.warning("could not tell %s it is undrained: %s", agent_id, exc.message)

        task = asyncio.get_running_loop().create_task(tell())
        self._resumed.add(task)
        task.add_done_callback(self._resumed.discard)

    async def _answer(self, ask: Ask) -> tuple[Answer, RequestError | None]:
        try:
            ack = await self._control.send_command(ask.agent_id, SetRole(ask.role, ask.restart))
        except RequestError as exc:  # not delivered or not acknowledged: the control plane says why
            return Answer(False, error=exc.message, delivered=False), exc
        return Answer(ack.ok, ack.code, ack.error), None

    def _carry_out(self, step: steps.Step, error: RequestError | None) -> None:
        state = step.state
        for effect in step.effects:
            if isinstance(effect, SetDrain):
                view = self._registry.get(effect.agent_id)
                if view is not None:
                    self._registry.set_admin_drain(effect.agent_id, effect.draining)
                    if not effect.draining and view.agent_draining:
                        # Its agent was told it was drained meanwhile (a new agent process is told
                        # an operator's drain again): the drain put back is the agent's too.
                        self._undrain_agent(effect.agent_id)
            elif isinstance(effect, MoveRole):
                self._registry.set_role(effect.agent_id, effect.role)
            elif isinstance(effect, EngineRestarting):
                self._registry.engine_restarting(effect.agent_id, effect.reason)
            elif isinstance(effect, Publish):
                self._publish(state, effect)
            elif isinstance(effect, Fail):
                raise _error(effect, error)

    def _publish(self, state: RoleState, effect: Publish) -> None:
        if self._events is None:
            return
        fields: dict[str, Any] = {"instance": state.agent_id, "from": state.old, "to": state.new}
        fields["step"] = effect.step
        fields["timeline"] = dict(effect.timeline)
        if effect.left_in_flight:
            fields["left_in_flight"] = effect.left_in_flight
        if effect.error:
            fields["error"] = effect.error
        self._events.publish("role_restart", **fields)


def _error(fail: Fail, error: RequestError | None) -> RequestError:
    """The error the operator gets for ``fail``: the control plane's own for a command that failed."""
    if fail.failure == "agent" and error is not None:
        return error
    if fail.failure == "timed_out":
        return TimedOut(fail.message)
    return Conflict(fail.message)
