"""Rolling model upgrades in the orchestrator: the operator's actions and the registry's changes drive
the pure steps of ``rollout_steps`` (which says what a rollout does), and this carries out what they
decide.

``vllm-disagg rollout --to REVISION`` (``POST /admin/v1/rollouts``) starts one for a model. Until then a
Hello of another revision of a served model is refused (``model_mismatch``): a revision joins only
when an operator says so. During it, instances of the new revision are admitted (each revision with its
own engine, tokenizer and block size); pairs never mix revisions (``kv-compat-filter``), so a request
runs on an old pair or on a new one, never across.

A moving rollout (rolling or rolling back) watches the registry, in-flight counts included, and steps
as soon as anything it decides on changes: a new instance ready, an old one idle. Nothing polls, and
no step waits on a timer. Each step is a ``rollout`` event (admin API, dashboard).

With replicas only the leader steps, and it records each step before it acts (``record``: the new
state and the step's drains, in one etcd transaction fenced by its term). Every replica adopts what
etcd holds (``adopt``): its control plane admits both revisions' Hellos while a rollout is under way,
and a new leader goes on from the recorded state: a step is never lost (it was recorded before it was
acted on) nor repeated (the next step starts from the recorded one, and its drains are in every
replica's registry).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_disagg.clock import Clock
from vllm_disagg.errors import RolloutNotFound
from vllm_disagg.orchestrator.control import rollout_steps as steps
from vllm_disagg.orchestrator.control.rollout_steps import (
    MOVING,
    UNDER_WAY,
    Admit,
    Drain,
    Effect,
    Publish,
    RolloutState,
    Settle,
)
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.intent import IntentRecorder
from vllm_disagg.orchestrator.state.registry import Registry, Unwatch
from vllm_disagg.protocol.commands import CommandPayload
from vllm_disagg.protocol.commands import Drain as DrainCommand
from vllm_disagg.protocol.commands import Undrain as UndrainCommand

log = logging.getLogger(__name__)


class Rollouts:
    """Every model's rollout; ``run()`` steps the moving ones whenever the registry changes."""

    def __init__(
        self,
        registry: Registry,
        admit: Callable[[str, str, str], None],
        complete: Callable[[str, str], None],
        command: Callable[[str, CommandPayload], Awaitable[object]],
        events: EventLog,
        clock: Clock,
        *,
        record: IntentRecorder | None = None,
        leads: Callable[[], bool] = lambda: True,
    ) -> None:
        self._record = record  # replicas: where a step is recorded before it is acted on
        self._leads = leads  # replicas: only the leader steps
        self._registry = registry
        self._admit = admit  # (model, old revision, new revision): Hellos of both are accepted
        self._complete = complete  # (model, new revision): new Hellos are checked against it
        self._command = command  # (agent id, Drain() | Undrain()): tell the agent (best effort)
        self._events = events
        self._clock = clock
        self.by_model: dict[str, RolloutState] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        # Set by the registry while a rollout moves; ``run`` steps once per wake, however many changes.
        self._changed = asyncio.Event()
        self._unwatch: Unwatch | None = None

    async def start(self, model: str | None, to_revision: str) -> RolloutState:
        """Begin rolling ``model`` (the only one served, when None) to ``to_revision``."""
        step = steps.begin(self._registry.snapshot(), model, to_revision, self.by_model, self._clock.wall())
        state = await self._act(step)
        log.info("rollout of %s: %r -> %r started", state.model, state.from_revision, state.to_revision)
        return state

    async def pause(self, model: str) -> RolloutState:
        """Stop draining where it is (both revisions serve) until ``resume``."""
        return await self._act(steps.pause(self._get(model)))

    async def resume(self, model: str) -> RolloutState:
        """Go on with a paused rollout."""
        return await self._act(steps.resume(self._get(model)))

    async def rollback(self, model: str) -> RolloutState:
        """Undrain the old instances this rollout drained; the new revision's drain as they are ready."""
        return await self._act(steps.rollback(self._get(model), self._registry.snapshot()))

    def _get(self, model: str) -> RolloutState:
        rollout = self.by_model.get(model)
        if rollout is None:
            raise RolloutNotFound(f"no rollout of model {model!r}")
        return rollout

    async def step(self) -> None:
        """Move every moving rollout on by what the registry says now (the leader's alone)."""
        if not self._leads():
            return
        snap = self._registry.snapshot()
        for state in list(self.by_model.values()):
            if state.phase in MOVING:
                step = steps.step(state, snap)
                if step.state != state or step.effects:
                    await self._apply(step)

    async def _act(self, step: steps.Step) -> RolloutState:
        """An operator's action: applied, and a moving rollout's next step due now (not at the next
        change: the new instances may all be ready already)."""
        state = await self._apply(step)
        if state.phase in MOVING:
            self._changed.set()
        return state

    async def _apply(self, step: steps.Step) -> RolloutState:
        """Record the step (replicas), keep its state, carry out its effects in order, and watch the
        registry while a rollout moves."""
        if self._record is not None:
            intents = {
                e.agent_id: dataclasses.replace(self._registry.intent_of(e.agent_id), drained=e.draining)
                for e in step.effects
                if isinstance(e, Drain)
            }
            await self._record.save_rollout(step.state.model, step.state.record(), intents)
        self.by_model[step.state.model] = step.state
        for effect in step.effects:
            self._do(step.state, effect)
        self._watch_while_moving()
        return step.state

    def _watch_while_moving(self) -> None:
        moving = any(r.phase in MOVING for r in self.by_model.values())
        if moving and self._unwatch is None:
            self._unwatch = self._registry.watch(self._changed.set, in_flight=True)
        elif not moving and self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def wake(self) -> None:
        """Step now (this replica has just begun to lead: a moving rollout goes on from here)."""
        self._changed.set()

    def adopt(self, model: str, record: Any) -> None:
        """A rollout as etcd holds it (None: gone), recorded by the leader before it acted: kept, and
        what it means for Hellos applied here too; a new leader steps on from it."""
        if record is None:
            self.by_model.pop(model, None)
            self._watch_while_moving()
            return
        state = RolloutState.from_record(record)
        if self.by_model.get(model) == state:
            return
        self.by_model[model] = state
        if state.phase in UNDER_WAY:
            self._admit(model, state.from_revision, state.to_revision)
        elif state.phase in ("complete", "rolled_back"):
            self._complete(model, state.to_revision if state.phase == "complete" else state.from_revision)
        self._watch_while_moving()
        self._changed.set()

    def _do(self, state: RolloutState, effect: Effect) -> None:
        if isinstance(effect, Admit):
            self._admit(effect.model, effect.old, effect.new)
        elif isinstance(effect, Drain):
            self._drain(effect.agent_id, effect.draining)
        elif isinstance(effect, Settle):
            self._complete(effect.model, effect.revision)
        elif isinstance(effect, Publish):
            self._publish(state, effect)

    def _drain(self, agent_id: str, draining: bool) -> None:
        if self._registry.get(agent_id) is None:
            return
        self._registry.set_admin_drain(agent_id, draining)  # routing follows at once
        command = DrainCommand() if draining else UndrainCommand()
        task = asyncio.ensure_future(self._tell(agent_id, command))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell(self, agent_id: str, command: DrainCommand | UndrainCommand) -> None:
        try:
            await self._command(agent_id, command)
        except Exception as exc:  # the registry's flag already routes around it; the agent hears later
            log.warning("rollout: telling %s to %s failed: %s", agent_id, command.KIND, exc)

    def _publish(self, state: RolloutState, effect: Publish) -> None:
        fields: dict[str, Any] = {"instance": effect.instance} if effect.instance is not None else {}
        self._events.publish(
            "rollout",
            model=state.model,
            what=effect.what,
            phase=effect.phase,
            **{"from": state.from_revision, "to": state.to_revision},
            **fields,
        )
        if effect.what == "complete":
            log.info("rollout of %s to %r complete", state.model, state.to_revision)
        elif effect.what == "rolled_back":
            log.info("rollout of %s rolled back to %r", state.model, state.from_revision)

    def describe(self) -> dict[str, Any]:
        """The admin API's view."""
        snap = self._registry.snapshot()
        return {"rollouts": [r.to_json(snap) for r in self.by_model.values()]}

    async def run(self) -> None:
        """Step whenever the registry changes while a rollout moves, until cancelled."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                await self.step()
            except Exception:  # e.g. etcd unreachable: the next change steps again
                log.exception("a rollout step failed")

    async def close(self) -> None:
        """Stop watching the registry and the commands still on their way."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
