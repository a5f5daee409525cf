"""No herding: a burst of streams spreads over equal decode instances, burst after burst.

Through the real gateway, with simulated engines whose metrics the agents' real scraper reads: each
burst's picks are made within one heartbeat, on the same metrics, so they can only spread if each
pick sees those made before it (the decision holds its decode instance from the decision on) and if
a queue a scrape saw during the last burst is not taken for one still there.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import wait_ready
from tests.integration.orchestrator_support import MODEL
from vllm_disagg import jsonutil
from vllm_disagg.config import SimTiming
from vllm_disagg.orchestrator.app import OrchestratorServer

BURSTS = 4
STREAMS = 24  # three batches of 8 (the sim's ``max_num_seqs``): 12 each fits in a pair of batches
# Even is 12/12; a herd is 24/0 or 23/1. Above 16 one instance queues a whole extra batch's worth
# while its peer has room: herding, not the noise of a loaded machine.
MOST_ON_ONE = 16


async def _stream(http: aiohttp.ClientSession, url: str, burst: int, n: int) -> str:
    body = {"model": MODEL, "prompt": f"burst {burst} stream {n}: a prompt all its own", "max_tokens": 12}
    body["stream"] = True
    async with http.post(f"{url}/v1/completions", data=jsonutil.dumps(body)) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
        return resp.headers["X-Disagg-Decode"]


async def test_bursts_of_streams_split_evenly_over_two_decode_instances_burst_after_burst(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    prefill = SimTiming(prefill_s_per_token=0.0002)
    decode = SimTiming(decode_step_s=0.01)
    for agent_id, role, timing in (
        ("prefill-0", "prefill", prefill),
        ("prefill-1", "prefill", prefill),
        ("decode-0", "decode", decode),
        ("decode-1", "decode", decode),
    ):
        engine = await sim_engine(engine_id=agent_id, timing=timing)
        agent = await fake_agent(agent_id, engine.url, role)
        agent.follow_metrics(engine.url)
    await wait_ready(orch, 2, 2)
    splits: list[dict[str, int]] = []
    for burst in range(BURSTS):
        picked = await asyncio.gather(*(_stream(http, orch.url, burst, n) for n in range(STREAMS)))
        split = Counter(picked)
        splits.append({d: split[d] for d in ("decode-0", "decode-1")})
    assert all(max(s.values()) <= MOST_ON_ONE for s in splits), splits
