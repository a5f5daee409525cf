"""Rolling model upgrades: instances of a new revision join beside the old ones and take the load as
the old revision drains out; pausable, and reversible.

``vllm-disagg rollout --to REVISION`` (``POST /admin/v1/rollouts``) starts one for a model. Until then a
Hello of another revision of a served model is refused (``model_mismatch``): a revision joins only
when an operator says so. During it:

- instances of the new revision are admitted (each revision with its own engine, tokenizer and block
  size); pairs never mix revisions (``kv-compat-filter``), so a request runs on an old pair or on a
  new one, never across;
- every ``STEP_S`` the rollout drains one old instance for each new one that is ready, role by role
  (least busy first; all of them once the new revision has as many ready instances as the old had):
  a drained instance takes no new request and finishes those it has, so no client sees an error;
- it is **complete** once every old instance is drained and idle; new Hellos of the model are then
  checked against the new revision's settings (old instances stay registered, drained, for the
  operator to shut down);
- **pause** stops it where it is; **resume** goes on; **rollback** undrains the old instances it
  drained and moves the load back the same way, draining one new instance for each old one ready
  again (``rolling_back``, then ``rolled_back``): at no moment is a role left without a ready
  instance by the rollout.

Each step is a ``rollout`` event (admin API, dashboard).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_disagg.clock import Clock
from vllm_disagg.errors import RolloutConflict, RolloutInvalid, RolloutNotFound
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.commands import CommandPayload, Drain, Undrain

log = logging.getLogger(__name__)

STEP_S = 0.25
Phase = Literal["rolling", "paused", "complete", "rolling_back", "rolled_back"]


@dataclass
class Rollout:
    """One model's rollout (owned by ``Rollouts``)."""

    model: str
    from_revision: str
    to_revision: str
    started_at: float  # wall
    phase: Phase = "rolling"
    drained: list[str] = field(default_factory=list)  # old instances this rollout drained, in order
    held: list[str] = field(default_factory=list)  # new instances it drained rolling back

    def to_json(self, registry: Registry) -> dict[str, Any]:
        snap = registry.snapshot()

        def of(revision: str) -> list[dict[str, Any]]:
            return [
                {
                    "agent_id": v.agent_id,
                    "role": v.info.role,
                    "state": v.state,
                    "in_flight": snap.in_flight_of(v.agent_id),
                }
                for v in snap.instances
                if v.info.model == self.model and v.info.revision == revision and v.state != "dead"
            ]

        return {
            "model": self.model,
            "from": self.from_revision,
            "to": self.to_revision,
            "phase": self.phase,
            "started_at": self.started_at,
            "drained": list(self.drained),
            "held": list(self.held),
            "old": of(self.from_revision),
            "new": of(self.to_revision),
        }


class Rollouts:
    """Every model's rollout; ``step()`` moves the rolling ones on (the orchestrator's task calls it)."""

    def __init__(
        self,
        registry: Registry,
        admit: Callable[[str, str, str], None],
        complete: Callable[[str, str], None],
        command: Callable[[str, CommandPayload], Awaitable[object]],
        events: EventLog,
        clock: Clock,
    ) -> None:
        self._registry = registry
        self._admit = admit  # (model, old revision, new revision): Hellos of both are accepted
        self._complete = complete  # (model, new revision): new Hellos are checked against it
        self._command = command  # (agent id, Drain() | Undrain()): tell the agent (best effort)
        self._events = events
        self._clock = clock
        self.by_model: dict[str, Rollout] = {}
        self._tasks: set[asyncio.Future[None]] = set()

    def start(self, model: str | None, to_revision: str) -> Rollout:
        """Begin rolling ``model`` (the only one served, when None) to ``to_revision``."""
        snap = self._registry.snapshot()
        models = sorted({v.info.model for v in snap.instances if v.state != "dead"})
        if model is None:
            if len(models) != 1:
                raise RolloutInvalid(f"name the model: served models are {models}")
            model = models[0]
        live = [v for v in snap.instances if v.info.model == model and v.state != "dead"]
        if not live:
            raise RolloutNotFound(f"no live instance serves model {model!r}")
        revisions = sorted({v.info.revision for v in live})
        current = self.by_model.get(model)
        if current is not None and current.phase in ("rolling", "paused", "rolling_back"):
            raise RolloutConflict(
                f"model {model!r} is already rolling to {current.to_revision!r} ({current.phase})"
            )
        if revisions == [to_revision]:
            raise RolloutConflict(f"model {model!r} is served by revision {to_revision!r} already")
        from_revision = revisions[0] if len(revisions) == 1 else self._serving(model, live, to_revision)
        rollout = Rollout(model, from_revision, to_revision, self._clock.wall())
        self.by_model[model] = rollout
        self._admit(model, from_revision, to_revision)
        self._publish(rollout, "started")
        log.info("rollout of %s: %r -> %r started", model, from_revision, to_revision)
        return rollout

    def _serving(self, model: str, live: list[InstanceView], to_revision: str) -> str:
        others = sorted({v.info.revision for v in live if v.info.revision != to_revision})
        if len(others) != 1:
            raise RolloutConflict(
                f"model {model!r} is served by several revisions {others}: finish one first"
            )
        return others[0]

    def pause(self, model: str) -> Rollout:
        """Stop draining where it is (both revisions serve) until ``resume``."""
        rollout = self._get(model, ("rolling",))
        rollout.phase = "paused"
        self._publish(rollout, "paused")
        return rollout

    def resume(self, model: str) -> Rollout:
        """Go on with a paused rollout."""
        rollout = self._get(model, ("paused",))
        rollout.phase = "rolling"
        self._publish(rollout, "resumed")
        return rollout

    def rollback(self, model: str) -> Rollout:
        """Undrain the old instances this rollout drained; the new revision's drain as they are ready."""
        rollout = self._get(model, ("rolling", "paused", "complete"))
        rollout.phase = "rolling_back"
        for agent_id in rollout.drained:
            self._drain(agent_id, False)
        rollout.drained.clear()
        self._publish(rollout, "rolling_back")
        return rollout

    def _get(self, model: str, phases: tuple[Phase, ...]) -> Rollout:
        rollout = self.by_model.get(model)
        if rollout is None:
            raise RolloutNotFound(f"no rollout of model {model!r}")
        if rollout.phase not in phases:
            raise RolloutConflict(f"the rollout of {model!r} is {rollout.phase}")
        return rollout

    def step(self) -> None:
        """Drain old instances as new ones are ready; complete when the old ones are drained and idle."""
        for rollout in list(self.by_model.values()):
            if rollout.phase == "rolling":
                if self._move(rollout, rollout.from_revision, rollout.to_revision, rollout.drained):
                    rollout.phase = "complete"
                    self._complete(rollout.model, rollout.to_revision)
                    self._publish(rollout, "complete")
                    log.info("rollout of %s to %r complete", rollout.model, rollout.to_revision)
            elif rollout.phase == "rolling_back" and self._move(
                rollout, rollout.to_revision, rollout.from_revision, rollout.held
            ):
                rollout.phase = "rolled_back"
                self._complete(rollout.model, rollout.from_revision)
                self._publish(rollout, "rolled_back")
                log.info("rollout of %s rolled back to %r", rollout.model, rollout.from_revision)

    def _move(self, rollout: Rollout, source: str, target: str, drained: list[str]) -> bool:
        """Drain one ``source`` instance per ready ``target`` one, role by role (all of them once as
        many ``target`` instances are ready); True once every ``source`` instance is drained and idle."""
        snap = self._registry.snapshot()
        old, ready = [], []
        for v in snap.instances:
            if v.info.model == rollout.model and v.state != "dead":
                if v.info.revision == source:
                    old.append(v)
                elif v.info.revision == target and v.state == "ready":
                    ready.append(v)
        everyone = len(ready) >= len(old)
        for role in sorted({v.info.role for v in old}):
            mine = [v for v in old if v.info.role == role]
            gone = sum(v.admin_draining for v in mine)
            wanted = len(mine) if everyone else min(len(mine), sum(v.info.role == role for v in ready))
            idle_first = sorted(
                (v for v in mine if not v.admin_draining),
                key=lambda v: (snap.in_flight_of(v.agent_id), v.agent_id),
            )
            for v in idle_first[: max(0, wanted - gone)]:
                drained.append(v.agent_id)
                self._drain(v.agent_id, True)
                self._publish(rollout, "drained", instance=v.agent_id)
        return bool(ready) and all(v.admin_draining and snap.in_flight_of(v.agent_id) == 0 for v in old)

    def _drain(self, agent_id: str, draining: bool) -> None:
        if self._registry.get(agent_id) is None:
            return
        self._registry.set_admin_drain(agent_id, draining)  # routing follows at once
        task = asyncio.ensure_future(self._tell(agent_id, Drain() if draining else Undrain()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell(self, agent_id: str, command: Drain | Undrain) -> None:
        try:
            await self._command(agent_id, command)
        except Exception as exc:  # the registry's flag already routes around it; the agent hears later
            log.warning("rollout: telling %s to %s failed: %s", agent_id, command.KIND, exc)

    def _publish(self, rollout: Rollout, what: str, **fields: Any) -> None:
        self._events.publish(
            "rollout",
            model=rollout.model,
            what=what,
            phase=rollout.phase,
            **{"from": rollout.from_revision, "to": rollout.to_revision},
            **fields,
        )

    def describe(self) -> dict[str, Any]:
        """The admin API's view."""
        return {"rollouts": [r.to_json(self._registry) for r in self.by_model.values()]}

    async def run(self) -> None:
        """Step every ``STEP_S`` until cancelled."""
        while True:
            await asyncio.sleep(STEP_S)
            try:
                self.step()
            except Exception:
                log.exception("a rollout step failed")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
