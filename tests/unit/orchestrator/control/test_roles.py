"""The role changer on a fake clock: the registry's changes step a change at once, its timeouts run on
the clock the test moves, and what the steps decide reaches the agent, the registry, the events and the
answer. No sleep, no polling: a test says what happens and when."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.orchestrator.control.control_support import Inst, beat, registry_of
from vllm_disagg.clock import FakeClock
from vllm_disagg.errors import CommandTimeout, Conflict, RequestError, TimedOut
from vllm_disagg.orchestrator.control.roles import RoleChange, RoleChanger
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.commands import CommandPayload, SetRole
from vllm_disagg.protocol.messages import RESTART_REQUIRED, Ack, Role

YES = Ack(0, True)
RESTART = Ack(0, False, "launched kv_consumer", RESTART_REQUIRED)


@dataclass
class Agents:
    """The control plane and its agents: each ``set_role`` gets the next answer (an Ack or an error)."""

    answers: deque[Ack | RequestError] = field(default_factory=deque)
    asked: list[tuple[str, str, bool]] = field(default_factory=list)

    async def send_command(
        self, agent_id: str, payload: CommandPayload, timeout_s: float | None = None
    ) -> Ack:
        assert isinstance(payload, SetRole)
        self.asked.append((agent_id, payload.role, payload.restart))
        answer = self.answers.popleft()
        if isinstance(answer, RequestError):
            raise answer
        return answer


@dataclass
class Harness:
    clock: FakeClock
    registry: Registry
    agents: Agents
    roles: RoleChanger
    events: EventLog

    def start(self, role: Role = "prefill", agent_id: str = "d0") -> asyncio.Task[RoleChange]:
        return asyncio.ensure_future(self.roles.change(agent_id, role))

    def view(self, agent_id: str = "d0") -> Any:
        return self.registry.get(agent_id)

    def steps(self) -> list[tuple[str, dict[str, float]]]:
        return [
            (e.fields["step"], e.fields["timeline"]) for e in self.events.since(0) if e.kind == "role_restart"
        ]


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    clock = FakeClock(start=0.0)
    registry = registry_of(Inst("p0", "prefill"), Inst("d0"), Inst("d1"))
    agents = Agents()
    events = EventLog(clock.wall)
    metrics = OrchestratorMetrics(registry.snapshot)
    roles = RoleChanger(
        registry, agents, metrics, clock, events, drain_timeout_s=10.0, restart_timeout_s=60.0
    )
    yield Harness(clock, registry, agents, roles, events)


async def test_routing_moves_the_instance_at_once(h: Harness) -> None:
    h.agents.answers.append(YES)
    change = await h.start()
    assert (change.how, change.old, change.view.info.role) == ("routing", "decode", "prefill")
    assert h.agents.asked == [("d0", "prefill", False)]
    assert h.roles.last_change_at == 0.0 and h.steps() == []


async def test_a_restart_waits_for_the_requests_then_for_the_new_engine_and_says_when_each_ended(
    h: Harness,
) -> None:
    h.registry.acquire("d0")  # a stream under way
    h.agents.answers.extend([RESTART, YES])
    change = h.start()
    await h.clock.settle()
    assert h.view().state == "draining" and not change.done(), "the restart waits for the stream"

    await h.clock.run_for(2.0)
    h.registry.release("d0")  # the stream ends: the restart is asked at once, no poll later
    await h.clock.settle()
    assert h.agents.asked == [("d0", "prefill", False), ("d0", "prefill", True)]
    assert (h.view().info.role, h.view().engine_state) == ("prefill", "restarting")

    await h.clock.run_for(5.0)
    h.registry.heartbeat("d0", beat("ready"), h.clock.monotonic())  # the new engine is up
    result = await change
    assert (result.how, result.view.state, result.left_in_flight) == ("restart", "ready", 0)
    assert result.timeline == {"drained": 2.0, "restarting": 2.0, "ready": 7.0}
    assert h.steps() == [
        ("draining", {}),
        ("restarting", {"drained": 2.0, "restarting": 2.0}),
        ("ready", {"drained": 2.0, "restarting": 2.0, "ready": 7.0}),
    ]


async def test_a_drain_times_out_on_the_clock_and_the_requests_left_fail_over(h: Harness) -> None:
    h.registry.acquire("d0")
    h.agents.answers.extend([RESTART, YES])
    change = h.start()
    await h.clock.run_for(9.9)
    assert len(h.agents.asked) == 1, "still draining"
    await h.clock.run_for(0.1)
    assert len(h.agents.asked) == 2, "the drain's timeout passed: the restart goes on"
    h.registry.heartbeat("d0", beat("ready"), h.clock.monotonic())
    result = await change
    assert result.left_in_flight == 1


async def test_an_engine_not_ready_in_time_times_out_and_the_instance_is_undrained(h: Harness) -> None:
    h.agents.answers.extend([RESTART, YES])
    change = h.start()
    await h.clock.run_for(59.0)
    assert not change.done()
    await h.clock.run_for(1.0)
    with pytest.raises(TimedOut, match="not ready within 60 s"):
        await change
    assert not h.view().admin_draining
    assert [s for s, _ in h.steps()] == ["draining", "restarting", "failed"]


async def test_the_agents_refusal_is_a_conflict_and_its_lost_command_the_control_planes_error(
    h: Harness,
) -> None:
    h.agents.answers.extend([Ack(0, False, "attached engines keep their role", "unsupported")])
    with pytest.raises(Conflict, match="cannot serve as prefill: attached engines keep their role"):
        await h.start()
    h.agents.answers.extend([RESTART, CommandTimeout("instance 'd0' did not acknowledge set_role")])
    with pytest.raises(CommandTimeout):
        await h.start()
    assert not h.view().admin_draining, "the drain is put back"
    assert h.roles.last_change_at is None, "nothing changed"


async def test_a_second_change_while_one_is_under_way_is_refused(h: Harness) -> None:
    h.registry.acquire("d0")
    h.agents.answers.extend([RESTART])
    first = h.start()
    await h.clock.settle()
    with pytest.raises(Conflict, match="under way"):
        await h.start("both")
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)


async def test_a_change_cancelled_midway_puts_the_drain_back(h: Harness) -> None:
    h.registry.acquire("d0")
    h.agents.answers.extend([RESTART])
    change = h.start()
    await h.clock.settle()
    assert h.view().admin_draining
    change.cancel()
    await asyncio.gather(change, return_exceptions=True)
    assert not h.view().admin_draining
    assert h.registry.watchers == (0, 0), "it stopped watching the registry"


async def test_an_instance_that_dies_while_restarting_fails_the_change_at_once(h: Harness) -> None:
    h.agents.answers.extend([RESTART, YES])
    change = h.start()
    await h.clock.settle()
    h.registry.goodbye("d0", "killed")
    with pytest.raises(Conflict, match="d0 is gone during its role change"):
        await change
    assert h.clock.monotonic() == 0.0, "no timer had to run out"
