"""Replicas of one orchestrator on a real etcd: one leads, every one routes, writes go to the leader.

Three replicas run in this process on real sockets; a scripted agent holds a session with each (as a
real agent does: docs/agent.md), so every replica knows the same instances.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ADMIN, ADMIN_TOKEN, eventually
from tests.integration.orchestrator.replicas.support import Replicas, join_everywhere, one_leader
from tests.integration.orchestrator_support import MODEL, fake_engine, sample, scrape
from vllm_disagg.cli.commands import main
from vllm_disagg.errors import NotLeader
from vllm_disagg.orchestrator.app import CONTROL_KEY, REPLICATION_KEY, OrchestratorServer
from vllm_disagg.orchestrator.replicas.forward import LEADER
from vllm_disagg.protocol.commands import Drain


async def test_one_replica_leads_and_every_replica_says_which_and_routes(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(3)
    leader = await one_leader(servers)
    leader_id = leader.app[REPLICATION_KEY].replica_id
    for server in servers:
        async with http.get(f"{server.url}/admin/v1/replicas", headers=ADMIN) as resp:
            seen = await resp.json()
        assert seen["leader"] == leader_id and seen["cluster"] == "test"
        assert [r["id"] for r in seen["replicas"]] == ["r0", "r1", "r2"]
        assert seen["role"] == ("leader" if server is leader else "follower")
        assert seen["epoch"] > 0 and seen["etcd"]["ok"] is True
        figures = await scrape(http, server.url)
        assert sample(figures, "vllm_disagg_replica", what="leader") == (server is leader)
        assert sample(figures, "vllm_disagg_replica", what="epoch") == seen["epoch"]
        assert sample(figures, "vllm_disagg_replica", what="leader_actions_paused") == 0
    async with fake_engine(lambda _: _answer()) as engine:
        agents = await join_everywhere(servers, "d0", engine.url)
        for server in servers:  # any replica serves the OpenAI API from what it knows itself
            async with http.post(
                f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}
            ) as resp:
                assert resp.status == 200, await resp.text()

            async def ready(s: OrchestratorServer = server) -> dict[str, Any] | None:
                # Ready once it knows a decode instance and every agent had the time to say Hello.
                async with http.get(f"{s.url}/health/ready") as resp:
                    body: dict[str, Any] = await resp.json()
                    assert resp.status == 200 or body["reason"].startswith("starting: agents have"), body
                    return body if resp.status == 200 else None

            assert (await eventually(ready, what="ready"))["leader"] == leader_id
        for agent in agents:
            await agent.close()


async def _answer() -> web.Response:
    return web.json_response({"id": "c", "object": "text_completion", "model": MODEL, "choices": [
        {"index": 0, "text": "ok", "finish_reason": "stop"}]})  # fmt: skip


async def test_a_drain_sent_to_a_follower_is_done_by_the_leader_in_its_epoch(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(3)
    leader = await one_leader(servers)
    follower = next(s for s in servers if s is not leader)
    agents = await join_everywhere(servers, "d0", "http://127.0.0.1:9")
    url = f"{follower.url}/admin/v1/instances/d0/drain"
    async with http.post(url) as resp:
        assert resp.status == 401, "a caller without the token is refused where it knocked"
    async with http.post(url, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers[LEADER] == leader.app[REPLICATION_KEY].replica_id
    epoch = leader.app[CONTROL_KEY].leadership.epoch
    by_leader = agents[servers.index(leader)]
    assert [(c.kind, c.epoch) for c in by_leader.commands] == [("drain", epoch)]
    assert all(not a.commands for a in agents if a is not by_leader), "only the leader commands agents"
    with pytest.raises(NotLeader, match="does not lead"):
        await follower.app[CONTROL_KEY].send_command("d0", Drain())
    for agent in agents:
        await agent.close()


async def test_requests_in_flight_on_one_replica_count_on_every_other(
    replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    servers = await replicas(2)
    await one_leader(servers)

    async def hang(request: web.Request) -> web.StreamResponse:
        await engine.release.wait()
        return await _answer()

    async with fake_engine(hang) as engine:
        agents = await join_everywhere(servers, "d0", engine.url)
        body = {"model": MODEL, "prompt": "hi"}
        posts = [
            asyncio.create_task(http.post(f"{servers[0].url}/v1/completions", json=body)) for _ in range(3)
        ]
        await eventually(
            lambda: servers[1].registry.snapshot().in_flight_of("d0") == 3, what="3 in flight at r1"
        )
        engine.release.set()
        for post in posts:
            async with await post as resp:
                assert resp.status == 200
        await eventually(
            lambda: servers[1].registry.snapshot().in_flight_of("d0") == 0, what="none left at r1"
        )
        for agent in agents:
            await agent.close()


async def test_a_leader_that_leaves_hands_over_at_once_and_the_new_term_fences_the_old(
    replicas: Replicas,
) -> None:
    servers = await replicas(3)
    first = await one_leader(servers)
    old_epoch = first.app[CONTROL_KEY].leadership.epoch
    rest = [s for s in servers if s is not first]
    agents = await join_everywhere(rest, "d0", "http://127.0.0.1:9")
    await first.close()
    servers.remove(first)
    second = await one_leader(rest)
    new_epoch = second.app[CONTROL_KEY].leadership.epoch
    assert new_epoch > old_epoch
    ack = await second.app[CONTROL_KEY].send_command("d0", Drain())
    assert ack.ok
    assert [c.epoch for c in agents[rest.index(second)].commands] == [new_epoch]
    for agent in agents:
        await agent.close()


async def test_status_shows_the_replicas_which_one_leads_and_since_when(
    replicas: Replicas, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = await replicas(2)
    leader = await one_leader(servers)
    follower = next(s for s in servers if s is not leader)
    token = tmp_path / "token"
    token.write_text(ADMIN_TOKEN)
    argv = ["status", "--url", follower.url, "--admin-token-file", str(token)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out.splitlines()
    leader_id, follower_id = (s.app[REPLICATION_KEY].replica_id for s in (leader, follower))
    epoch = leader.app[CONTROL_KEY].leadership.epoch
    assert out[0] == "no instances registered"
    assert out[2].startswith(f"cluster test: leader {leader_id} since 20")
    assert out[2].endswith(f"(epoch {epoch}); etcd ok; leader actions: {leader_id} leads them")
    table = out[4:]
    table = table[: table.index("")] if "" in table else table  # the admission section comes next
    rows = {line.split()[0]: line.split() for line in table}
    assert any(line.startswith("admission: 0 waiting") for line in out), out
    assert rows[leader_id][1:3] == ["leader", leader.url]
    assert rows[follower_id][1:5] == ["(this", "one)", "follower", follower.url]
    assert await asyncio.to_thread(main, [*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["replicas"]["leader"] == leader_id and doc["instances"] == []
