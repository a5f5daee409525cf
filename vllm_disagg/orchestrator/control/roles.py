"""The one way an instance changes role: the operator's (``vllm-disagg role``, the admin API) and the
planner's. Its agent is asked first (``set_role``: it checks that the engine can serve the role;
``Conflict`` with its reason if not). Two ways follow:

- **routing** (vLLM ``kv_both`` engines, the simulator: they serve either role as they run): on yes
  the registry moves the instance to the other pool at once, its session and its requests in flight
  untouched;
- **restart** (a vLLM launched ``kv_producer`` or ``kv_consumer``): the agent answers
  ``restart_required``; the instance is drained (no new requests; those on it finish, for at most
  ``role_drain_timeout_s``, and any left then fail over like those of a dead engine), asked again
  with ``restart``, moved to its new pool while its agent restarts the engine with the new role's
  ``kv_role``, and routed to once the new engine is ready (within ``role_restart_timeout_s``).

Each restart's steps are ``role_restart`` events with their timeline (seconds since the request);
every change feeds ``vllm_disagg_role_change_seconds{how}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_disagg.clock import Clock
from vllm_disagg.errors import Conflict, NotFound, RequestError, TimedOut
from vllm_disagg.orchestrator.control.plane import ControlPlane
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.commands import SetRole
from vllm_disagg.protocol.messages import RESTART_REQUIRED, Ack, Role

_POLL_S = 0.05  # how often a drain or a restart is looked at (the registry has no change callback)


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
        control: ControlPlane,
        metrics: OrchestratorMetrics,
        clock: Clock,
        events: EventLog | None = None,
        *,
        drain_timeout_s: float = 30.0,
        restart_timeout_s: float = 600.0,
    ) -> None:
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
        old = view.info.role
        if role == old:
            return RoleChange(old, view, "none")
        if agent_id in self._changing:
            raise Conflict(f"a role change of {agent_id} is under way")
        self._changing.add(agent_id)
        try:
            started = self._clock.monotonic()
            ack = await self._ask(agent_id, role)
            if ack.ok:
                change = RoleChange(old, self._registry.set_role(agent_id, role), "routing")
            elif ack.code == RESTART_REQUIRED:
                change = await self._restart(agent_id, old, role, started)
            else:
                raise Conflict(f"{agent_id} cannot serve as {role}: {ack.error}")
        finally:
            self._changing.discard(agent_id)
        self._metrics.role_changed(agent_id, old, role, change.how, self._clock.monotonic() - started)
        self.last_change_at = self._clock.monotonic()
        return change

    async def _ask(self, agent_id: str, role: Role, restart: bool = False) -> Ack:
        return await self._control.send_command(agent_id, SetRole(role, restart))

    async def _restart(self, agent_id: str, old: Role, role: Role, started: float) -> RoleChange:
        """Drain, have the agent restart its engine as ``role``, wait for it to be ready, undrain."""
        view = self._registry.get(agent_id)
        assert view is not None
        change = RoleChange(old, view, "restart")
        was_draining, session = view.admin_draining, view.session
        self._registry.set_admin_drain(agent_id, True)  # routing follows at once
        self._step(change, agent_id, role, "draining")
        try:
            drained = await self._until(lambda: self._in_flight(agent_id) == 0, self.drain_timeout_s)
            change.left_in_flight = 0 if drained else self._in_flight(agent_id)
            self._mark(change, "drained", started)
            self._alive(agent_id, session)
            ack = await self._ask(agent_id, role, restart=True)
            if not ack.ok:
                raise Conflict(f"{agent_id} cannot serve as {role}: {ack.error}")
            # The Ack arrives before the heartbeat that says so: the old engine must not look ready.
            self._registry.engine_restarting(agent_id, f"restarting as {role}")
            change.view = self._registry.set_role(agent_id, role)
            self._mark(change, "restarting", started)
            self._step(change, agent_id, role, "restarting")

            def ready() -> bool:
                self._alive(agent_id, session)
                v = self._registry.get(agent_id)
                return v is not None and v.engine_state == "ready"

            if not await self._until(ready, self.restart_timeout_s):
                raise TimedOut(
                    f"{agent_id} restarted as {role} but its engine was not ready within "
                    f"{self.restart_timeout_s:g} s (it is routed to once it is)"
                )
            self._mark(change, "ready", started)
        except RequestError as exc:
            self._step(change, agent_id, role, "failed", error=exc.message)
            raise
        finally:
            if self._registry.get(agent_id) is not None:
                change.view = self._registry.set_admin_drain(agent_id, was_draining)
        self._step(change, agent_id, role, "ready")
        return change

    def _alive(self, agent_id: str, session: int) -> None:
        """``Conflict`` once the instance died or its agent started another session."""
        view = self._registry.get(agent_id)
        if view is None or view.state == "dead" or view.session != session:
            why = "is gone" if view is None or view.state == "dead" else "started a new session"
            raise Conflict(f"{agent_id} {why} during its role change")

    def _in_flight(self, agent_id: str) -> int:
        return self._registry.snapshot().in_flight_of(agent_id)

    async def _until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Whether ``done()`` came true within ``timeout_s`` (checked every ``_POLL_S``)."""
        deadline = self._clock.monotonic() + timeout_s
        while not done():
            if self._clock.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def _mark(self, change: RoleChange, step: str, started: float) -> None:
        change.timeline[step] = round(self._clock.monotonic() - started, 3)

    def _step(self, change: RoleChange, agent_id: str, role: Role, step: str, error: str = "") -> None:
        if self._events is None:
            return
        fields: dict[str, Any] = {"instance": agent_id, "from": change.old, "to": role, "step": step}
        fields["timeline"] = dict(change.timeline)
        if change.left_in_flight:
            fields["left_in_flight"] = change.left_in_flight
        if error:
            fields["error"] = error
        self._events.publish("role_restart", **fields)
