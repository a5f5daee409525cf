"""The rollouts' adapter: the registry's changes step a moving rollout at once (nothing polls, no timer
runs), and what the steps decide reaches the registry, the agents, the control plane and the events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import pytest

from tests.unit.orchestrator.control.control_support import Inst, add, beat, registry_of
from vllm_disagg.clock import FakeClock
from vllm_disagg.orchestrator.control.rollout import Rollouts
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.commands import CommandPayload

OLD_P, OLD_D = Inst("p-r1", "prefill"), Inst("d-r1", "decode")
NEW_P, NEW_D = Inst("p-r2", "prefill", "r2"), Inst("d-r2", "decode", "r2")


@dataclass
class Harness:
    registry: Registry
    rollouts: Rollouts
    events: EventLog
    told: list[tuple[str, str]] = field(default_factory=list)  # (agent id, command kind)
    settled: list[tuple[str, str]] = field(default_factory=list)
    admitted: list[tuple[str, str, str]] = field(default_factory=list)
    unreachable: bool = False  # the agents' commands fail

    def rollout_events(self) -> list[str]:
        return [
            e.fields["what"] + (f" {e.fields['instance']}" if "instance" in e.fields else "")
            for e in self.events.since(0)
            if e.kind == "rollout"
        ]

    def phase(self) -> str:
        return self.rollouts.by_model["m"].phase

    def draining(self, agent_id: str) -> bool:
        view = self.registry.get(agent_id)
        return view is not None and view.admin_draining


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    clock = FakeClock()
    registry = registry_of(OLD_P, OLD_D)
    events = EventLog(clock.wall)
    harness: Harness

    async def command(agent_id: str, payload: CommandPayload) -> object:
        if harness.unreachable:
            raise ConnectionError(f"{agent_id} is not connected")
        harness.told.append((agent_id, payload.KIND))
        return None

    rollouts = Rollouts(
        registry,
        lambda m, old, new: harness.admitted.append((m, old, new)),
        lambda m, revision: harness.settled.append((m, revision)),
        command,
        events,
        clock,
    )
    harness = Harness(registry, rollouts, events)
    task = asyncio.ensure_future(rollouts.run())
    yield harness
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await rollouts.close()


async def test_the_old_revision_drains_as_the_new_one_is_ready_and_completes_once_idle(h: Harness) -> None:
    h.registry.acquire("d-r1")  # a request under way on the old decode instance
    await h.rollouts.start(None, "r2")
    assert h.admitted == [("m", "r1", "r2")]
    add(h.registry, replace(NEW_D, engine="starting"))
    await FakeClock.settle()
    assert not h.draining("d-r1"), "a new instance still starting drains nothing"

    h.registry.heartbeat("d-r2", beat("ready"), 0.0)  # ready: the change steps the rollout at once
    await FakeClock.settle()
    assert h.draining("d-r1") and not h.draining("p-r1"), "one old instance per new one, role by role"
    assert h.told == [("d-r1", "drain")]

    add(h.registry, NEW_P)
    await FakeClock.settle()
    assert h.draining("p-r1")
    assert h.phase() == "rolling", "the old decode instance is still busy"

    h.registry.release("d-r1")  # its last request ends: an in-flight change steps it too
    await FakeClock.settle()
    assert h.phase() == "complete"
    assert h.settled == [("m", "r2")]
    assert h.rollout_events() == ["started", "drained d-r1", "drained p-r1", "complete"]


async def test_a_paused_rollout_ignores_changes_and_a_resume_steps_at_once(h: Harness) -> None:
    await h.rollouts.start("m", "r2")
    await h.rollouts.pause("m")
    add(h.registry, NEW_D)
    await FakeClock.settle()
    assert not h.draining("d-r1")
    await h.rollouts.resume("m")  # no registry change follows: the resume itself is a reason to step
    await FakeClock.settle()
    assert h.draining("d-r1")


async def test_a_rollback_of_a_complete_rollout_undrains_at_once_and_drains_the_new_revision_out(
    h: Harness,
) -> None:
    await h.rollouts.start("m", "r2")
    add(h.registry, NEW_D)
    add(h.registry, NEW_P)
    await FakeClock.settle()
    assert h.draining("d-r1") and h.draining("p-r1")
    assert h.phase() == "complete" and h.settled == [("m", "r2")]
    await h.rollouts.rollback("m")
    assert not h.draining("d-r1") and not h.draining("p-r1"), "undrained by the action itself"
    await FakeClock.settle()
    assert h.phase() == "rolled_back"
    assert (h.draining("d-r2"), h.draining("p-r2")) == (True, True)
    assert h.settled == [("m", "r2"), ("m", "r1")]
    assert ("d-r1", "undrain") in h.told and ("d-r2", "drain") in h.told


async def test_a_finished_rollout_stops_watching_the_registry(h: Harness) -> None:
    assert h.registry.watchers == (0, 0)
    await h.rollouts.start("m", "r2")
    assert h.registry.watchers == (0, 1), "a moving rollout watches every request sent and ended"
    await h.rollouts.pause("m")
    assert h.registry.watchers == (0, 0), "a paused one nothing: the gateway's requests pay nothing then"


async def test_an_agent_that_cannot_be_told_is_drained_by_the_registry_alone(h: Harness) -> None:
    h.unreachable = True
    await h.rollouts.start("m", "r2")
    add(h.registry, NEW_D)
    await FakeClock.settle()
    assert h.draining("d-r1")
