"""etcd down under load (issue 26): replicas route on what they know, leader actions pause and say so,
everything resumes when etcd is back, nothing lost. Every process real (``cluster.py``).

etcd goes down twice on one cluster under one load: frozen (SIGSTOP: connections open, nothing answers,
as a partition or a stuck host looks), then killed (SIGKILL, then started again on the same data
directory and ports).

While it is down:

- every request through every replica completes with the exact expected bytes (the load spreads
  streams over the three replicas' ports);
- an admin write (a drain, which commands an agent) answers 503 with a reason that names etcd, on
  every replica;
- ``/health`` says under ``replica.leader_actions`` that they are paused for etcd, on every replica;
- ``vllm-disagg status`` shows etcd UNREACHABLE;
- ``vllm_disagg_replica{what="leader_actions_paused"}`` is 1 on every replica.

Once etcd is back: one leader is agreed again (every replica names it, and it says it leads), the same
write succeeds (and its command reaches the agent), and the cordon written before the first outage is
still applied on every replica. (After etcd's restart the pre-outage leader key lives one more TTL:
etcd restores every lease with its full TTL, the leader's own too, which its holder gave up while etcd
was away; until it expires every replica names that leader, which does not lead.)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.e2e.replicas.cluster import SPARE, ReplicaCluster
from tests.e2e.replicas.commands import accepted
from tests.e2e.replicas.load import Sent, SpreadLoad, not_completed, tally
from tests.helpers import ADMIN, cli_argv, eventually

OUTAGE_NOTICED_S = 15.0  # keepalives every TTL/3, each call's 2 s timeout, then the step-down margin


async def _post(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.post(url, headers=ADMIN) as resp:
        return resp.status, await resp.json(content_type=None)


async def _cordoned_everywhere(cluster: ReplicaCluster, http: aiohttp.ClientSession) -> bool:
    for replica in cluster.replicas:
        body = await cluster.get(http, replica, "/admin/v1/instances")
        spare = next(i for i in body["instances"] if i["agent_id"] == SPARE)
        if spare["cordoned"] is not True:
            return False
    return True


async def _paused_everywhere(cluster: ReplicaCluster, http: aiohttp.ClientSession) -> bool:
    """Every replica says leader actions wait for etcd, in /health and in its metric, and none names a
    leader any more (each has given its lease up: until then a follower still forwards writes to the
    leader it last saw)."""
    for replica in cluster.replicas:
        async with http.get(replica.url + "/health") as resp:
            health = await resp.json()
        said = health["replica"]
        if "etcd" not in said["leader_actions"] or said["etcd"]["ok"] or said["leader"] is not None:
            return False
        if await cluster.metric(http, replica, "leader_actions_paused") != 1:
            return False
    return True


async def _status(url: str) -> str:
    """``vllm-disagg status --url URL`` (the admin token comes from the environment)."""
    proc = await asyncio.create_subprocess_exec(
        *cli_argv("status", "--url", url), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, out.decode()
    return out.decode()


@dataclass
class Outage:
    """What one outage looked like."""

    how: str
    down_s: float = 0.0
    leader_after: tuple[str, int] = ("", 0)
    agreed_after_s: float = 0.0  # from etcd back to one leader that says it leads, agreed by all
    during: list[Sent] = field(default_factory=list)  # requests started while etcd was down


async def test_with_etcd_down_replicas_route_leader_actions_pause_and_all_resumes_when_it_returns(
    cluster: ReplicaCluster,
) -> None:
    leader_id, epoch = await cluster.ready(cluster.replicas)
    load = SpreadLoad([r.url for r in cluster.replicas], seed=3)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        via = next(r for r in cluster.replicas if r.replica_id != leader_id)  # a follower: forwarded
        status, body = await _post(http, f"{via.url}/admin/v1/instances/{SPARE}/cordon")
        assert status == 200, body
        await eventually(
            lambda: _cordoned_everywhere(cluster, http), timeout=10, what="the cordon everywhere"
        )
        load.start()
        try:
            outages = [await _outage(cluster, http, load, how) for how in ("frozen", "killed")]
        finally:
            sent = await load.stop()
    print(f"\nleader before: {leader_id} (epoch {epoch}); requests {tally(sent)}")
    for o in outages:
        print(
            f"etcd {o.how} for {o.down_s:.1f} s: then {o.leader_after[0]} leads (epoch {o.leader_after[1]}), "
            f"agreed {o.agreed_after_s:.1f} s after etcd was back; requests during it {tally(o.during)}"
        )
    assert not not_completed(sent), not_completed(sent)[:5]


async def _outage(cluster: ReplicaCluster, http: aiohttp.ClientSession, load: SpreadLoad, how: str) -> Outage:
    """etcd down (``how``: frozen or killed) and back, checked on the way."""
    outage = Outage(how)
    await eventually(
        lambda: all(load.completed(r.index, since=time.monotonic() - 2.0) >= 3 for r in cluster.replicas),
        timeout=30,
        what="load on every replica",
    )
    down_at = time.monotonic()
    cluster.etcd.pause() if how == "frozen" else cluster.etcd.kill()
    await eventually(
        lambda: _paused_everywhere(cluster, http), timeout=OUTAGE_NOTICED_S, what="leader actions paused"
    )
    status_cli = asyncio.ensure_future(_status(cluster.replicas[0].url))  # a process: starts slowly
    try:
        for replica in cluster.replicas:
            status, body = await _post(http, f"{replica.url}/admin/v1/instances/{SPARE}/drain")
            assert status == 503 and "etcd" in str(body), (how, replica.replica_id, status, body)
        # Routing goes on: more requests through every replica while etcd is still down.
        await eventually(
            lambda: all(load.completed(r.index, since=down_at) >= 5 for r in cluster.replicas),
            timeout=30,
            what="requests through every replica during the outage",
        )
        assert "etcd UNREACHABLE" in await status_cli
    finally:
        status_cli.cancel()
    outage.during = load.since(down_at)
    if how == "frozen":
        cluster.etcd.resume()
    else:
        await cluster.etcd.start_async()
    up_at = time.monotonic()
    outage.down_s = up_at - down_at
    outage.leader_after = await cluster.ready(cluster.replicas, timeout_s=30)
    outage.agreed_after_s = time.monotonic() - up_at
    for kind in ("drain", "undrain"):  # through each replica in turn: the leader, or forwarded to it
        status, body = await _post(
            http, f"{cluster.replicas[kind == 'drain'].url}/admin/v1/instances/{SPARE}/{kind}"
        )
        assert status == 200, (how, kind, body)
        assert any(r.kind == kind and r.mono > up_at for r in accepted(cluster.command_logs()))
    assert await _cordoned_everywhere(cluster, http), "the cordon written before the outage is kept"
    return outage
