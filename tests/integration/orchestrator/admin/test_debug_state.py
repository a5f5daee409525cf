"""``GET /admin/v1/debug/state``: the scheduler's and the planner's state in one answer, as of one
snapshot, behind the admin token; it follows the cluster (a cordon, a request in flight, new weights)."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from tests.helpers import ADMIN
from tests.integration.orchestrator_support import orch_config
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role


async def dump(http: aiohttp.ClientSession, server: OrchestratorServer) -> Any:
    async with http.get(f"{server.admin_url}/admin/v1/debug/state", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_the_dump_shows_what_each_profile_would_choose_from_and_why_the_rest_are_out(
    http: aiohttp.ClientSession,
) -> None:
    # A long timeout: these instances have no agent behind them, and must not die while the test reads.
    server = await start_orchestrator(orch_config(heartbeat_timeout_s=600.0), shutdown_timeout_s=1.0)
    try:
        reg, now = server.registry, time.monotonic()
        roles: tuple[tuple[str, Role, str], ...] = (
            ("p0", "prefill", "a"),
            ("p1", "prefill", "b"),
            ("d0", "decode", "a"),
        )
        for agent_id, role, domain in roles:
            info = InstanceInfo(url="http://127.0.0.1:9", role=role, model="m", labels={"domain": domain})
            reg.hello(agent_id, info, now)
            metrics = MetricsSnapshot(scraped_at=1.0, num_running=2, num_waiting=1, kv_cache_usage=0.25)
            reg.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready", metrics=metrics), now)

        async with http.get(f"{server.admin_url}/admin/v1/debug/state") as resp:
            assert resp.status == 401, "behind the admin token: it names every instance"
        before = await dump(http, server)
        profiles = before["scheduler"]["models"]["m"]
        assert profiles["prefill"]["eligible"] == ["p0", "p1"]
        assert profiles["decode"]["eligible"] == ["d0"]
        assert [f["out"] for f in profiles["decode"]["filtered"] if f["out"]] == [["p0", "p1"]], "by role"
        assert profiles["decode"]["weights"]["queue-scorer"] == 1
        assert before["scheduler"]["decider"] == "kv-pool-decider"
        assert before["scheduler"]["kv_index"]["blocks"] == 0
        d0 = before["instances"]["d0"]
        assert (d0["state"], d0["in_flight"], d0["engine"]["waiting"], d0["labels"]) == (
            "ready",
            0,
            1,
            {"domain": "a"},
        )
        assert before["links"]["blocked"] == [] and "planner" in before and before["workers"] is None

        reg.set_cordon("p1", True)
        reg.acquire("d0")  # a request on d0, as the gateway counts it while its leg runs
        weights = {"weights": {"decode": {"queue-scorer": 3}}}
        async with http.put(
            f"{server.admin_url}/admin/v1/scheduler/weights", json=weights, headers=ADMIN
        ) as resp:
            assert resp.status == 200, await resp.text()
        after = await dump(http, server)
        profiles = after["scheduler"]["models"]["m"]
        assert profiles["prefill"]["eligible"] == ["p0"], "a cordoned instance takes no new request"
        assert any(f["out"] == ["p1"] for f in profiles["prefill"]["filtered"]), profiles["prefill"][
            "filtered"
        ]
        assert profiles["decode"]["weights"]["queue-scorer"] == 3
        d0 = after["instances"]["d0"]
        assert (d0["in_flight"], d0["in_flight_by_process"]) == (1, {"here": 1})
        assert after["instances"]["p1"]["cordoned"] is True
        assert after["registry"]["membership"] > before["registry"]["membership"]
        reg.release("d0")
    finally:
        await server.close()
