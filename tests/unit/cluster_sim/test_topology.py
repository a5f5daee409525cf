"""The simulator's topology preset (placement, labels, link rates), its slow-link faults, and the
policy variants of the topology evidence."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from vllm_disagg.cli.commands import main
from vllm_disagg.cluster_sim.cli import parse_fault
from vllm_disagg.cluster_sim.faults import SlowLinks, target_problem
from vllm_disagg.cluster_sim.policies import variant_config
from vllm_disagg.cluster_sim.topology import (
    CROSS_RACK_SHARE,
    DOMAIN_GBPS,
    KV_BYTES_PER_TOKEN,
    RACK_GBPS,
    Location,
    Topology,
    labels_of,
    parse_shape,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.scheduling.config import default_config


def test_the_default_kv_size_is_llama3_8b_in_bf16() -> None:
    assert KV_BYTES_PER_TOKEN == 128 * 1024


def test_placement_fills_racks_and_nodes_with_both_roles_in_proportion() -> None:
    where = Topology(4, 8, 8).place(128, 128)
    assert len(where) == 256 and len(set(where.values())) == 256  # one GPU each
    per_node = Counter((loc.node, name.split("-")[0]) for name, loc in where.items())
    assert set(per_node.values()) == {4}  # 4 P's and 4 D's on each of 32 nodes
    assert len({loc.rack for loc in where.values()}) == 4
    assert where["prefill-0"] == Location("r0", "r0n0", 0)
    assert where["decode-127"].rack == "r3"


def test_an_uneven_mix_spreads_the_smaller_role_over_the_racks() -> None:
    where = Topology(2, 2, 4).place(4, 12)
    assert Counter(where[f"prefill-{i}"].rack for i in range(4)) == {"r0": 2, "r1": 2}


def test_a_cluster_larger_than_the_topology_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="do not fit 1x2x4"):
        Topology(1, 2, 4).place(5, 4)


@pytest.mark.parametrize(
    ("p", "d", "gbps"),
    [
        pytest.param(("r0", "r0n0"), ("r0", "r0n0"), DOMAIN_GBPS, id="same-node-nvlink"),
        pytest.param(("r0", "r0n0"), ("r0", "r0n1"), RACK_GBPS, id="same-rack-nic"),
        pytest.param(("r0", "r0n0"), ("r1", "r1n0"), RACK_GBPS * CROSS_RACK_SHARE, id="cross-rack-spine"),
    ],
)
def test_a_link_runs_at_its_tiers_rate(p: tuple[str, str], d: tuple[str, str], gbps: float) -> None:
    assert Topology(2, 2, 8).gbps(Location(*p, 0), Location(*d, 1)) == gbps


def test_labels_name_the_rack_as_zone_and_the_node_as_node_and_domain() -> None:
    assert labels_of(Location("r1", "r1n3", 2)) == {"zone": "r1", "node": "r1n3", "domain": "r1n3"}


@pytest.mark.parametrize(
    ("text", "shape"),
    [pytest.param("4x8x8", (4, 8, 8), id="preset"), pytest.param("16x80x8", (16, 80, 8), id="10k-gpus")],
)
def test_a_shape_parses(text: str, shape: tuple[int, int, int]) -> None:
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text", ["4x8", "0x8x8", "4x8x8x1", "fourx8x8"])
def test_a_malformed_shape_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="RACKSxNODESxGPUS"):
        parse_shape(text)


@pytest.mark.parametrize(
    ("text", "target", "at", "for_s", "factor"),
    [
        pytest.param("slow-link:prefill-0->decode-1@5x8", "prefill-0->decode-1", 5.0, None, 8.0, id="link"),
        pytest.param("slow-link:r2@30+60x4", "r2", 30.0, 60.0, 4.0, id="rack-uplink"),
        pytest.param("slow-link:r0n3@0", "r0n3", 0.0, None, 10.0, id="node-uplink-default-factor"),
    ],
)
def test_a_slow_link_fault_parses(
    text: str, target: str, at: float, for_s: float | None, factor: float
) -> None:
    fault = parse_fault(text)
    assert (fault.kind, fault.instance, fault.at_s, fault.for_s, fault.slowdown) == (
        "slow-link", target, at, for_s, factor,
    )  # fmt: skip


WHERE = Topology(2, 2, 2).place(4, 4)  # r0n0: prefill-0, decode-0; r0n1: prefill-1, decode-1; ...
INSTANCES = set(WHERE)


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        pytest.param("decode-0", None, id="instance"),
        pytest.param("prefill-0->decode-3", None, id="link"),
        pytest.param("r1", None, id="rack"),
        pytest.param("r1n1", None, id="node"),
        pytest.param("prefill-0->prefill-0", "no link", id="link-to-itself"),
        pytest.param("prefill-9->decode-0", "no link", id="link-of-unknown-instance"),
        pytest.param("r7", "no instance, link or place", id="unknown-rack"),
    ],
)
def test_a_slow_link_target_must_exist(target: str, problem: str | None) -> None:
    found = target_problem(target, INSTANCES, WHERE)
    assert found is None if problem is None else problem in (found or "")


def test_racks_and_nodes_need_a_topology() -> None:
    assert "need --topology" in (target_problem("r0", INSTANCES, {}) or "")


@pytest.mark.parametrize(
    ("target", "p", "d", "factor"),
    [
        pytest.param("prefill-0->decode-0", "prefill-0", "decode-0", 5.0, id="the-link"),
        pytest.param("prefill-0->decode-0", "prefill-1", "decode-0", 1.0, id="another-link-to-the-same-d"),
        pytest.param("decode-0", "prefill-3", "decode-0", 5.0, id="an-instance-both-ways"),
        pytest.param("r0n0", "prefill-0", "decode-0", 1.0, id="node-uplink-spares-nvlink"),
        pytest.param("r0n0", "prefill-1", "decode-0", 5.0, id="node-uplink-into-the-node"),
        pytest.param("r0", "prefill-1", "decode-0", 1.0, id="rack-uplink-spares-the-rack"),
        pytest.param("r0", "prefill-2", "decode-0", 5.0, id="rack-uplink-across-racks"),
    ],
)
def test_a_transfer_is_slowed_by_the_faults_on_its_way(target: str, p: str, d: str, factor: float) -> None:
    slow = SlowLinks(WHERE)
    slow.slow(target, 5.0)
    assert slow.factor(p, d) == factor
    slow.restore(target)
    assert slow.factor(p, d) == 1.0


def _topology_weights(name: str) -> set[float]:
    config = variant_config(name, default_config())
    return {w for prof in config.profiles.values() for ref, w in prof.scorers if ref == "topology-scorer"}


@pytest.mark.parametrize(
    ("name", "pairing", "topology_weight"),
    [
        pytest.param("today", None, 0.0, id="today-no-pairing"),
        pytest.param("joint", "transfer-pairing", 0.0, id="joint-shipped"),
        pytest.param("joint-topo", "transfer-pairing", 1.0, id="joint-topo-scores-topology"),
    ],
)
def test_policy_variants_of_the_shipped_scheduler(
    name: str, pairing: str | None, topology_weight: float
) -> None:
    assert variant_config(name, default_config()).pairing == pairing
    assert _topology_weights(name) == {topology_weight}


def test_a_small_cluster_is_spread_over_every_rack() -> None:
    where = Topology(4, 8, 8).place(32, 32)
    assert Counter(loc.rack for loc in where.values()) == {f"r{r}": 16 for r in range(4)}
    per_node = Counter((loc.node, name.split("-")[0]) for name, loc in where.items())
    assert len({node for node, _ in per_node}) == 8 and set(per_node.values()) == {4}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--fault", "slow-link:r0@1"], "need --topology", id="rack-without-topology"),
        pytest.param(["--topology", "1x1x1"], "do not fit 1x1x1", id="too-small"),
        pytest.param(
            ["--topology", "1x1x2", "--fault", "slow-link:r1@1"], "no instance, link or place", id="no-rack"
        ),
    ],
)
def test_topology_flags_that_cannot_work_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--synthetic", "prefix", "--prefill", "1", "--decode", "1", "--requests", "5", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
