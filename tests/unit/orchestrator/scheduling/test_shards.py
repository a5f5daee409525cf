"""Hierarchical choice past ``shards.above`` eligible instances: a shard first, then instances in it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.errors import ConfigError, NoCapacity
from vllm_disagg.orchestrator.scheduling.config import default_config, default_config_text, load_config
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.scheduling.shards import ShardConfig, split
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import RegistrySnapshot
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role

NOW = 1000.0


def cluster(rows: Sequence[tuple[str, Role, Mapping[str, str], int]]) -> RegistrySnapshot:
    """Ready instances from (id, role, labels, engine queue) rows."""
    registry = Registry(heartbeat_timeout_s=1e9)
    for agent_id, role, labels, queue in rows:
        info = InstanceInfo(url=f"http://{agent_id}:8000", role=role, model="m", labels=dict(labels))
        registry.hello(agent_id, info, NOW)
        metrics = MetricsSnapshot(num_running=queue)
        registry.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready", metrics=metrics), NOW)
    return registry.snapshot()


def request(n: int, cached: Mapping[str, int] | None = None) -> SchedulingRequest:
    return SchedulingRequest(f"r{n}", "m", 400, False, True, cached or {}, cached is not None)


def explain(decision: Decision) -> dict[str, Any]:
    assert decision.explanation is not None
    return decision.explanation.to_json()


def unranked() -> PluginScheduler:
    """The shipped config where the ranked path steps aside (a required domain, a target, another
    picker...): these tests are of the shards it falls back to."""
    return PluginScheduler(dataclasses.replace(default_config(), ranked=False))


def with_shards(text: str) -> PluginScheduler:
    base = default_config_text().replace("ranked: true", "ranked: false")
    head = base[: base.index("shards:")]
    return PluginScheduler(load_config(head + text, "test"))


def test_labeled_instances_shard_by_label_and_the_others_in_groups_of_size() -> None:
    rows: list[tuple[str, Role, Mapping[str, str], int]] = [
        (f"a{i}", "decode", {"domain": "nvl-0"}, 0) for i in range(3)
    ]
    rows += [(f"b{i}", "decode", {"domain": "nvl-1"}, 0) for i in range(2)]
    rows += [(f"u{i}", "decode", {}, 0) for i in range(5)]
    snap = cluster(rows)
    ids = [r[0] for r in rows]
    shards = split(ids, snap.by_id, ShardConfig(size=2, above=4))
    assert shards is not None
    assert shards.groups == (("a0", "a1", "a2"), ("b0", "b1"), ("u0", "u1"), ("u2", "u3"), ("u4",))
    assert shards.names == ("domain=nvl-0", "domain=nvl-1", "#2", "#3", "#4")
    assert dict(shards.by_label) == {"nvl-0": 0, "nvl-1": 1}
    assert split(ids, snap.by_id, ShardConfig(above=len(ids))) is None, "small clusters stay flat"


def test_where_ranking_steps_aside_the_shipped_config_shards_labeled_domains_past_256() -> None:
    assert default_config().shards == ShardConfig(key="domain", size=0, fanout=2, above=256)

    def decode_trace(n: int, labeled: bool) -> dict[str, Any]:
        rows: list[tuple[str, Role, Mapping[str, str], int]] = [
            (f"d{i:03}", "decode", {"domain": f"nvl-{i % 4}"} if labeled else {}, 0) for i in range(n)
        ]
        snap = cluster([*rows, ("p", "prefill", {}, 0)])
        return dict(explain(unranked().decide(request(1), snap, NOW))["decode"])

    assert "shard" not in decode_trace(256, labeled=True), "at most 256: flat"
    assert "shard" not in decode_trace(400, labeled=False), "no label: a seeded window, no shards"
    shown = decode_trace(257, labeled=True)
    assert shown["shard"].startswith("domain=nvl-") and len(shown["candidates"]) == 16
    assert shown["eligible"] == 257


def test_the_prefill_profile_searches_the_chosen_decode_instances_domain_first() -> None:
    # 8 domains of 40 P's and 40 D's: the prefill pick must come from the decode pick's domain, though
    # nothing requires it (the topology filter is off) and P's elsewhere are as idle.
    rows: list[tuple[str, Role, Mapping[str, str], int]] = []
    for dom in range(8):
        rows += [(f"p{dom}-{i:02}", "prefill", {"domain": f"nvl-{dom}"}, 0) for i in range(40)]
        rows += [(f"d{dom}-{i:02}", "decode", {"domain": f"nvl-{dom}"}, 0) for i in range(40)]
    snap = cluster(rows)
    scheduler = unranked()
    domains = set()
    for n in range(40):
        decision = scheduler.decide(request(n), snap, NOW)
        assert decision.prefill is not None
        d_domain = snap.by_id[decision.decode].info.labels["domain"]
        assert snap.by_id[decision.prefill].info.labels["domain"] == d_domain
        assert explain(decision)["prefill"]["shard"] == f"domain={d_domain}"
        domains.add(d_domain)
    assert len(domains) >= 6, "the decode profile still spreads over the domains"


@pytest.mark.parametrize(("fanout", "low", "high"), [(1, 0.3, 0.6), (2, 0.65, 0.85)])
def test_of_fanout_shards_drawn_the_least_loaded_is_searched(fanout: int, low: float, high: float) -> None:
    # 40 shards of 8 decode instances, every other one loaded: one draw finds an idle shard half the
    # time; the less loaded of two, three times in four.
    rows: list[tuple[str, Role, Mapping[str, str], int]] = [
        (f"d{i:03}", "decode", {}, 20 if (i // 8) % 2 else 0) for i in range(320)
    ]
    snap = cluster([*rows, ("p", "prefill", {}, 0)])
    scheduler = with_shards(f"shards: {{size: 8, fanout: {fanout}, above: 256}}\n")
    idle = sum(
        snap.by_id[scheduler.decide(request(n), snap, NOW).decode].metrics.num_running == 0
        for n in range(400)
    )
    assert low <= idle / 400 <= high


def test_a_prefix_holder_outside_the_chosen_shard_is_still_scored_and_wins() -> None:
    rows: list[tuple[str, Role, Mapping[str, str], int]] = [
        (f"p{i:03}", "prefill", {}, 0) for i in range(300)
    ]
    snap = cluster([*rows, ("d", "decode", {}, 0)])
    scheduler = with_shards("shards: {size: 16}\n")
    for n in range(30):
        decision = scheduler.decide(request(n, {"p123": 384}), snap, NOW)
        assert decision.prefill == "p123"
        assert explain(decision)["prefill"]["shard"].startswith("#")
        assert explain(decision)["prefill"]["candidates"][0]["id"] == "p123"


def test_a_sharded_decision_is_a_pure_function_of_request_and_snapshot() -> None:
    snap = cluster([(f"x{i:03}", "both", {}, i % 7) for i in range(400)])
    first, second = with_shards("shards: {size: 16}\n"), with_shards("shards: {size: 16}\n")
    for n in range(50):
        a, b = first.decide(request(n), snap, NOW), second.decide(request(n), snap, NOW)
        assert (a.mode, a.prefill, a.decode) == (b.mode, b.prefill, b.decode)
        assert first.decide(request(n), snap, NOW).decode == a.decode, "the load memo changes nothing"


@pytest.mark.parametrize(
    ("section", "error"),
    [
        ("shards: {fanout: 5}\n", "shards: fanout must be 1 to 4, got 5"),
        ("shards: {size: 1}\n", "shards: size must be 0 or >= 2, got 1"),
        ("shards: {key: Bad Key}\n", "key must be a label key"),
        ("shards: {width: 3}\n", "shards.width: unknown parameter of shards"),
        ("shards: [1]\n", "shards: expected a mapping"),
    ],
)
def test_a_bad_shards_section_is_refused_with_where_and_why(section: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        with_shards(section)


def test_without_a_shards_section_every_profile_stays_flat() -> None:
    base = default_config_text()
    config = load_config(base[: base.index("shards:")], "test")
    assert config.shards is None
    rows: list[tuple[str, Role, Mapping[str, str], int]] = [
        (f"d{i:03}", "decode", {"domain": f"nvl-{i % 4}"}, 0) for i in range(300)
    ]
    snap = cluster([*rows, ("p", "prefill", {}, 0)])
    assert "shard" not in explain(PluginScheduler(config).decide(request(1), snap, NOW))["decode"]


# Small random clusters sharded past 4 eligible instances, so that hypothesis explores the hierarchy
# without building hundreds of instances per example.
def sharded_scheduler(size: int, required: bool, shards: bool = True) -> PluginScheduler:
    doc: dict[str, Any] = yaml.safe_load(default_config_text())
    for plugin in doc["plugins"]:
        if plugin["type"] == "topology-filter" and required:
            plugin["parameters"]["models"] = ["m"]
    for profile in doc["profiles"]:
        profile["maxCandidates"] = 3  # fewer than the instances: windows, not everyone
    doc["ranked"] = False
    if shards:
        doc["shards"] = {"size": size, "fanout": 2, "above": 4}
    else:
        del doc["shards"]
    return PluginScheduler(load_config(yaml.safe_dump(doc), "t"))


CLUSTERS = st.lists(
    st.tuples(
        st.sampled_from(["prefill", "decode", "both"]),
        st.sampled_from(["a", "b", "c", None]),
        st.integers(0, 40),  # engine queue
    ),
    min_size=5,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(CLUSTERS, st.integers(0, 10**6), st.sampled_from([0, 2, 3]))
def test_sharded_a_required_domain_is_never_crossed(
    specs: list[tuple[Role, str | None, int]], seed: int, size: int
) -> None:
    snap = cluster(
        [(f"i{n:02}", role, {"domain": d} if d else {}, q) for n, (role, d, q) in enumerate(specs)]
    )
    try:
        decision = sharded_scheduler(size, required=True).decide(request(seed), snap, NOW)
    except NoCapacity:
        return  # no D with a P in its domain: refused, never crossed
    if decision.prefill is not None:
        domain = snap.by_id[decision.prefill].info.labels.get("domain")
        assert domain is not None and snap.by_id[decision.decode].info.labels.get("domain") == domain


@settings(max_examples=150, deadline=None)
@given(CLUSTERS, st.integers(0, 10**6), st.booleans())
def test_when_one_domain_holds_everything_the_hierarchical_pick_is_the_flat_pick(
    specs: list[tuple[Role, str | None, int]], seed: int, labeled: bool
) -> None:
    # Every instance in domain "a" (or, unlabeled, every one in the single group of size 0): one shard.
    rows = [(f"i{n:02}", role, {"domain": "a"} if labeled else {}, q) for n, (role, _, q) in enumerate(specs)]
    snap = cluster(rows)
    if not any(role != "prefill" for role, _, _ in specs):
        return
    hierarchical = sharded_scheduler(0, required=False).decide(request(seed), snap, NOW)
    flat = sharded_scheduler(0, required=False, shards=False).decide(request(seed), snap, NOW)
    assert (hierarchical.mode, hierarchical.prefill, hierarchical.decode) == (
        flat.mode,
        flat.prefill,
        flat.decode,
    )
