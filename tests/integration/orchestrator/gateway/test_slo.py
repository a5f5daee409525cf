"""Per-request latency targets through the real gateway: a short prompt behind a busy prefill pool
runs colocated to meet its TTFT target, a target nobody can meet is served best effort and counted,
attainment is counted by class, and a bad target header is a 400."""

from __future__ import annotations

import aiohttp

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import wait_ready
from tests.integration.orchestrator_support import MODEL, registered, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.protocol.messages import MetricsSnapshot

BUSY = MetricsSnapshot(prefill_tokens_per_s=10_000.0, queue_s=2.0, num_waiting=8)
IDLE = MetricsSnapshot(prefill_tokens_per_s=10_000.0)


async def completion(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], prompt: str = "a short prompt"
) -> tuple[int, dict[str, str], bytes]:
    body = jsonutil.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True})
    async with http.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_targets_steer_the_pair_and_are_counted_by_class(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    p = await fake_agent("p0", (await sim_engine()).url, "prefill")
    d = await fake_agent("d0", (await sim_engine()).url, "decode")
    p.metrics, d.metrics = BUSY, IDLE  # what their heartbeats say: a prefill queue of 2 s
    await wait_ready(orch, 1, 1)
    await eventually(lambda: registered(orch, "p0").metrics.queue_s == 2.0, what="p0's queue seen")

    status, headers, _ = await completion(http, orch.url, {"X-Request-Id": "plain"})
    assert (status, headers["X-Disagg-Mode"]) == (200, "disaggregated"), "no target: split as usual"

    status, headers, raw = await completion(http, orch.url, {"X-Request-Id": "tight", "x-slo-ttft-ms": "500"})
    assert (status, headers["X-Disagg-Mode"], headers["X-Disagg-Decode"]) == (200, "colocated", "d0")
    assert raw.endswith(b"data: [DONE]\n\n")
    async with http.get(f"{orch.url}/admin/v1/requests/tight", headers=ADMIN) as resp:
        record = await resp.json()
    assert record["explanation"]["request"]["slo_ttft_s"] == 0.5
    assert record["explanation"]["decider"]["reason"].startswith("to meet its TTFT target of 0.5 s")

    # 3,500 prompt tokens cannot be prefilled in 100 ms anywhere here: served all the same.
    long_prompt = "word " * 700
    status, headers, raw = await completion(
        http, orch.url, {"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "1000"}, long_prompt
    )
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[:300]

    status, _, raw = await completion(http, orch.url, {"x-slo-tpot-ms": "soon"})
    assert status == 400
    assert jsonutil.loads(raw)["error"]["param"] == "x-slo-tpot-ms"

    samples = await scrape(http, orch.url)
    assert sample(samples, "vllm_disagg_slo_requests_total", slo="ttft<=500ms", outcome="met") == 1
    best_effort = {"slo": "ttft<=100ms,tpot>500ms"}
    assert sample(samples, "vllm_disagg_slo_best_effort_total", **best_effort) == 1
    assert (
        sample(samples, "vllm_disagg_slo_requests_total", **best_effort, outcome="met")
        + sample(samples, "vllm_disagg_slo_requests_total", **best_effort, outcome="missed")
        == 1
    )
