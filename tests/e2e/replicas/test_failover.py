"""A replica SIGKILLed under streaming load spread over three replicas (issue 26): every process real,
etcd real, engines simulated (``cluster.py``).

Definitions these tests hold the product to:

- **requests on the surviving replicas 0 failed**: the load spreads streams over the three replicas'
  ports as a load balancer does (a refused connection goes to the next replica and is no failure);
  right before the kill the victim leaves the rotation, as a load balancer's health check would have
  it, so the only requests that may fail are those in flight on the victim's own connections when it
  died. Every other request, before and after the kill, must complete with exactly the bytes the
  simulated engine must have sent.
- **a new leader acts**: the first command of a newer epoch that an agent accepted, as its
  ``--command-log`` shows it. A loop drains and undrains the spare instance (``spare-0``, which serves
  a model the load never asks for) through a surviving replica, so a leader has something to command
  at every moment; the failover time runs from the monotonic clock read right before ``os.kill`` to
  that command's ``mono`` (one host: the agents' monotonic clocks are the test's).
- **two leaders never act at once**: ``fencing_violations`` over every agent's command log (epochs
  never go down per agent; across agents nothing of an older epoch after a newer epoch's first).
"""

from __future__ import annotations

import signal
import time

import aiohttp

from tests.e2e.replicas.cluster import TTL_S, ReplicaCluster
from tests.e2e.replicas.commands import accepted, fencing_violations, first_accepted
from tests.e2e.replicas.load import SpreadLoad, Toggler, killed_in_flight, not_completed, tally
from tests.helpers import eventually

FAILOVER_BOUND_S = TTL_S + 1.0  # the bound: the lease's TTL plus one second


async def _warm(cluster: ReplicaCluster, load: SpreadLoad, epoch: int) -> None:
    """Until every replica has completed requests and the leader has commanded the spare."""

    def warm() -> bool:
        commanded = sum(1 for r in accepted(cluster.command_logs()) if r.epoch == epoch)
        return commanded >= 2 and all(load.completed(r.index) >= 3 for r in cluster.replicas)

    await eventually(warm, timeout=30, what="load on every replica and commands in the first epoch")


async def test_sigkill_the_leader_fails_only_its_own_requests_and_a_new_leader_acts_within_ttl_plus_1s(
    cluster: ReplicaCluster,
) -> None:
    leader_id, epoch = await cluster.ready(cluster.replicas)
    leader = cluster.by_id(leader_id)
    survivors = [r for r in cluster.replicas if r is not leader]
    load = SpreadLoad([r.url for r in cluster.replicas], seed=1)
    toggler = Toggler([survivors[0]])
    load.start()
    toggler.start()
    try:
        await _warm(cluster, load, epoch)
        load.targets.take_out(leader.index)
        killed_at = time.monotonic()
        leader.child.signal(signal.SIGKILL)
        first = await eventually(
            lambda: first_accepted(cluster.command_logs(), newer_than=epoch),
            timeout=30,
            what="a command of a newer epoch accepted by an agent",
        )
        # A little load on the new leader's watch, then stop.
        await eventually(
            lambda: len(load.since(first.mono)) >= 20, timeout=30, what="load after the failover"
        )
    finally:
        sent = await load.stop()
        await toggler.stop()
    failover_s = first.mono - killed_at
    print(f"\nleader {leader_id} SIGKILLed: epoch {epoch} -> {first.epoch}; acted after {failover_s:.3f} s")
    on_victim = killed_in_flight(sent, leader.index, killed_at)
    survivors_sent = [s for s in sent if s not in on_victim]
    print(f"requests: {tally(sent)}; in flight on the victim: {len(on_victim)}")
    assert not not_completed(survivors_sent), not_completed(survivors_sent)[:5]
    assert all(s.replica != leader.index for s in sent if s.started > killed_at)
    assert failover_s <= FAILOVER_BOUND_S, f"the new leader acted {failover_s:.3f} s after the kill"
    logs = cluster.command_logs()
    assert not fencing_violations(logs), fencing_violations(logs)
    new_leader = await cluster.ready(survivors, timeout_s=30)
    assert new_leader[0] != leader_id and new_leader[1] == first.epoch > epoch


async def test_sigkill_a_follower_fails_only_its_own_requests_and_the_leader_goes_on(
    cluster: ReplicaCluster,
) -> None:
    leader_id, epoch = await cluster.ready(cluster.replicas)
    leader = cluster.by_id(leader_id)
    victim = next(r for r in cluster.replicas if r is not leader)
    load = SpreadLoad([r.url for r in cluster.replicas], seed=2)
    toggler = Toggler([leader])
    load.start()
    toggler.start()
    try:
        await _warm(cluster, load, epoch)
        load.targets.take_out(victim.index)
        killed_at = time.monotonic()
        victim.child.signal(signal.SIGKILL)
        await eventually(
            lambda: len(load.since(killed_at + 1.0)) >= 20, timeout=30, what="load after the kill"
        )
        commands_before = sum(1 for r in accepted(cluster.command_logs()) if r.mono < killed_at)
    finally:
        sent = await load.stop()
        await toggler.stop()
    on_victim = killed_in_flight(sent, victim.index, killed_at)
    print(
        f"\nfollower {victim.replica_id} SIGKILLed: requests {tally(sent)}; in flight on it: {len(on_victim)}"
    )
    others = [s for s in sent if s not in on_victim]
    assert not not_completed(others), not_completed(others)[:5]
    logs = cluster.command_logs()
    after = [r for r in accepted(logs) if r.mono > killed_at]
    assert after and {r.epoch for r in after} == {epoch}, "the leader kept commanding, in its own epoch"
    assert len(list(accepted(logs))) > commands_before
    assert not fencing_violations(logs), fencing_violations(logs)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        still = [r for r in cluster.replicas if r is not victim]
        for replica in still:
            seen = await cluster.view(http, replica)
            assert (seen["leader"], seen["epoch"]) == (leader_id, epoch)
