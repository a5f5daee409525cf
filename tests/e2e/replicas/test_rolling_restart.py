"""Every replica restarted one by one under streaming load (issue 26): 0 failed. Every process real.

**Rolling restart**: SIGTERM to one replica (graceful: it fails its health checks and serves on for
``--shutdown-delay-s``, then resigns leadership, stops listening and lets its in-flight requests finish
within ``--shutdown-timeout-s``), wait for it to exit, start it again with the same command line, wait
until it is ready (every replica agrees on one leader, and it has every instance ready), then the next
one; the leader is among them.

**0 failed**: the load spreads streams over the three replicas' ports as a load balancer does, with
its health check on ``/health/ready`` every 0.1 s: a stopping replica leaves the rotation when it fails
the check, before its listener closes (a connection waiting to be accepted then would be reset). A
connection refused before the request was sent goes to the next replica and is no failure; any error
answer, reset, broken stream or wrong byte is. A restarted replica is put back once the cluster is ready.
"""

from __future__ import annotations

import signal
import time

from tests.e2e.replicas.cluster import SHUTDOWN_TIMEOUT_S, ReplicaCluster
from tests.e2e.replicas.commands import accepted, fencing_violations
from tests.e2e.replicas.load import SpreadLoad, Toggler, all_ready, not_completed, tally
from tests.helpers import eventually


async def test_restarting_every_replica_one_by_one_under_load_fails_no_request(
    cluster: ReplicaCluster,
) -> None:
    _, epoch = await cluster.ready(cluster.replicas)
    await eventually(lambda: all_ready(cluster.replicas), timeout=30, what="every replica /health/ready")
    load = SpreadLoad([r.url for r in cluster.replicas], seed=4, health_path="/health/ready")
    toggler = Toggler(cluster.replicas)  # the leader keeps commanding, whoever it is at the time
    load.start()
    toggler.start()
    restarted_at: dict[int, float] = {}
    epochs = [epoch]
    try:
        for replica in cluster.replicas:
            await eventually(
                lambda: len(load.ended_since(time.monotonic() - 1.0)) >= 5,
                timeout=30,
                what=f"load before {replica.replica_id}'s restart: {tally(load.results)}",
            )
            t0 = time.monotonic()
            replica.child.signal(signal.SIGTERM)
            code = await replica.child.exited(SHUTDOWN_TIMEOUT_S + 20)
            t1 = time.monotonic()
            assert code == 0, f"{replica.replica_id} exited {code}:\n{replica.child.tail()}"
            load.targets.take_out(replica.index)
            replica.child.start()
            _, epoch = await cluster.ready(cluster.replicas, timeout_s=60)
            ready_s = time.monotonic() - t1
            print(f"\n{replica.replica_id}: exited after {t1 - t0:.1f} s, ready {ready_s:.1f} s later")
            epochs.append(epoch)
            load.targets.put_back(replica.index)
            restarted_at[replica.index] = time.monotonic()
        last = max(restarted_at.values())
        await eventually(
            lambda: (
                all(
                    sum(1 for s in load.since(restarted_at[r.index]) if s.replica == r.index) >= 3
                    for r in cluster.replicas
                )
                and len(load.since(last)) >= 10
            ),
            timeout=30,
            what="requests through every restarted replica",
        )
    finally:
        sent = await load.stop()
        await toggler.stop()
    redirected = sum(s.refused for s in sent)
    print(f"\nrolling restart: requests {tally(sent)}; epochs {epochs}; redirected {redirected}")
    assert not not_completed(sent), not_completed(sent)[:5]
    logs = cluster.command_logs()
    assert len({r.epoch for r in accepted(logs)}) >= 2, "the leader's restart handed leadership on"
    assert not fencing_violations(logs), fencing_violations(logs)
