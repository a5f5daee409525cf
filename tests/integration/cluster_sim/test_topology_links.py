"""A simulated cluster with a topology learns its KV links as the orchestrator does (``LinkRates`` on
the decode engines' counters), and the joint P/D pairing routes around a slowed link that the
scheduler of today, ranking P and D apart, keeps using. Virtual time: the run takes a second or two."""

from __future__ import annotations

import random

from vllm_disagg.cluster_sim.cluster import Cluster, ClusterSpec, Fault, Outcome
from vllm_disagg.cluster_sim.policies import scheduler_for
from vllm_disagg.cluster_sim.profile import H100_LLAMA3_8B
from vllm_disagg.cluster_sim.topology import Topology
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest
from vllm_disagg.orchestrator.scheduling.config import default_config
from vllm_disagg.orchestrator.state.link_rates import gbps

SLOW = ("prefill-0", "decode-0")
# Four GPUs of one node (NVLink, 3,600 Gb/s); the one link slowed 100 times: a 4,096-token prompt's KV
# (512 MiB) takes 1.2 ms on the others and 120 ms on it.
SPEC = ClusterSpec(
    2,
    2,
    H100_LLAMA3_8B,
    topology=Topology(1, 1, 4),
    faults=(Fault(0.0, "slow-link", "->".join(SLOW), slowdown=100),),
)


def trace(n: int = 160, rate: float = 4.0) -> Trace:
    """Prompts of 4,096 tokens that share nothing (so no prefix pulls a request to one instance)."""
    rng = random.Random(7)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, 4096, 32, tuple(range(i * 1000, i * 1000 + 256)), 16))
    return Trace("unique", out)


def run(policy: str) -> tuple[Cluster, list[Outcome]]:
    cluster = Cluster(SPEC, scheduler_for(policy, default_config()))
    return cluster, cluster.run(trace())


def across(outcomes: list[Outcome]) -> int:
    return sum(1 for o in outcomes if o.ok and (o.prefill, o.decode) == SLOW)


def test_joint_pairing_learns_the_slow_link_and_sends_fewer_requests_across_it() -> None:
    _, today_out = run("today")
    joint, joint_out = run("joint")
    assert all(o.ok for o in today_out + joint_out)
    # Today's picks ignore the link: about a quarter of the requests take it.
    assert across(today_out) >= len(today_out) // 8
    # Joint pairing prices it once measured: a few requests teach it, then it is avoided.
    assert across(joint_out) <= across(today_out) // 2
    links = joint.registry.snapshot().links
    slow = links.links.get(SLOW)
    assert slow is not None and gbps(slow.s_per_byte) < 3600 / 20  # learned as far slower than NVLink
    assert links.bytes_per_token["sim-model"] == H100_LLAMA3_8B.kv_bytes_per_token
    assert links.typical["domain"] > 0
