"""Admission through the real gateway, with simulated engines past their capacity: requests the pair
has no room for wait in the gateway and get their answers once room comes; a full queue refuses the
sheddable class first, with a 429 that says why and when to come back; a target that passes while a
request waits refuses it; a client that leaves is withdrawn; ``priority`` never reaches an engine
that would refuse it; and every outcome is counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import wait_ready
from tests.integration.orchestrator_support import MODEL, orch_config, registered, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.config import AdmissionConfig, SimTiming
from vllm_disagg.orchestrator.app import GATEWAY_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import MetricsSnapshot

# The prompt is 500 tokens, and each request the prefill instance has in flight adds a second to the
# predicted TTFT (500 tokens at 500 tokens/s): 1 s idle, 2 s with one in flight, 3 s with two. With a
# 2.5 s budget it takes two at a time, and the third waits.
P_METRICS = MetricsSnapshot(prefill_tokens_per_s=500.0, mean_prompt_tokens=500.0)
# The engine may take the whole 2.5 s budget: two 1 s prefills on p0 at once, the third waits.
ADMISSION = AdmissionConfig(ttft_s=2.5, max_queue=4, sheddable_priority=1, engine_share=1.0)
# A prefill of about 1 s on the engines: long enough that a burst finds the pair busy.
SLOW = SimTiming(prefill_s_per_token=0.002, decode_step_s=0.005)
PROMPT = "word " * 100


@pytest.fixture
async def orch() -> AsyncIterator[OrchestratorServer]:
    server = await start_orchestrator(orch_config(admission=ADMISSION), shutdown_timeout_s=2.0)
    try:
        yield server
    finally:
        await server.close()


async def one_p_one_d(
    orch: OrchestratorServer,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    d_metrics: MetricsSnapshot | None = None,
) -> None:
    p = await fake_agent("p0", (await sim_engine(timing=SLOW)).url, "prefill")
    d = await fake_agent("d0", (await sim_engine(timing=SLOW)).url, "decode")
    p.metrics = P_METRICS
    d.metrics = d_metrics or d.metrics
    await wait_ready(orch, 1, 1)
    await eventually(
        lambda: registered(orch, "p0").metrics.prefill_tokens_per_s == 500.0, what="p0's rate seen"
    )


async def complete(
    http: aiohttp.ClientSession, url: str, request_id: str, headers: dict[str, str] | None = None, **body: Any
) -> tuple[int, dict[str, str], Any]:
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **body}
    hdrs = {"X-Request-Id": request_id, **(headers or {})}
    async with http.post(f"{url}/v1/completions", data=jsonutil.dumps(payload), headers=hdrs) as resp:
        return resp.status, dict(resp.headers), jsonutil.loads(await resp.read())


async def record(http: aiohttp.ClientSession, url: str, request_id: str) -> dict[str, Any]:
    async with http.get(f"{url}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
        assert resp.status == 200
        found: dict[str, Any] = await resp.json()
        return found


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at any instant."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    best = now = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


async def test_a_burst_waits_in_the_gateway_and_every_request_is_answered(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await one_p_one_d(orch, fake_agent, sim_engine)
    ids = [f"burst-{i}" for i in range(4)]
    answers = await asyncio.gather(*(complete(http, orch.url, rid) for rid in ids))
    assert [status for status, _, _ in answers] == [200] * 4
    assert all(body["choices"][0]["text"] for _, _, body in answers)

    records = [await record(http, orch.url, rid) for rid in ids]
    first_legs = []
    for r in records:
        start = r["started_wall"]
        first = r["attempts"][0]
        if first["instance"] == "p0":
            first_legs.append((start + first["started_s"], start + first["ended_s"]))
    assert most_at_once(first_legs) <= 2, "p0 never had more than the two the budget allows"
    waited = [r for r in records if "queued_s" in r["admission"]]
    assert waited, "a burst of four on a pair that takes two: some waited"
    for r in waited:
        assert r["admission"]["queued_s"] > 0
        assert r["timeline"]["queued"] <= r["timeline"]["admitted"] <= r["timeline"]["scheduled"]
        assert r["stages"]["admission_s"] == pytest.approx(r["admission"]["queued_s"], abs=1e-5)
    assert {r["admission"]["tenant"] for r in records} == {"default"}
    # Each record says what was predicted for it when it was admitted (a 1 s prefill at the least),
    # and each answer measured that prediction for the margin admission keeps.
    assert all(r["admission"]["predicted_ttft_s"] >= 1.0 for r in records)
    admission = orch.app[GATEWAY_KEY].admission
    assert admission is not None and len(admission.slack) == 4

    samples = await scrape(http, orch.url)
    counted = {"name": "vllm_disagg_admission_requests_total", "model": MODEL}
    assert sample(samples, **counted, outcome="admitted") == 4
    assert sample(samples, **counted, outcome="queued") == len(waited)
    assert sample(samples, **counted, outcome="shed") == 0
    assert sample(samples, "vllm_disagg_admission_wait_seconds_count", model=MODEL) == 4
    assert sample(samples, "vllm_disagg_admission_queue_depth", model=MODEL) == 0


async def test_a_full_queue_refuses_the_sheddable_class_first_and_says_why(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await one_p_one_d(orch, fake_agent, sim_engine)
    # Five that matter: the pair's two places and the queue's four hold them, whatever the order.
    important = [complete(http, orch.url, f"vip-{i}", priority=-1) for i in range(5)]
    bulk = [complete(http, orch.url, f"bulk-{i}", {"x-priority": "1"}) for i in range(3)]
    answers = await asyncio.gather(*important, *bulk)
    vip, shed = answers[:5], answers[5:]
    assert [status for status, _, _ in vip] == [200] * 5, "priority is not forwarded: no engine refused it"
    refused = [(headers, body) for status, headers, body in shed if status == 429]
    assert refused, "the sheddable class is refused while the pair is saturated"
    for headers, body in refused:
        assert headers["X-Disagg-Shed-Reason"] == "sheddable"
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert body["error"]["type"] == "RateLimitError" and body["error"]["code"] == 429
        assert "sheddable" in body["error"]["message"]
    assert all(status in (200, 429) for status, _, _ in answers), "nothing past capacity is a 5xx"
    samples = await scrape(http, orch.url)
    shed_count = sample(
        samples, "vllm_disagg_admission_requests_total", model=MODEL, outcome="shed", reason="sheddable"
    )
    assert shed_count == len(refused)


async def test_a_request_whose_target_passes_while_it_waits_is_refused(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    # The decode instance's own queue (4 s) is no better place for it: the scheduler keeps it on p0.
    busy = MetricsSnapshot(prefill_tokens_per_s=500.0, mean_prompt_tokens=500.0, num_waiting=3)
    await one_p_one_d(orch, fake_agent, sim_engine, busy)
    await eventually(lambda: registered(orch, "d0").metrics.num_waiting == 3, what="d0's queue seen")
    admission = orch.app[GATEWAY_KEY].admission
    assert admission is not None
    hold = [asyncio.create_task(complete(http, orch.url, f"hold-{i}")) for i in range(2)]
    # The first holds d0 from its decision on, and d0 reports a queue: the second waits for decode.
    await eventually(
        lambda: orch.registry.snapshot().in_flight_of("p0") == 1 and admission.queue.depth(MODEL) == 1,
        what="the pair full",
    )
    # Its own prefill takes 1 s: once it has waited 0.3 s, 1.3 s cannot be met.
    status, headers, body = await complete(http, orch.url, "tight", {"x-slo-ttft-ms": "1300"})
    assert status == 429
    assert headers["X-Disagg-Shed-Reason"] == "deadline_unreachable"
    assert "TTFT target" in body["error"]["message"]
    assert [status for status, _, _ in await asyncio.gather(*hold)] == [200, 200]


async def test_a_client_that_leaves_while_waiting_is_withdrawn(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await one_p_one_d(orch, fake_agent, sim_engine)
    admission = orch.app[GATEWAY_KEY].admission
    assert admission is not None
    hold = [asyncio.create_task(complete(http, orch.url, f"hold-{i}")) for i in range(2)]
    await eventually(lambda: orch.registry.snapshot().in_flight_of("p0") == 2, what="two in flight")
    leaving = asyncio.create_task(complete(http, orch.url, "leaving"))
    await eventually(lambda: admission.queue.depth(MODEL) == 1, what="the third waits")
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await eventually(lambda: admission.queue.depth(MODEL) == 0, what="withdrawn")
    assert [status for status, _, _ in await asyncio.gather(*hold)] == [200, 200]
    samples = await scrape(http, orch.url)
    assert sample(samples, "vllm_disagg_admission_requests_total", outcome="withdrawn") == 1
    assert sample(samples, "vllm_disagg_admission_requests_total", outcome="admitted") == 2


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"priority": "high"}, {}, "priority"),
        ({}, {"x-priority": "1.5"}, "priority"),
        ({}, {"x-tenant-id": "not a name"}, "x-tenant-id"),
    ],
)
async def test_a_bad_priority_or_tenant_is_a_400(
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    body: dict[str, Any],
    headers: dict[str, str],
    param: str,
) -> None:
    await one_p_one_d(orch, fake_agent, sim_engine)
    status, _, answer = await complete(http, orch.url, "bad", headers, **body)
    assert status == 400
    assert answer["error"]["param"] == param


async def test_a_request_no_instance_has_room_for_waits_rather_than_getting_a_503(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    """The scheduler filters out an instance whose KV cache is nearly full; with nothing else to offer,
    that is a saturated decode stage to wait for, not a cluster that is down."""
    d = await fake_agent("d0", (await sim_engine()).url, "decode")
    d.metrics = MetricsSnapshot(kv_cache_usage=0.99)
    await wait_ready(orch, 0, 1)
    await eventually(lambda: registered(orch, "d0").metrics.kv_cache_usage == 0.99, what="d0 full")
    admission = orch.app[GATEWAY_KEY].admission
    assert admission is not None
    waiting = asyncio.create_task(complete(http, orch.url, "waits"))
    await eventually(lambda: admission.queue.depth(MODEL) == 1, what="it waits")
    assert admission.queue.blocked(MODEL) == "decode"
    d.metrics = MetricsSnapshot(kv_cache_usage=0.2)  # room again
    status, headers, _ = await waiting
    assert (status, headers["X-Disagg-Decode"]) == (200, "d0")
