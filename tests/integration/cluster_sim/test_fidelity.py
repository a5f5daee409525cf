"""The cluster simulator agrees with the real-time simulated cluster (issue 13, part 5).

One seeded open-loop trace (a couple of hundred short prompts over 36 s, given as token ids) runs
through a real 2P2D cluster of simulated engines (``LocalCluster``: orchestrator, agents and engines
as processes, every engine sleeping its ``SimTiming``) and through the discrete-event simulator with
``from_sim_timing`` of the same timing and the same instance counts. Mean TTFT and mean TPOT must
agree within 10%, the client measuring each request as ``Outcome`` defines it: TTFT from the send to
the first streamed token, TPOT = (last token - first token) / (tokens - 1).

The load keeps the processes idle in the model's sleeps (a few hundred SSE chunks a second in all),
so on a busy 2-core machine the real cluster's times are the model's plus its own real-time overhead:
HTTP hops (client, gateway, both legs, the KV pull) and asyncio waking a little late after each
step's sleep, about 1-2 ms a step. Steps of 100 ms and a TTFT of about 0.6 s keep that overhead at a
few percent (measured: TTFT +1-5%, TPOT +0.5-2%); the 10% bound is the issue's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable

import pytest

from tests.helpers import free_port, free_ports
from vllm_disagg.cli.up import ClusterSpec as LocalSpec
from vllm_disagg.cli.up import LocalCluster
from vllm_disagg.cluster_sim.cluster import MODEL, Cluster, ClusterSpec, Outcome
from vllm_disagg.cluster_sim.fidelity import Measured, replay, token_request, token_trace
from vllm_disagg.cluster_sim.profile import from_sim_timing
from vllm_disagg.cluster_sim.trace import Trace, prompt_token_ids
from vllm_disagg.config import SimTiming
from vllm_disagg.model.sim import VOCAB_SIZE
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler

PREFILL, DECODE = 2, 2
# A prompt of 96 tokens costs ~0.1 s of prefill and ~0.2 s to pull; every step costs 0.1 s plus 1 ms
# per request in it. At 6 requests a second the decode batches hold ~7 requests each, and the prefill
# engines are about half busy: requests queue behind steps and share them, as they would on a GPU.
TIMING = SimTiming(
    prefill_s_per_token=0.001,
    decode_step_s=0.1,
    decode_step_s_per_seq=0.001,
    kv_transfer_s_per_token=0.002,
    max_num_seqs=64,
)
TOLERANCE = 0.10


def fidelity_trace() -> Trace:
    """~230 requests over 36 s: prompts of 32-160 random token ids, outputs of 8-32 tokens."""
    return token_trace(
        seed=7,
        rate_per_s=6.0,
        duration_s=36.0,
        prompt_tokens=(32, 160),
        output_tokens=(8, 32),
        vocab=VOCAB_SIZE,
    )


@pytest.mark.parametrize(
    "token_ids",
    [[0], [319, 0, 319], list(range(VOCAB_SIZE)), [31_999, 12_345]],
    ids=["one-token", "repeats", "the-sim-vocabulary", "the-traces-vocabulary"],
)
def test_a_token_request_carries_exactly_its_token_ids(token_ids: list[int]) -> None:
    request = token_request(1.5, token_ids, 7)
    assert prompt_token_ids(request) == token_ids
    assert (request.at_s, request.input_tokens, request.output_tokens) == (1.5, len(token_ids), 7)


def test_the_fidelity_trace_is_seeded_and_fits_the_simulated_models_vocabulary() -> None:
    trace = fidelity_trace()
    assert trace == fidelity_trace()
    assert 180 <= len(trace.requests) <= 280 and trace.duration_s <= 36.0
    assert all(max(prompt_token_ids(r)) < VOCAB_SIZE for r in trace.requests)


def simulated(trace: Trace) -> list[Outcome]:
    spec = ClusterSpec(PREFILL, DECODE, from_sim_timing(TIMING))
    return Cluster(spec, PluginScheduler()).run(trace)


async def measured(trace: Trace) -> list[Measured]:
    """The trace replayed against a real cluster of simulated engines, timed by its client."""
    engine_base = free_ports(PREFILL + DECODE, (0, 1000, 2000))  # engines, NIXL and KV-event ports
    timing = tuple((f.name, str(getattr(TIMING, f.name))) for f in dataclasses.fields(SimTiming))
    spec = LocalSpec(
        engine="sim", model=MODEL, prefill=PREFILL, decode=DECODE, port=free_port(),
        zmq_port=free_port(), engine_base_port=engine_base, stop_grace_s=5.0, sim_timing=timing,
    )  # fmt: skip
    cluster = LocalCluster(spec)
    try:
        await cluster.start()
        # Polls the admin API until every instance is ready; False at once if a process exits.
        assert await cluster.wait_ready(60.0), "not ready: see the captured output"
        return await replay(spec.base_url, trace, MODEL)
    finally:
        await cluster.stop()


def relative(real: float, model: float) -> float:
    return (real - model) / model


def mean(values: Iterable[float | None]) -> float:
    """The mean of values every request has (all outputs are longer than one token)."""
    present = list(values)
    assert None not in present
    return statistics.mean(v for v in present if v is not None)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_simulator_predicts_the_real_time_clusters_mean_ttft_and_tpot_within_10_percent() -> None:
    trace = fidelity_trace()
    sim = simulated(trace)
    real = await measured(trace)

    assert [o.request_id for o in sim] == [m.request_id for m in real]
    assert all(o.ok and o.mode == "disaggregated" for o in sim), [o for o in sim if not o.ok][:3]
    assert all(m.ok and m.mode == "disaggregated" for m in real), [m for m in real if not m.ok][:3]
    sim_ttft, sim_tpot = mean(o.ttft_s for o in sim), mean(o.tpot_s for o in sim)
    real_ttft, real_tpot = mean(m.ttft_s for m in real), mean(m.tpot_s for m in real)
    # Batching matters: the modelled decode batches average well over one request.
    assert sim_tpot > TIMING.decode_step_s + 4 * TIMING.decode_step_s_per_seq
    report = (
        f"{len(trace.requests)} requests, {PREFILL}P{DECODE}D: "
        f"mean TTFT real {real_ttft * 1000:.1f} ms, simulated {sim_ttft * 1000:.1f} ms "
        f"({relative(real_ttft, sim_ttft):+.1%}); "
        f"mean TPOT real {real_tpot * 1000:.2f} ms, simulated {sim_tpot * 1000:.2f} ms "
        f"({relative(real_tpot, sim_tpot):+.1%})"
    )
    print(report)
    assert abs(relative(real_ttft, sim_ttft)) <= TOLERANCE, report
    assert abs(relative(real_tpot, sim_tpot)) <= TOLERANCE, report
