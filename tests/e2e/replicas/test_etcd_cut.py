"""The leader cut from etcd by the network (issue 26), with Linux network namespaces: it steps down, a
new leader is elected, and no command of the old epoch is accepted after the new epoch's first.

Layout (``netns.py``): etcd and each of the three replicas run in a namespace of their own, all on one
bridge; the agents, their simulated engines and the load stay in the root namespace, which reaches the
namespaces through the bridge (engines listen on the root namespace's bridge address).

**What is cut**: the leader's namespace from etcd's, both ways, silently (frames vanish: no RST, no
ICMP). Nothing else: the old leader still reaches the agents, its peers and the engines, and clients
still reach it. So it could go on commanding agents if it did not step down in time: the agents'
command logs are the proof that it did not (``fencing_violations``), and the load shows that routing
on every replica, the cut one included, goes on (every request completes with the exact bytes).

A loop drains and undrains the spare instance through the old leader and a follower in turn, so both
the old leader (while it still thinks it leads) and the new one try to command agents throughout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.replicas.cluster import TTL_S, ReplicaCluster
from tests.e2e.replicas.commands import accepted, fencing_violations, first_accepted
from tests.e2e.replicas.load import SpreadLoad, Toggler, not_completed, tally
from tests.e2e.replicas.netns import Bridge, Member, netns_bridge
from tests.etcd_support import EtcdMissing
from tests.helpers import eventually

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")


async def test_a_leader_cut_from_etcd_steps_down_and_a_new_epoch_fences_the_old_one(tmp_path: Path) -> None:
    with netns_bridge() as bridge:
        etcd_ns = bridge.add("etcd")
        replica_ns = [bridge.add(f"r{i}") for i in range(3)]
        try:
            cluster = ReplicaCluster(
                tmp_path,
                etcd_place=etcd_ns.placement,
                replica_places=[m.placement for m in replica_ns],
                engine_host=bridge.host_addr,
            )
        except EtcdMissing as exc:
            pytest.fail(str(exc), pytrace=False)
        try:
            await cluster.start()
            await _cut_the_leader(cluster, bridge, etcd_ns, replica_ns)
        finally:
            cluster.close()


async def _cut_the_leader(
    cluster: ReplicaCluster, bridge: Bridge, etcd_ns: Member, replica_ns: list[Member]
) -> None:
    leader_id, epoch = await cluster.ready(cluster.replicas)
    old = cluster.by_id(leader_id)
    follower = next(r for r in cluster.replicas if r is not old)
    load = SpreadLoad([r.url for r in cluster.replicas], seed=5)
    toggler = Toggler([old, follower])
    load.start()
    toggler.start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        try:
            await eventually(
                lambda: (
                    sum(1 for r in accepted(cluster.command_logs()) if r.epoch == epoch) >= 2
                    and all(load.completed(r.index) >= 3 for r in cluster.replicas)
                ),
                timeout=30,
                what="load on every replica and commands in the first epoch",
            )
            cut_at = time.monotonic()
            bridge.cut(replica_ns[old.index], etcd_ns)
            await eventually(
                lambda: _stepped_down(cluster, http, leader_id),
                timeout=TTL_S + 5,
                what="the old leader to step down",
            )
            stepped_s = time.monotonic() - cut_at
            first = await eventually(
                lambda: first_accepted(cluster.command_logs(), newer_than=epoch),
                timeout=30,
                what="a command of a newer epoch",
            )
            await eventually(
                lambda: len(load.ended_since(first.mono + 1.0)) >= 10, timeout=30, what="load after"
            )
            bridge.heal(replica_ns[old.index], etcd_ns)
            new_leader, new_epoch = await cluster.ready(cluster.replicas, timeout_s=60)
        finally:
            sent = await load.stop()
            await toggler.stop()
    print(
        f"\nleader {leader_id} cut from etcd: stepped down {stepped_s:.2f} s after the cut; "
        f"epoch {epoch} -> {first.epoch} (first command {first.mono - cut_at:.2f} s after the cut); "
        f"after healing: {new_leader} leads in epoch {new_epoch}; requests {tally(sent)}"
    )
    assert new_leader != leader_id or new_epoch > epoch
    logs = cluster.command_logs()
    assert not fencing_violations(logs), fencing_violations(logs)
    old_epoch_after = [r for r in accepted(logs) if r.epoch == epoch and r.mono > first.mono]
    assert not old_epoch_after, old_epoch_after
    assert stepped_s <= TTL_S, f"the cut leader stepped down {stepped_s:.2f} s after the cut"
    assert not not_completed(sent), not_completed(sent)[:5]


async def _stepped_down(cluster: ReplicaCluster, http: aiohttp.ClientSession, replica_id: str) -> bool:
    seen = await cluster.view(http, cluster.by_id(replica_id))
    return seen["role"] == "follower" and await cluster.metric(http, cluster.by_id(replica_id), "leader") == 0
