"""A rollout on replicas: started through any replica, admitted by every one, stepped by the leader
alone, and gone on with by the next leader from the step the last one recorded: none lost, none
repeated."""

from __future__ import annotations

import aiohttp

from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator.replicas.support import Replicas, join_everywhere, one_leader
from tests.integration.orchestrator_support import registered
from vllm_disagg.orchestrator.app import CONTROL_KEY, GATEWAY_KEY, ROLLOUTS_KEY, OrchestratorServer


def phase_and_drained(server: OrchestratorServer) -> tuple[str, tuple[str, ...]] | None:
    state = server.app[ROLLOUTS_KEY].by_model.get("sim-model")
    return (state.phase, state.drained) if state is not None else None


async def test_a_new_leader_goes_on_with_a_half_done_rollout_and_drains_each_instance_once(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(3)
    first = await one_leader(servers)
    follower = next(s for s in servers if s is not first)
    old_a = await join_everywhere(servers, "d-r1a", "http://127.0.0.1:9", "r1")
    old_b = await join_everywhere(servers, "d-r1b", "http://127.0.0.1:10", "r1")
    async with http.post(f"{follower.url}/admin/v1/rollouts", json={"to": "r2"}, headers=ADMIN) as resp:
        assert resp.status == 201, await resp.text()
    # Every replica adopted it, so each admits the new revision's Hello.
    new_a = await join_everywhere(servers, "d-r2a", "http://127.0.0.1:11", "r2")
    await eventually(
        lambda: (
            all(phase_and_drained(s) == ("rolling", ("d-r1a",)) for s in servers)
            or [phase_and_drained(s) for s in servers] == [("rolling", ("d-r1b",))] * 3
        ),
        what="one old instance drained for the new one, on every replica",
    )
    (drained_first,) = phase_and_drained(servers[0])[1]  # type: ignore[index]
    assert all(registered(s, drained_first).admin_draining for s in servers)
    first_epoch = first.app[CONTROL_KEY].leadership.epoch
    await first.close()  # the leader leaves half way
    servers.remove(first)
    second = await one_leader(servers)
    new_b = await join_everywhere(servers, "d-r2b", "http://127.0.0.1:12", "r2")
    await eventually(
        lambda: (
            all(phase_and_drained(s) == ("complete", ("d-r1a", "d-r1b")) for s in servers)
            or all(phase_and_drained(s) == ("complete", ("d-r1b", "d-r1a")) for s in servers)
        ),
        what="the rollout complete on every replica",
    )
    second_epoch = second.app[CONTROL_KEY].leadership.epoch
    told = {
        agent_id: [(c.kind, c.epoch) for a in agents for c in a.commands]
        for agent_id, agents in (("d-r1a", old_a), ("d-r1b", old_b))
    }
    other = "d-r1b" if drained_first == "d-r1a" else "d-r1a"
    assert told[other] == [("drain", second_epoch)], "the step the old leader never took, taken once"
    # The first one's step was taken once, by the old leader. The new one may tell it again when it
    # takes over (its heartbeats had not yet said it knew): the same drain, not a step taken again.
    assert told[drained_first] in (
        [("drain", first_epoch)],
        [("drain", first_epoch), ("drain", second_epoch)],
    )
    drained_events = [
        e.fields["instance"]
        for s in [*servers, first]
        for e in s.app[GATEWAY_KEY].events.since(0)
        if e.kind == "rollout" and e.fields.get("what") == "drained"
    ]
    assert sorted(drained_events) == ["d-r1a", "d-r1b"], "each drain step was published once, cluster-wide"
    for agent in [*old_a, *old_b, *new_a, *new_b]:
        await agent.close()
