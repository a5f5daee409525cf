"""The simulated cluster: the orchestrator's code routes, recovers and plans on virtual time. Every
figure here is virtual (no test waits on a real clock)."""

from __future__ import annotations

import random

import pytest

from vllm_disagg.cluster_sim.cluster import Cluster, ClusterSpec, Fault
from vllm_disagg.cluster_sim.policies import POLICIES, make_scheduler
from vllm_disagg.cluster_sim.profile import EngineProfile
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest
from vllm_disagg.config import AdmissionConfig, OrchestratorConfig
from vllm_disagg.orchestrator.planner.config import PlannerConfig

PROFILE = EngineProfile(
    "test", block_size=16, num_blocks=4096, max_num_seqs=16, prefill_s_per_token=0.0002,
    decode_step_s=0.01, decode_step_s_per_seq=0.0005, kv_transfer_s_per_token=0.00001,
)  # fmt: skip


# The planner's tests overload the short pool until it moves an instance: with admission (on by
# default, as in the orchestrator) the overload would wait in the gateway and some would be refused,
# where these tests want every request on an engine, its latency feeding the planner.
NO_ADMISSION = OrchestratorConfig(admission=AdmissionConfig(enabled=False))


def poisson(
    n: int, rate: float, *, prompt_blocks: int = 8, output: int = 40, docs: int = 0, seed: int = 1
) -> Trace:
    """``n`` requests; with ``docs``, each starts with one of ``docs`` shared documents of 6 blocks."""
    rng = random.Random(seed)
    t, out, fresh = 0.0, [], 10**6
    for _ in range(n):
        t += rng.expovariate(rate)
        shared = tuple(d * 100 + k for k in range(6)) if docs and (d := rng.randrange(docs)) >= 0 else ()
        own = tuple(range(fresh, fresh + prompt_blocks))
        fresh += prompt_blocks
        blocks = shared + own
        out.append(TraceRequest(t, 16 * len(blocks) - 3, output, blocks, 16))
    return Trace("test", out)


def run(spec: ClusterSpec, trace: Trace, policy: str = "ours") -> Cluster:
    cluster = Cluster(spec, make_scheduler(policy))
    cluster.run(trace)
    return cluster


def test_a_lone_request_goes_prefill_transfer_decode_in_the_time_its_profile_says() -> None:
    trace = Trace("one", [TraceRequest(0.0, 125, 10, tuple(range(8)), 16)])
    cluster = run(ClusterSpec(1, 1, PROFILE), trace)
    (out,) = cluster.outcomes
    assert out.ok and out.mode == "disaggregated" and (out.prefill, out.decode) == ("prefill-0", "decode-0")
    step = 0.01 + 0.0005
    prefill = 125 * 0.0002 + step
    assert out.ttft_s == pytest.approx(prefill + 125 * 0.00001 + step)
    assert out.tpot_s == pytest.approx(step)
    engines = cluster.engines
    assert engines["decode-0"].external_tokens == 125 and engines["decode-0"].computed_tokens == 0
    assert engines["prefill-0"].held_blocks == 0, "the decode engine pulled the KV: nothing stays held"


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_every_request_of_a_moderate_load(policy: str) -> None:
    cluster = run(ClusterSpec(2, 2, PROFILE), poisson(300, 20.0), policy)
    assert all(o.ok for o in cluster.outcomes) and len(cluster.outcomes) == 300
    assert {o.decode for o in cluster.outcomes} == {"decode-0", "decode-1"}


def test_ours_finds_shared_documents_in_the_prefix_caches_more_than_round_robin() -> None:
    # 40 documents of 6 blocks: more than one instance's cache holds (128 blocks), not more than four.
    trace = poisson(800, 30.0, prompt_blocks=1, docs=40)

    def hit_rate(policy: str) -> float:
        engines = run(ClusterSpec(4, 4, PROFILE.replace(num_blocks=128)), trace, policy).engines.values()
        cached = sum(e.cached_tokens for e in engines)
        return cached / (cached + sum(e.computed_tokens for e in engines))

    assert hit_rate("ours") > hit_rate("round-robin") + 0.1


def test_a_dead_decode_node_is_found_by_its_silence_and_no_request_fails() -> None:
    config = OrchestratorConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=1.0)
    fault = Fault(2.0, "node", "decode-0", for_s=3.0)
    cluster = Cluster(ClusterSpec(2, 2, PROFILE, config=config, faults=(fault,)), make_scheduler("ours"))
    seen: dict[str, str] = {}

    def look() -> None:
        view = cluster.registry.get("decode-0")
        seen.setdefault(view.state if view else "gone", f"{cluster.clock.now:.2f}")

    for t in (2.5, 3.2, 5.5, 6.0):
        cluster.loop.at(t, look)
    outcomes = cluster.run(poisson(400, 40.0, output=60))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok][:3]
    assert sum(o.resumes + o.retries for o in outcomes) > 0, "requests on it moved elsewhere"
    assert float(seen["dead"]) <= 2.0 + 1.0 + 0.25, "dead within the heartbeat timeout"
    assert "ready" in seen, "back after its recovery, in a new session"
    assert cluster.registry.get("decode-0").session == 2  # type: ignore[union-attr]
    late = [o for o in outcomes if o.arrival_s > 6.0]
    assert any(o.decode == "decode-0" for o in late), "routed to again once back"


def test_a_dead_prefill_engine_sends_its_requests_to_the_other_prefill_or_to_colocated() -> None:
    fault = Fault(1.0, "engine", "prefill-0")  # its agent reports it at once; it never comes back
    cluster = run(ClusterSpec(2, 2, PROFILE, faults=(fault,)), poisson(300, 40.0))
    outcomes = cluster.outcomes
    assert all(o.ok for o in outcomes)
    assert not any(o.prefill == "prefill-0" for o in outcomes if o.arrival_s > 1.05)
    view = cluster.registry.get("prefill-0")
    assert view is not None and view.state == "suspect" and view.engine_state == "restarting"


def test_a_slow_link_slows_the_kv_transfers_of_that_instance_only() -> None:
    trace = Trace("one", [TraceRequest(0.0, 125, 4, tuple(range(8)), 16)])
    fast = run(ClusterSpec(1, 1, PROFILE), trace).outcomes[0]
    slow = run(ClusterSpec(1, 1, PROFILE, faults=(Fault(0.0, "slow-link", "decode-0", slowdown=50),)), trace)
    assert slow.outcomes[0].ttft_s == pytest.approx(fast.ttft_s + 49 * 125 * 0.00001)  # type: ignore[operator]


def shifting_load() -> Trace:
    """Long prompts and short outputs: the prefill pool is the short one."""
    return poisson(900, 30.0, prompt_blocks=60, output=4, seed=3)


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_planner_moves_a_decode_instance_to_a_short_prefill_pool_unless_in_dry_run(dry_run: bool) -> None:
    planner = PlannerConfig(
        dry_run=dry_run, interval_s=1.0, window_s=10.0, ttft_target_s=0.3, tpot_target_s=1.0,
        sustain=2, cooldown_s=10.0, min_samples=10,
    )  # fmt: skip
    cluster = run(ClusterSpec(1, 3, PROFILE, config=NO_ADMISSION, planner=planner), shifting_load())
    if dry_run:
        assert cluster.shifts == []
    else:
        assert cluster.shifts and all(s[2:] == ("decode", "prefill") for s in cluster.shifts)
        moved = cluster.shifts[0][1]
        assert cluster.registry.get(moved).info.role == "prefill"  # type: ignore[union-attr]
    assert all(o.ok for o in cluster.outcomes)


def test_the_same_trace_and_seed_give_the_same_outcomes() -> None:
    def outcomes() -> list[tuple[str | None, str, float | None]]:
        cluster = run(ClusterSpec(3, 3, PROFILE), poisson(200, 50.0, docs=5))
        return [(o.prefill, o.decode, o.ttft_s) for o in cluster.outcomes]

    assert outcomes() == outcomes()
