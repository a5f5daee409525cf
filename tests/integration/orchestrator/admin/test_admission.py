"""``/admin/v1/admission``: the gateway's admission queue as operators (the CLI, the dashboard) see it,
and the tenants' weights they set; a real orchestrator on loopback, a scripted agent, a held engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator_support import (
    MODEL,
    FakeAgent,
    FakeEngine,
    orch_config,
    sample,
    scrape,
)
from vllm_disagg.cli.commands import main as cli_main
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.orchestrator.app import GATEWAY_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import MetricsSnapshot

# The prefill stage never binds here (its budget is long); the decode stage binds while the gateway has
# a request in flight on an engine that reports its KV above 50% (below the scheduler's own 95% ceiling,
# past which the instance would not be a candidate at all: no capacity, not a queue).
ADMISSION = AdmissionConfig(ttft_s=600.0, kv_usage_high=0.5, tenant_weights=(("gold", 3.0),))


@pytest.fixture
async def orch() -> AsyncIterator[OrchestratorServer]:
    server = await start_orchestrator(orch_config(admission=ADMISSION), shutdown_timeout_s=1.0)
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def held() -> AsyncIterator[FakeEngine]:
    """An engine that answers nothing until the test ends: a request sent to it stays in flight."""

    async def hold(request: web.Request) -> web.Response:
        await engine.release.wait()
        return web.json_response({"choices": [{"text": "", "index": 0, "finish_reason": "stop"}]})

    engine = await FakeEngine(hold).start()
    try:
        yield engine
    finally:
        await engine.close()


async def admin(http: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.request(method, url, json=body, headers=ADMIN) as resp:
        return resp.status, await resp.json()


async def complete(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    """One completion on a connection of its own (cancelling it is the client leaving)."""
    body = {"model": MODEL, "prompt": "wait for room", "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json=body, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status, dict(resp.headers)


async def test_the_queue_is_shown_per_model_by_priority_and_tenant_with_its_saturated_stage_and_outcomes(
    orch: OrchestratorServer,
    held: FakeEngine,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent = FakeAgent(orch.zmq_endpoint, "d0", held.url, "decode")
    agent.metrics = MetricsSnapshot(kv_cache_usage=0.7)  # above kv_usage_high: saturated once busy
    await agent.join()
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    clients: list[asyncio.Task[tuple[int, dict[str, str]]]] = []
    try:
        clients.append(asyncio.create_task(complete(orch.url, {})))  # admitted at once: d0 was idle
        await eventually(lambda: orch.registry.snapshot().in_flight_of("d0") == 1, what="d0 busy")
        for priority, tenant in (("0", "gold"), ("-1", "bronze")):
            clients.append(
                asyncio.create_task(complete(orch.url, {"x-priority": priority, "x-tenant-id": tenant}))
            )
        # The sheddable class is refused at once while its pair is saturated, never queued.
        status, headers = await complete(orch.url, {"x-priority": "1", "x-tenant-id": "silver"})
        assert (status, headers["X-Disagg-Shed-Reason"]) == (429, "sheddable")

        async def queued() -> dict[str, Any] | None:
            status, body = await admin(http, "GET", f"{orch.url}/admin/v1/admission")
            assert status == 200, body
            model = body["models"].get(MODEL, {})
            return body if model.get("depth") == 2 and model.get("saturated") == "decode" else None

        body = await eventually(queued, what="two requests waiting, held back by the decode stage")
        model = body["models"][MODEL]
        assert model["by_priority"] == {"-1": 1, "0": 1} and model["by_tenant"] == {"bronze": 1, "gold": 1}
        assert model["oldest_wait_s"] > 0
        assert {k: model["counts"][k] for k in ("admitted", "queued", "withdrawn")} == {
            "admitted": 1,
            "queued": 2,
            "withdrawn": 0,
        }
        assert {r: n for r, n in model["counts"]["shed"].items() if n} == {"sheddable": 1}
        assert model["ahead_of_share"]["default"] > 0, "the one admitted tenant is ahead of its share"
        assert body["enabled"] is True and body["config"]["ttft_s"] == 600.0
        assert body["tenants"] == {
            "weights": {"gold": 3.0},
            "configured": {"gold": 3.0},
            "default_weight": 1.0,
        }
        assert body["processes"] == [{"worker": 0, "depth": 2, "tenant_weights": {"gold": 3.0}}]
        samples = await scrape(http, orch.url)  # the metrics tell the same
        assert sample(samples, "vllm_disagg_admission_queue_depth", model=MODEL) == 2
        assert sample(samples, "vllm_disagg_admission_saturated", model=MODEL, stage="decode") == 1

        assert await asyncio.to_thread(cli_main, ["status", "--url", orch.url]) == 0
        lines = capsys.readouterr().out.splitlines()
        head = next(i for i, line in enumerate(lines) if line.startswith("admission:"))
        assert lines[head] == "admission: 2 waiting; tenants' weights: gold=3"
        assert lines[head + 1].split() == [
            *("MODEL", "WAITING", "BY-PRIORITY", "OLDEST-S", "SATURATED", "ADMITTED", "QUEUED", "SHED")
        ]
        row = lines[head + 2].split()
        assert row[:4] == [MODEL, "2", "-1:1", "0:1"] and row[5:] == ["decode", "1", "2", "sheddable=1"]
    finally:
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await agent.close()


async def test_tenants_weights_are_set_and_reset_with_the_token_and_checked(
    orch: OrchestratorServer, http: aiohttp.ClientSession
) -> None:
    admission = orch.app[GATEWAY_KEY].admission
    assert admission is not None
    base = f"{orch.url}/admin/v1/admission/tenants"
    async with http.put(f"{base}/gold", json={"weight": 9}) as resp:
        assert resp.status == 401, "no token, no change"
    for tenant, body in (
        ("gold", {"weight": 0}),
        ("gold", {"weight": -2}),
        ("gold", {"weight": "2"}),
        ("gold", {"weight": True}),
        ("gold", {"weight": 2, "extra": 1}),
        ("gold", [2]),
        ("two%20words", {"weight": 2}),
        ("x" * 65, {"weight": 2}),
    ):
        status, answer = await admin(http, "PUT", f"{base}/{tenant}", body)
        assert status == 400, (tenant, body, answer)
    async with http.put(f"{base}/gold", data=b'{"weight": Infinity}', headers=ADMIN) as resp:
        assert resp.status == 400, "not a finite number"
    assert (await admin(http, "GET", base))[1]["weights"] == {"gold": 3.0}, "nothing was changed"
    assert admission.queue.weight("gold") == 3.0

    status, answer = await admin(http, "PUT", f"{base}/team-a.eu:1", {"weight": 0.5})
    assert status == 200 and (answer["tenant"], answer["weight"]) == ("team-a.eu:1", 0.5)
    assert answer["weights"] == {"gold": 3.0, "team-a.eu:1": 0.5}
    assert admission.queue.weight("team-a.eu:1") == 0.5, "the queue shares by it from now on"
    status, answer = await admin(http, "DELETE", f"{base}/gold")  # a configured one goes back to 1 too
    assert status == 200 and (answer["weight"], answer["weights"]) == (1.0, {"team-a.eu:1": 0.5})
    assert admission.queue.weight("gold") == 1.0
    status, answer = await admin(http, "GET", base)
    assert answer == {"weights": {"team-a.eu:1": 0.5}, "configured": {"gold": 3.0}, "default_weight": 1.0}
    assert (await admin(http, "DELETE", f"{base}/never-set"))[0] == 200, "already at 1.0: nothing to do"


async def test_with_admission_off_the_queue_reads_off_and_weights_are_not_found(
    http: aiohttp.ClientSession,
) -> None:
    server = await start_orchestrator(
        orch_config(admission=AdmissionConfig(enabled=False)), shutdown_timeout_s=1.0
    )
    try:
        status, body = await admin(http, "GET", f"{server.url}/admin/v1/admission")
        assert (status, body) == (200, {"enabled": False, "models": {}})
        for method, path in (("GET", ""), ("PUT", "/gold"), ("DELETE", "/gold")):
            status, body = await admin(
                http, method, f"{server.url}/admin/v1/admission/tenants{path}", {"weight": 2}
            )
            assert status == 404 and "admission is off" in body["error"]["message"], (method, path)
    finally:
        await server.close()
