"""Admission in the simulated cluster: the orchestrator's queue and fit, driven as the gateway drives
them, on virtual time. Every figure is virtual and every trace seeded: no test waits on a clock.

The cluster is built so that one stage binds and its capacity can be worked out: two prefill
instances, each computing a 400-token prompt in 0.1 s (0.25 ms a token, one prompt per 512-token
chunk), so about 20 prompts a second in all; two decode instances stream 20-token answers in batches
of up to 64 at about 10 ms a token, far more than that. Requests target a TTFT of 1 s.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from vllm_disagg.cluster_sim.classes import PriorityMix, TenantMix, with_classes
from vllm_disagg.cluster_sim.cluster import Cluster, ClusterSpec, Outcome
from vllm_disagg.cluster_sim.policies import make_scheduler
from vllm_disagg.cluster_sim.profile import EngineProfile
from vllm_disagg.cluster_sim.report import Slo, attainment, goodput, percentile
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest
from vllm_disagg.config import AdmissionConfig, OrchestratorConfig
from vllm_disagg.orchestrator.admission.policy import SHED_REASONS

PROMPT, OUTPUT = 400, 20
PROFILE = EngineProfile(
    "prefill-bound", block_size=16, num_blocks=1 << 16, max_num_seqs=64, max_batched_tokens=512,
    prefill_s_per_token=0.00025, decode_step_s=0.005, decode_step_s_per_seq=0.0001,
    kv_transfer_s_per_token=0.00001,
)  # fmt: skip
PREFILL = DECODE = 2
CAPACITY = PREFILL / (PROMPT * PROFILE.prefill_s_per_token)  # prompts a second the prefill pool computes
SLO = Slo(ttft_s=1.0, tpot_s=0.05)
SECONDS = 20.0


def steady(rate: float, seconds: float = SECONDS, seed: int = 1) -> Trace:
    """Poisson arrivals of equal requests with prompts of their own (no cache helps)."""
    rng = random.Random(seed)
    t, out = 0.0, list[TraceRequest]()
    blocks = -(-PROMPT // 16)
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return Trace("steady", out)
        n = len(out)
        out.append(TraceRequest(t, PROMPT, OUTPUT, tuple(range(n * blocks, (n + 1) * blocks)), 16))


def run(trace: Trace, *, admission: bool = True, policy: str = "least-loaded") -> Cluster:
    config = OrchestratorConfig(admission=AdmissionConfig(enabled=admission))
    spec = ClusterSpec(PREFILL, DECODE, PROFILE, config=config, slo_ttft_s=SLO.ttft_s, slo_tpot_s=SLO.tpot_s)
    cluster = Cluster(spec, make_scheduler(policy))
    cluster.run(trace)
    return cluster


def of(
    outcomes: Sequence[Outcome], *, priority: int | None = None, tenant: str | None = None
) -> list[Outcome]:
    return [
        o
        for o in outcomes
        if (priority is None or o.priority == priority) and (tenant is None or o.tenant == tenant)
    ]


def shed_share(outcomes: Sequence[Outcome]) -> float:
    return sum(1 for o in outcomes if o.shed_reason) / len(outcomes)


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin", "ours"])
def test_at_three_times_capacity_goodput_holds_with_admission_and_collapses_without(policy: str) -> None:
    trace = steady(3 * CAPACITY)
    off = run(trace, admission=False, policy=policy).outcomes
    on = run(trace, policy=policy).outcomes
    # Without admission the prefill queues grow by twice the capacity every second: after the first
    # second no arrival can start its prefill within its target, so at most about a second's worth of
    # the run's 20 meets it.
    assert goodput(off, SLO, trace.duration_s) < 0.15 * CAPACITY
    # With it, the excess waits in the gateway or is refused, and the engines only get what they can
    # start in time: the pool stays busy with requests that meet their targets.
    assert goodput(on, SLO, trace.duration_s) > 0.5 * CAPACITY
    assert {o.shed_reason for o in on if o.shed_reason} <= set(SHED_REASONS)


def test_what_admission_lets_through_meets_its_ttft() -> None:
    on = run(steady(3 * CAPACITY)).outcomes
    ttfts = [o.ttft_s for o in on if o.ok and o.ttft_s is not None]
    # Each admission is predicted to start in time on heartbeats up to 0.25 s old, and a drain counts
    # what it admitted on its pair before checking the next request (the registry does only once their
    # legs start): without that count one drain sent a pair every request routed to it, and the p99
    # TTFT of what was admitted was several seconds.
    assert percentile(ttfts, 0.99) < 1.25 * SLO.ttft_s
    assert any(o.queued_s for o in on if o.ok)  # some waited in the gateway, their wait in their TTFT


def test_below_capacity_admission_refuses_nothing_and_costs_no_attainment() -> None:
    trace = steady(0.6 * CAPACITY)
    off = run(trace, admission=False).outcomes
    on = run(trace).outcomes
    assert not [o for o in on if o.shed_reason]
    assert attainment(on, SLO) >= attainment(off, SLO) - 0.01


def test_every_request_ends_exactly_once_served_or_refused() -> None:
    trace = with_classes(
        steady(3 * CAPACITY), PriorityMix.parse("0.2:-1,0.6:0,0.2:1"), TenantMix.parse("a:1:0.75,b:1:0.25"), 0
    )
    cluster = run(trace)
    outcomes = cluster.outcomes
    assert len(outcomes) == len(trace.requests)
    for o in outcomes:
        assert o.end_s is not None, o
        if o.ok:
            assert (o.status, o.shed_reason) == (200, "") and o.ttft_s is not None
        else:  # refused before any engine saw it: no token, a 429 and why
            assert (o.status, o.ttft_s) == (429, None) and o.shed_reason in SHED_REASONS, o
    assert any(o.ok for o in outcomes) and any(o.shed_reason for o in outcomes)
    # Each answer counts once: had a request been answered twice, the run would have stopped at the
    # count's zero with another one unanswered (its end_s missing above); never, and it would not be 0.
    assert cluster.unanswered == 0
    assert cluster.admission is not None and cluster.admission.queue.depth() == 0
    assert not cluster.registry.snapshot().in_flight  # every leg admitted was released


def test_the_top_class_is_served_through_an_overload_the_sheddable_class_is_refused_first() -> None:
    mix = PriorityMix.parse("0.2:-1,0.6:0,0.2:1")
    heavy = run(with_classes(steady(3 * CAPACITY), mix, None, 0)).outcomes
    top, middle, low = (attainment(of(heavy, priority=p), SLO) for p in (-1, 0, 1))
    # The top class asks for 0.6 of the capacity and always heads the queue: it waits only for room.
    assert top > 0.9
    assert top > middle > low
    # Past capacity by a fifth, refusing the sheddable class (a fifth of the load) is almost enough:
    # refusals fall on it first, the top class loses none.
    mild = run(with_classes(steady(1.2 * CAPACITY), mix, None, 0)).outcomes
    assert shed_share(of(mild, priority=-1)) == 0
    assert shed_share(of(mild, priority=1)) > 5 * shed_share(of(mild, priority=0))
    assert any(o.shed_reason == "sheddable" for o in of(mild, priority=1))
    assert not any(o.shed_reason == "sheddable" for o in of(mild, priority=0) + of(mild, priority=-1))


def test_a_tenant_flooding_at_three_times_its_share_leaves_the_other_tenant_its_attainment() -> None:
    # Equal weights: each tenant's share is half the capacity. "a" sends three times its share, "b"
    # half of its own.
    a_rate, b_rate = 1.5 * CAPACITY, 0.25 * CAPACITY
    total = a_rate + b_rate
    tenants = TenantMix((("a", 1.0, a_rate / total), ("b", 1.0, b_rate / total)))
    trace = with_classes(steady(total), None, tenants, 0)
    alone = Trace("b alone", [r for r in trace.requests if r.tenant == "b"])
    b_alone = attainment(run(alone).outcomes, SLO)
    flooded = run(trace).outcomes
    # Fair sharing puts b's requests first while b is behind its share, so a's flood costs b little.
    assert attainment(of(flooded, tenant="b"), SLO) > b_alone - 0.05
    assert attainment(of(flooded, tenant="a"), SLO) < attainment(of(flooded, tenant="b"), SLO)
    # Without admission, b's requests queue in the engines behind a's and miss with them.
    unguarded = run(trace, admission=False).outcomes
    assert attainment(of(unguarded, tenant="b"), SLO) < 0.3
