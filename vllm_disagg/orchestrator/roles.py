"""The one way an instance changes role: the operator's (``vllm-disagg role``, the admin API) and the
planner's. Its agent is asked first (``set_role``: it checks that the engine can serve the role, 409
with its reason if not); on yes the registry moves it to the other pool at once, its session and its
requests in flight untouched (vLLM's ``kv_both`` engines serve either role as they run)."""

from __future__ import annotations

from vllm_disagg.clock import Clock
from vllm_disagg.orchestrator.control import CommandError, ControlPlane
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.registry import InstanceView, Registry
from vllm_disagg.protocol.messages import Role


class RoleChangeError(Exception):
    """A role change that did not happen; ``status`` is the admin API's answer to it."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind  # the error's type in the admin API's answer


class RoleChanger:
    """Changes roles, and remembers when it last did (the planner's cooldown counts from it)."""

    def __init__(
        self, registry: Registry, control: ControlPlane, metrics: OrchestratorMetrics, clock: Clock
    ) -> None:
        self._registry = registry
        self._control = control
        self._metrics = metrics
        self._clock = clock
        self.last_change_at: float | None = None  # monotonic

    async def change(self, agent_id: str, role: Role) -> tuple[Role, InstanceView]:
        """Serve ``agent_id`` as ``role``: (its old role, its view); ``RoleChangeError`` otherwise."""
        view = self._registry.get(agent_id)
        if view is None:
            raise RoleChangeError(404, f"no instance {agent_id!r}", "NotFoundError")
        old = view.info.role
        if role == old:
            return old, view
        try:
            ack = await self._control.send_command(agent_id, "set_role", {"role": role})
        except CommandError as exc:
            raise RoleChangeError(exc.status, str(exc), type(exc).__name__) from None
        if not ack.ok:
            raise RoleChangeError(409, f"{agent_id} cannot serve as {role}: {ack.error}", "ConflictError")
        view = self._registry.set_role(agent_id, role)
        self._metrics.role_changed(agent_id, old, role)
        self.last_change_at = self._clock.monotonic()
        return old, view
