"""An agent whose heartbeats carry figures out of range (a negative TPOT, NaN KV use) fails no request
and draws no extra traffic: issue 31, where ``tpot_s = -0.05`` made every completion a 500."""

from __future__ import annotations

import math

import aiohttp

from tests.helpers import eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator_support import MODEL
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.protocol.messages import MetricsSnapshot
from vllm_disagg.sim_engine.textgen import expected_text

HONEST = MetricsSnapshot(scraped_at=1.0, num_running=1, tpot_s=0.01, ttft_s=0.05)


async def test_figures_out_of_range_fail_no_request_and_draw_no_traffic(
    orch: OrchestratorServer, fake_agent: AgentFactory, sim_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    agents = {
        "p0": await fake_agent("p0", (await sim_engine()).url, "prefill", join=False),
        "d0": await fake_agent("d0", (await sim_engine()).url, "decode", join=False),
        "d1": await fake_agent("d1", (await sim_engine()).url, "decode", join=False),
    }
    for agent_id, agent in agents.items():
        agent.metrics = HONEST
        if agent_id == "d1":
            agent.metrics = MetricsSnapshot(
                scraped_at=1.0, num_running=0, tpot_s=-0.05, kv_cache_usage=math.nan
            )
        await agent.join()
    await eventually(
        lambda: len(orch.registry.snapshot().ready_decode.get(MODEL, ())) == 2, what="1P2D ready"
    )
    decoders = []
    for i in range(20):
        body = {"model": MODEL, "prompt": f"prompt {i}", "max_tokens": 3}
        async with http.post(f"{orch.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["text"] == expected_text(f"prompt {i}", 3)
            decoders.append(resp.headers["X-Disagg-Decode"])
    assert set(decoders) == {"d0"}, "d1's NaN KV use counts as full: it takes nothing"
    d1 = orch.registry.snapshot().by_id["d1"].metrics
    assert (d1.tpot_s, d1.kv_cache_usage) == (None, 1.0)
