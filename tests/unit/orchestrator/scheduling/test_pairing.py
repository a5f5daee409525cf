"""The transfer-pairing: P and D chosen together for the least predicted TTFT, KV transfer included
(docs/scheduler.md, "Joint choice of P and D")."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import MODEL, context, snapshot, view
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.scheduling.config import default_config_text, load_config
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins import pairing
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.filters import kv_compat, topology
from vllm_disagg.orchestrator.scheduling.predict import predicted_ttft
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.link_table import EMPTY_LINKS, LinkEstimate, LinkTable
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import MetricsSnapshot, Role

BYTES = 100_000.0  # KV bytes per token: 1,000 tokens are 100 MB
FAST, SLOW = 1e-11, 1e-9  # seconds per byte: 1 ms and 100 ms for 1,000 tokens


def inst(
    agent_id: str, role: Role, usage: float = 0.0, domain: str | None = None, block_size: int = 16
) -> InstanceView:
    """An idle ready instance with the given KV usage (a lower score), domain label and block size."""
    v = view(agent_id, role=role, block_size=block_size, metrics=MetricsSnapshot(kv_cache_usage=usage))
    labels = {"domain": domain} if domain is not None else {}
    return dataclasses.replace(v, info=dataclasses.replace(v.info, labels=labels))


def scheduler(*, pairing_on: bool = True, topology_models: list[str] | None = None) -> PluginScheduler:
    """The shipped config, with or without its pairing, the topology-filter on ``topology_models``."""
    doc: dict[str, Any] = yaml.safe_load(default_config_text())
    if not pairing_on:
        del doc["pairing"]
    for plugin in doc["plugins"]:
        if plugin["type"] == "topology-filter" and topology_models is not None:
            plugin["parameters"]["models"] = topology_models
    return PluginScheduler(load_config(yaml.safe_dump(doc), "t"))


def links(rates: Mapping[tuple[str, str], float], typical: Mapping[str, float] | None = None) -> LinkTable:
    return LinkTable(
        links=MappingProxyType({pd: LinkEstimate(s, 8, 0.0) for pd, s in rates.items()}),
        typical=MappingProxyType(dict(typical if typical is not None else {"any": FAST})),
        bytes_per_token=MappingProxyType({MODEL: BYTES}),
    )


def req(
    cached: Mapping[str, int] | None = None, slo_ttft_s: float | None = None, request_id: str = "r1"
) -> SchedulingRequest:
    return SchedulingRequest(
        request_id, MODEL, 1000, True, False, MappingProxyType(dict(cached or {})), slo_ttft_s=slo_ttft_s
    )


def with_links(
    snap: RegistrySnapshot, table: LinkTable, blocked: frozenset[tuple[str, str]] = frozenset()
) -> RegistrySnapshot:
    return dataclasses.replace(snap, links=table, blocked_links=blocked)


# The decode profile prefers d0 and the prefill profile p0 (lower KV usage); all predict the same TTFT.
TWO_BY_TWO = (
    inst("p0", "prefill"),
    inst("p1", "prefill", usage=0.1),
    inst("d0", "decode"),
    inst("d1", "decode", usage=0.1),
)
PAIRING = scheduler()


def explain(decision: Decision) -> dict[str, Any]:
    assert decision.explanation is not None
    return decision.explanation.to_json()


@pytest.mark.parametrize(
    ("table", "instances", "blocked", "pair"),
    [
        pytest.param(
            EMPTY_LINKS, TWO_BY_TWO, (), ("p0", "d0"), id="no-link-knowledge-keeps-the-profiles-pair"
        ),
        pytest.param(links({}), TWO_BY_TWO, (), ("p0", "d0"), id="equal-links-keep-the-profiles-pair"),
        pytest.param(
            links({}, {"any": SLOW}),
            TWO_BY_TWO,
            (),
            ("p0", "d0"),
            id="equally-slow-links-keep-the-profiles-pair",
        ),
        pytest.param(links({("p0", "d0"): SLOW}), TWO_BY_TWO, (), ("p1", "d0"), id="a-slow-p0-d0-moves-p"),
        pytest.param(
            links({("p0", "d0"): SLOW, ("p1", "d0"): SLOW}),
            TWO_BY_TWO,
            (),
            ("p0", "d1"),
            id="slow-links-into-d0-move-d",
        ),
        pytest.param(
            links({("p0", "d0"): 6e-11}),
            TWO_BY_TWO,
            (),
            ("p0", "d0"),
            id="a-gain-below-min-gain-keeps-the-pair",
        ),
        pytest.param(
            links({("p0", "d0"): SLOW, ("p1", "d0"): SLOW}),
            (*TWO_BY_TWO[:3], inst("d1", "decode", usage=0.5)),
            (),
            ("p0", "d0"),
            id="a-d-outside-the-slack-is-not-paired",
        ),
        pytest.param(
            links({("p0", "d0"): SLOW, ("p1", "d0"): SLOW}),
            TWO_BY_TWO,
            (("p0", "d1"),),
            ("p1", "d1"),
            id="a-blocked-link-is-never-the-pair",
        ),
        pytest.param(
            links({}, {"domain": FAST, "other": SLOW}),
            (inst("p0", "prefill"), inst("p1", "prefill", 0.1, "a"), inst("d0", "decode", domain="a")),
            (),
            ("p1", "d0"),
            id="an-unmeasured-link-takes-its-tiers-typical-rate",
        ),
    ],
)
def test_the_pair_of_least_predicted_ttft_is_chosen(
    table: LinkTable,
    instances: tuple[InstanceView, ...],
    blocked: tuple[tuple[str, str], ...],
    pair: tuple[str, str],
) -> None:
    d = PAIRING.decide(req(), with_links(snapshot(*instances), table, frozenset(blocked)), 0.0)
    assert (d.mode, d.prefill, d.decode) == ("disaggregated", *pair)
    shown = explain(d)
    assert (shown["decode"]["pick"], shown["prefill"]["pick"]) == ("d0", "p0"), "the profiles' own picks"
    assert ("pairs" in shown) is (table is not EMPTY_LINKS)


def test_a_pinned_decode_instance_is_kept_whatever_its_links() -> None:
    """The client pinned d0: slow links into it may move P, never D."""
    table = links({("p0", "d0"): SLOW, ("p1", "d0"): SLOW})
    pinned = dataclasses.replace(req(), pinned_decode="d0")
    d = PAIRING.decide(pinned, with_links(snapshot(*TWO_BY_TWO), table), 0.0)
    assert (d.mode, d.decode) == ("disaggregated", "d0")
    unpinned = PAIRING.decide(req(), with_links(snapshot(*TWO_BY_TWO), table), 0.0)
    assert unpinned.decode == "d1", "unpinned, the same links move D"


def test_the_explanation_lists_each_pair_with_its_transfer_time() -> None:
    d = PAIRING.decide(req(), with_links(snapshot(*TWO_BY_TWO), links({("p0", "d0"): SLOW})), 0.0)
    base = 1000 / 4096  # each P's predicted prefill of 1,000 uncached tokens at the default rate
    assert explain(d)["pairs"] == [
        {"prefill": "p0", "decode": "d0", "ttft_s": round(base + 0.1, 6), "transfer_s": 0.1, "picked": False},
        {
            "prefill": "p1",
            "decode": "d0",
            "ttft_s": round(base + 0.001, 6),
            "transfer_s": 0.001,
            "picked": True,
        },
        {
            "prefill": "p0",
            "decode": "d1",
            "ttft_s": round(base + 0.001, 6),
            "transfer_s": 0.001,
            "picked": False,
        },
        {
            "prefill": "p1",
            "decode": "d1",
            "ttft_s": round(base + 0.001, 6),
            "transfer_s": 0.001,
            "picked": False,
        },
    ]


def test_the_transfer_counts_against_the_ttft_target_when_colocating() -> None:
    """D caches 900 of 1,000 tokens: alone it is predicted 0.024 s; through P 0.244 s, which meets a
    0.25 s target, plus moving D's 100 uncached tokens' KV at 5 ns a byte (0.05 s), which does not."""
    instances = (inst("p0", "prefill"), inst("d0", "decode"))
    r = req(cached={"d0": 900}, slo_ttft_s=0.25)
    without = PAIRING.decide(r, snapshot(*instances), 0.0)
    assert without.mode == "disaggregated"
    slow = PAIRING.decide(r, with_links(snapshot(*instances), links({}, {"any": 5e-9})), 0.0)
    assert (slow.mode, slow.decode) == ("colocated", "d0")
    assert "0.050 s of it moving KV" in explain(slow)["decider"]["reason"]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        pytest.param({"width": 0}, "width must be >= 1", id="width-at-least-one"),
        pytest.param({"slack": -0.1}, "slack must be >= 0", id="slack-not-negative"),
        pytest.param({"minGainS": "x"}, "expected float", id="min-gain-a-number"),
    ],
)
def test_bad_pairing_parameters_are_config_errors(parameters: dict[str, object], message: str) -> None:
    doc: dict[str, Any] = yaml.safe_load(default_config_text())
    for plugin in doc["plugins"]:
        if plugin["type"] == pairing.TYPE:
            plugin["parameters"] = parameters
    with pytest.raises(ConfigError, match=message):
        load_config(yaml.safe_dump(doc), "t")


def test_pairing_must_name_a_pairing_plugin() -> None:
    doc: dict[str, Any] = yaml.safe_load(default_config_text())
    doc["pairing"] = "max-score-picker"
    with pytest.raises(ConfigError, match="pairing: 'max-score-picker' is a picker, not a pairing"):
        load_config(yaml.safe_dump(doc), "t")
    assert PLUGIN_SPECS[pairing.TYPE].kind == "pairing"
    assert load_config(default_config_text(), "d").pairing == pairing.TYPE


# Random clusters: P's and D's of two block sizes and two domains (some pairs may not exchange KV),
# random queues and KV usage, random link rates, blocked links and prefix caches.
_IDS = st.integers(2, 4)


@st.composite
def clusters(
    draw: st.DrawFn,
) -> tuple[tuple[InstanceView, ...], SchedulingRequest, LinkTable, frozenset[tuple[str, str]]]:
    views: list[InstanceView] = []
    for role, n in (("prefill", draw(_IDS)), ("decode", draw(_IDS))):
        for i in range(n):
            m = MetricsSnapshot(num_waiting=draw(st.integers(0, 3)), kv_cache_usage=draw(st.floats(0.0, 0.5)))
            v = view(f"{role[0]}{i}", role=role, block_size=draw(st.sampled_from([16, 16, 32])), metrics=m)  # type: ignore[arg-type]
            domain = draw(st.sampled_from(["a", "b"]))
            views.append(dataclasses.replace(v, info=dataclasses.replace(v.info, labels={"domain": domain})))
    pairs = [
        (p.agent_id, d.agent_id)
        for p in views
        if p.info.role == "prefill"
        for d in views
        if d.info.role == "decode"
    ]
    rates = draw(st.dictionaries(st.sampled_from(pairs), st.floats(1e-12, 1e-8), max_size=len(pairs)))
    blocked = frozenset(draw(st.lists(st.sampled_from(pairs), max_size=2)))
    cached = draw(
        st.dictionaries(st.sampled_from([v.agent_id for v in views]), st.integers(0, 1200), max_size=3)
    )
    table = links(rates, draw(st.sampled_from([{"any": FAST}, {"domain": FAST, "other": SLOW}])))
    r = req(cached=cached, request_id=draw(st.text("abc", min_size=1, max_size=4)))
    return tuple(views), r, table, blocked


def _ttft(snap: RegistrySnapshot, r: SchedulingRequest, p: str, d: str) -> float:
    pv, dv = snap.by_id[p], snap.by_id[d]
    transfer = pairing.transfer_time(snap, r, pv, dv)
    assert transfer is not None
    return predicted_ttft(pv, r, snap.in_flight_of(p)) + transfer


TOPOLOGY = scheduler(topology_models=["*"])
PLAIN = PluginScheduler(dataclasses.replace(TOPOLOGY.config, pairing=None))
_COMPAT = kv_compat.KvCompatFilter("k", kv_compat.Params())
_TOPOLOGY = topology.TopologyFilter("t", topology.Params(models=("*",)))


@settings(max_examples=100, deadline=None)
@given(clusters())
def test_the_chosen_pair_is_kept_compatible_and_no_slower_than_the_profiles_pair(
    cluster: tuple[tuple[InstanceView, ...], SchedulingRequest, LinkTable, frozenset[tuple[str, str]]],
) -> None:
    views, r, table, blocked = cluster
    snap = with_links(snapshot(*views), table, blocked)
    d = TOPOLOGY.decide(r, snap, 0.0)
    if d.prefill is None:
        return
    shown = explain(d)
    assert d.decode in {c["id"] for c in shown["decode"]["candidates"]}, "a D the decode profile kept"
    assert (d.prefill, d.decode) not in blocked
    partner = snap.by_id[d.decode]
    for f in (_COMPAT, _TOPOLOGY):
        ctx = context(snap, profile="prefill", partner=partner, req=r)
        assert [v.agent_id for v in f.filter(ctx, [snap.by_id[d.prefill]])] == [d.prefill], f.name
    own = (shown["prefill"]["pick"], shown["decode"]["pick"])
    assert _ttft(snap, r, d.prefill, d.decode) <= _ttft(snap, r, *own)
    assert [(p["prefill"], p["decode"]) for p in shown["pairs"] if p["picked"]] == [(d.prefill, d.decode)]


@settings(max_examples=60, deadline=None)
@given(
    clusters(), st.sampled_from([EMPTY_LINKS, LinkTable(bytes_per_token=MappingProxyType({MODEL: BYTES}))])
)
def test_without_link_knowledge_every_decision_and_explanation_is_unchanged(
    cluster: tuple[tuple[InstanceView, ...], SchedulingRequest, LinkTable, frozenset[tuple[str, str]]],
    table: LinkTable,
) -> None:
    views, r, _, blocked = cluster
    a = TOPOLOGY.decide(r, with_links(snapshot(*views), table, blocked), 0.0)
    b = PLAIN.decide(r, with_links(snapshot(*views), EMPTY_LINKS, blocked), 0.0)
    assert (a.mode, a.prefill, a.decode) == (b.mode, b.prefill, b.decode)
    assert explain(a) == explain(b)
