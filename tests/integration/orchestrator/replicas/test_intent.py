"""Operators' intent lives in etcd: every replica applies it, a new leader starts from it, a stale
leader cannot write it, and nothing is acted on that etcd did not record."""

from __future__ import annotations

import time

import aiohttp
import pytest

from tests.etcd_support import EtcdServer
from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator.replicas.support import Replicas, join_everywhere, one_leader
from tests.integration.orchestrator_support import FakeAgent, orch_config, registered
from vllm_disagg.config import AdmissionConfig, ReplicaConfig
from vllm_disagg.errors import NotLeader
from vllm_disagg.orchestrator.app import (
    CONTROL_KEY,
    GATEWAY_KEY,
    PLANNER_KEY,
    REPLICATION_KEY,
    OrchestratorServer,
    start_orchestrator,
)
from vllm_disagg.orchestrator.planner.decide import Memory
from vllm_disagg.orchestrator.replicas.forward import LEADER
from vllm_disagg.orchestrator.state.intent import InstanceIntent
from vllm_disagg.orchestrator.state.leadership import Leadership, LeaderView
from vllm_disagg.orchestrator.state.views import InstanceView


def new_session(server: OrchestratorServer, agent_id: str) -> InstanceView | None:
    """``agent_id``'s second session once it is past joining (None before)."""
    view = registered(server, agent_id)
    return view if view.session == 2 and view.state != "joining" else None


def intent(server: OrchestratorServer, agent_id: str) -> InstanceIntent:
    return server.registry.intent_of(agent_id)


async def test_a_drain_and_a_cordon_reach_every_replica_and_outlive_the_leader_and_the_agent(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(3)
    leader = await one_leader(servers)
    follower = next(s for s in servers if s is not leader)
    agents = await join_everywhere(servers, "d0", "http://127.0.0.1:9")
    others = await join_everywhere(servers, "d1", "http://127.0.0.1:10")
    for path in ("d0/drain", "d1/cordon"):
        async with http.post(f"{follower.url}/admin/v1/instances/{path}", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()

    def everywhere() -> bool:  # followers apply what etcd holds; they do not wait for d0's heartbeats
        return all(registered(s, "d1").state == "cordoned" and intent(s, "d0").drained for s in servers)

    await eventually(everywhere, what="d0 drained and d1 cordoned on every replica")
    await leader.close()  # the leader leaves; d0's agent restarts too
    servers.remove(leader)
    new_leader = await one_leader(servers)
    for agent in agents:
        await agent.close()
    restarted = FakeAgent(new_leader.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode")
    await restarted.join()
    view = await eventually(lambda: new_session(new_leader, "d0"), what="d0 back")
    assert view.state == "draining" and registered(new_leader, "d1").state == "cordoned"
    epoch = new_leader.app[CONTROL_KEY].leadership.epoch
    await eventually(
        lambda: [(c.kind, c.epoch) for c in restarted.commands] == [("drain", epoch)], what="told"
    )
    for agent in [restarted, *others]:
        await agent.close()


async def test_weights_set_through_a_follower_are_every_replicas(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(2)
    leader = await one_leader(servers)
    follower = next(s for s in servers if s is not leader)
    async with http.get(f"{follower.url}/admin/v1/scheduler/weights", headers=ADMIN) as resp:
        weights = (await resp.json())["weights"]
    profile = sorted(weights)[0]
    scorer = sorted(weights[profile])[0]
    new = weights[profile][scorer] + 2.5
    body = {"weights": {profile: {scorer: new}}}
    async with http.put(f"{follower.url}/admin/v1/scheduler/weights", json=body, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
    for server in servers:

        async def weight(s: OrchestratorServer = server) -> bool:
            async with http.get(f"{s.url}/admin/v1/scheduler/weights", headers=ADMIN) as r:
                return bool((await r.json())["weights"][profile][scorer] == new)

        await eventually(weight, what="the new weight everywhere")


async def test_tenants_weights_set_through_a_follower_are_every_replicas_and_a_new_one_takes_them(
    replicas: Replicas, etcd: EtcdServer, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(2, admission=AdmissionConfig(tenant_weights=(("gold", 3.0),)))
    leader = await one_leader(servers)
    follower = next(s for s in servers if s is not leader)
    base = f"{follower.url}/admin/v1/admission/tenants"
    async with http.put(f"{base}/silver", json={"weight": 2}, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers[LEADER] == leader.replica_id, "the follower handed the write to the leader"
    async with http.delete(f"{base}/gold", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()

    def weighed(where: list[OrchestratorServer]) -> bool:
        admitting = [s.app[GATEWAY_KEY].admission for s in where]
        return all(a is not None and a.tenant_weights() == {"silver": 2.0} for a in admitting)

    await eventually(lambda: weighed(servers), what="silver=2 and gold back to 1 on every replica")
    admission = follower.app[GATEWAY_KEY].admission
    assert admission is not None and admission.queue.weight("gold") == 1.0, "the follower's queue follows"
    # A replica that starts later takes etcd's weights over its own flags.
    replica = ReplicaConfig(etcd=(etcd.url,), cluster="test", replica_id="late", lease_ttl_s=2)
    config = orch_config(replica=replica, admission=AdmissionConfig(tenant_weights=(("gold", 3.0),)))
    late = await start_orchestrator(config, shutdown_timeout_s=1.0)
    try:
        await eventually(lambda: weighed([late]), what="the new replica adopted etcd's weights")
    finally:
        await late.close()


async def test_a_stale_leader_cannot_record_and_nothing_is_done_while_etcd_is_down(
    replicas: Replicas, etcd: EtcdServer, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(1)
    leader = await one_leader(servers)
    (agent,) = await join_everywhere(servers, "d0", "http://127.0.0.1:9")
    durable = leader.app[REPLICATION_KEY].intent
    old_epoch = leader.app[CONTROL_KEY].leadership.epoch
    # A replica that believes it still leads in an epoch etcd has moved past: its write is refused.
    stale = Leadership("ghost", LeaderView(True, old_epoch - 1, "ghost", 0.0, etcd_ok=True))
    durable._leadership = stale
    with pytest.raises(NotLeader, match=f"epoch {old_epoch - 1} is over"):
        await durable.save_instance("d0", InstanceIntent(drained=True))
    durable._leadership = leader.app[CONTROL_KEY].leadership
    etcd.pause()  # etcd stops answering: leader actions wait, and say why
    try:
        async with http.post(f"{leader.url}/admin/v1/instances/d0/cordon", headers=ADMIN) as resp:
            assert resp.status == 503
            reason = (await resp.json())["error"]["message"]
        assert "etcd" in reason
        assert registered(leader, "d0").state == "ready", "what etcd did not record was not done"
    finally:
        etcd.resume()

    async def cordoned() -> bool:
        async with http.post(f"{leader.url}/admin/v1/instances/d0/cordon", headers=ADMIN) as resp:
            return resp.status == 200

    await eventually(cordoned, what="leader actions back with etcd")
    assert registered(leader, "d0").state == "cordoned"
    await agent.close()


async def test_the_planners_memory_is_kept_in_etcd_and_the_next_leader_goes_on_with_it(
    replicas: Replicas,
) -> None:
    servers = await replicas(2)
    leader = await one_leader(servers)
    follower = next(s for s in servers if s is not leader)
    planner = leader.app[PLANNER_KEY]
    shifted_at = time.monotonic() - 42.0  # a shift 42 s ago: its cooldown must not start over
    planner.memory = Memory("decode", 2, shifted_at, (None, None))
    planner.look()
    kept = planner.memory
    assert kept.last_shift_at == shifted_at

    def adopted() -> Memory | None:
        memory = follower.app[PLANNER_KEY].memory
        return memory if memory.last_shift_at is not None else None

    memory = await eventually(adopted, what="the follower has the leader's memory")
    assert (memory.short, memory.streak) == (kept.short, kept.streak)
    assert memory.last_shift_at == pytest.approx(shifted_at, abs=0.05), "the same instant, on its clock"
