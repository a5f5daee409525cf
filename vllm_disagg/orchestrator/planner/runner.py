"""The planner at work: a look every ``interval_s``, the decision carried out (or only explained, in
dry-run) through the same role change as an operator's, and published.

Each look reads both pools (``signals.pool_signals``), decides (``decide.plan``) and sets the
``vllm_disagg_planner_*`` metrics. A shift is an event (``planner_shift`` on the admin API's event
stream and the dashboard, with its reason and figures) and goes through ``RoleChanger``: the agent
says yes, the instance serves the other role from the next request on, its requests in flight finish
where they are (no request fails for a shift). An operator's role change counts for the cooldown,
and pins the instance (``vllm-disagg role ID auto`` lifts the pin). One shift at a time: a look
while one is under way decides nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_disagg.clock import Clock
from vllm_disagg.errors import RequestError
from vllm_disagg.orchestrator.control.roles import RoleChanger
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.planner.config import PlannerConfig
from vllm_disagg.orchestrator.planner.decide import (
    Memory,
    Plan,
    memory_from_record,
    memory_record,
    pressure,
    remember_change,
)
from vllm_disagg.orchestrator.planner.decide import plan as decide
from vllm_disagg.orchestrator.planner.signals import SloWindow, pool_signals
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.registry import Registry

log = logging.getLogger(__name__)
_HISTORY = 50  # shifts kept for the admin API


class PlannerRunner:
    """Owns the planner's memory; ``look()`` is one step (tests call it directly)."""

    def __init__(
        self,
        config: PlannerConfig,
        registry: Registry,
        window: SloWindow,
        roles: RoleChanger,
        metrics: OrchestratorMetrics,
        events: EventLog,
        clock: Clock,
        *,
        leads: Callable[[], bool] = lambda: True,
        record: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        # Replicas: where the leader keeps its memory and config (etcd), so the next leader goes on
        # with its cooldown and streaks instead of starting over.
        self._record = record
        self._recorded: dict[str, Any] | None = None
        self._saving: asyncio.Task[None] | None = None
        # Only the leader of replicas plans (its shifts command agents); a follower's looks are skipped.
        self._leads = leads
        self._registry = registry
        self._window = window
        self._roles = roles
        self._metrics = metrics
        self._events = events
        self._clock = clock
        self.memory = Memory()
        self.last: Plan | None = None
        self.last_at: float | None = None  # wall time of the last look
        self.shifts: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self._shifting: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Look every ``interval_s`` until cancelled."""
        while True:
            await self._clock.sleep(self.config.interval_s)
            if not self._leads():
                continue
            try:
                self.look()
            except Exception:  # a bug in a look must not stop the next one
                log.exception("the planner's look failed")

    def look(self) -> Plan:
        """Read the pools, decide, publish; start the shift unless in dry-run."""
        config, now = self.config, self._clock.monotonic()
        prefill, decode = pool_signals(self._registry.snapshot(), self._window)
        memory = remember_change(self.memory, self._roles.last_change_at)
        if self._shifting is not None and not self._shifting.done():
            result = Plan(None, "a shift is under way", {}, (prefill.size, decode.size), memory)
        else:
            result = decide(prefill, decode, memory, config, now)
        self.memory, self.last, self.last_at = result.memory, result, self._clock.wall()
        pressures = (
            pressure(prefill, config.ttft_target_s, config.min_samples),
            pressure(decode, config.tpot_target_s, config.min_samples),
        )
        self._metrics.planner_looked(result.ratio, pressures)
        self._save()
        if result.shift is not None:
            self._start(result)
        return result

    def _save(self) -> None:
        """Record the memory and config (replicas), in the background; a failure waits for the next look."""
        if self._record is None or (self._saving is not None and not self._saving.done()):
            return
        record = {
            "memory": memory_record(self.memory, self._clock.monotonic(), self._clock.wall()),
            "config": self.config.to_json(),
        }
        if record == self._recorded:
            return

        async def save() -> None:
            assert self._record is not None
            try:
                await self._record(record)
                self._recorded = record
            except RequestError as exc:
                log.warning("planner: its memory was not recorded: %s", exc.message)

        self._saving = asyncio.ensure_future(save())

    def adopt(self, record: Any) -> None:
        """The planner's memory as the leader recorded it: a follower keeps it, to go on from it if it
        comes to lead (its config stays its own flags', the same on every replica as a rule)."""
        if self._leads() or not isinstance(record, dict):
            return
        try:
            self.memory = memory_from_record(record["memory"], self._clock.monotonic(), self._clock.wall())
        except (KeyError, TypeError, ValueError) as exc:
            log.error("ignoring a recorded planner memory that cannot be read: %s", exc)
            return
        self._recorded = record

    def _start(self, result: Plan) -> None:
        shift = result.shift
        assert shift is not None
        record: dict[str, Any] = {
            "decided_at": self._clock.wall(),
            "instance": shift.agent_id,
            "from": shift.from_role,
            "to": shift.to_role,
            "reason": result.reason,
            "figures": result.figures,
            "dry_run": self.config.dry_run,
            "outcome": "dry_run" if self.config.dry_run else "started",
            "timeline": {"decided": 0.0},
        }
        self.shifts.append(record)
        log.info("planner%s: %s", " (dry run)" if self.config.dry_run else "", result.reason)
        if self.config.dry_run:
            self._metrics.planner_shift(shift.from_role, shift.to_role, "dry_run")
            self._events.publish("planner_shift", **record)
            return
        self._shifting = asyncio.ensure_future(self._shift(record))

    async def _shift(self, record: dict[str, Any]) -> None:
        started = self._clock.monotonic()
        try:
            change = await self._roles.change(record["instance"], record["to"])
        except RequestError as exc:  # the role change did not happen (``RoleChanger.change``)
            record["outcome"], record["error"] = "failed", exc.message
            log.warning("planner: moving %s to %s failed: %s", record["instance"], record["to"], exc.message)
        else:
            record["outcome"], record["how"] = "done", change.how
            record["timeline"].update(change.timeline)
        record["timeline"]["ended"] = round(self._clock.monotonic() - started, 6)
        self._metrics.planner_shift(record["from"], record["to"], record["outcome"])
        self._events.publish("planner_shift", **record)

    def describe(self) -> dict[str, Any]:
        """The admin API's view: the config, the last look, the shifts, the pinned instances."""
        last = self.last
        snapshot = self._registry.snapshot()
        return {
            "config": self.config.to_json(),
            "last_look": None
            if last is None
            else {
                "at": self.last_at,
                "reason": last.reason,
                "shift": None
                if last.shift is None
                else {
                    "instance": last.shift.agent_id,
                    "from": last.shift.from_role,
                    "to": last.shift.to_role,
                },
                "figures": last.figures,
                "suggested": {"prefill": last.ratio[0], "decode": last.ratio[1]},
                "streak": {"pool": self.memory.short, "looks": self.memory.streak},
            },
            "shifts": list(self.shifts),
            "pinned": sorted(v.agent_id for v in snapshot.instances if v.role_pinned),
        }

    async def close(self) -> None:
        """Stop a shift under way (a restart's drain is undone as it stops) and a recording."""
        if self._saving is not None:
            self._saving.cancel()
            await asyncio.gather(self._saving, return_exceptions=True)
        if self._shifting is not None:
            self._shifting.cancel()
            await asyncio.gather(self._shifting, return_exceptions=True)
