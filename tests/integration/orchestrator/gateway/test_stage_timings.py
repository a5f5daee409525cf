"""A request's stage timings, in its record and as metrics, on real sockets with timed simulated engines:
the KV-transfer window (P's end to D's first token), the decode leg's own TTFT beside the client's, and
the gateway's own time; they add up to what the client saw (docs/metrics.md)."""

from __future__ import annotations

import aiohttp
import pytest

from tests.helpers import eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator_support import MODEL, request_record, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.config import SimTiming
from vllm_disagg.orchestrator.app import OrchestratorServer

PROMPT = "Stage timings add up to what the client saw, " * 2  # 90 tokens (the sim: one a byte)
TIMING = SimTiming(prefill_s_per_token=0.001, decode_step_s=0.02, kv_transfer_s_per_token=0.0005)


async def _ask(http: aiohttp.ClientSession, orch: OrchestratorServer, request_id: str, stream: bool) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    headers = {"X-Request-Id": request_id}
    async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(body), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def test_a_streams_stages_add_up_to_its_ttft_and_are_counted(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    p, d = await sim_engine(timing=TIMING), await sim_engine(timing=TIMING)
    await fake_agent("p0", p.url, "prefill")
    await fake_agent("d0", d.url, "decode")
    await eventually(lambda: len(orch.registry.snapshot().ready_decode.get(MODEL, ())) == 1, what="ready")
    await _ask(http, orch, "timed-stream", stream=True)
    await _ask(http, orch, "timed-whole", stream=False)
    record = await request_record(http, orch, "timed-stream")
    t, stages = record["timeline"], record["stages"]
    assert record["mode"] == "disaggregated"
    # The client's TTFT is its wait for the first leg, the prefill leg, then the transfer window.
    assert t["prefill_start"] + stages["prefill_s"] + stages["transfer_window_s"] == pytest.approx(
        stages["first_token_s"], abs=3e-6
    )
    assert stages["transfer_window_s"] == pytest.approx(
        stages["handoff_s"] + stages["decode_first_token_s"], abs=3e-6
    )
    tokens = record["explanation"]["request"]["prompt_tokens"]
    # D pulls the KV (0.5 ms a token) and takes one decode step before its first token.
    assert stages["decode_first_token_s"] >= tokens * TIMING.kv_transfer_s_per_token + TIMING.decode_step_s
    assert stages["prefill_s"] >= tokens * TIMING.prefill_s_per_token
    # The gateway's own time is what is left of the whole once the engine legs are taken out: the
    # decode leg lasted at least to its first token and at most to the request's end.
    total, prefill = record["total_s"], stages["prefill_s"]
    at_least, at_most = t["decode_start"] - prefill, total - prefill - stages["decode_first_token_s"]
    assert at_least - 1e-5 <= stages["gateway_s"] <= at_most + 1e-5, (stages, at_least, at_most)
    whole = (await request_record(http, orch, "timed-whole"))["stages"]
    assert "transfer_window_s" not in whole and "decode_first_token_s" not in whole, "no first token seen"
    samples = await scrape(http, orch.url)
    window = sample(samples, "vllm_disagg_kv_transfer_window_seconds_sum")
    assert sample(samples, "vllm_disagg_kv_transfer_window_seconds_count") == 1, "the stream only"
    assert window == pytest.approx(stages["transfer_window_s"], abs=1e-5)
    assert sample(samples, "vllm_disagg_decode_first_token_seconds_count") == 1
    decode_first = sample(samples, "vllm_disagg_decode_first_token_seconds_sum")
    assert decode_first == pytest.approx(stages["decode_first_token_s"], abs=1e-5)
