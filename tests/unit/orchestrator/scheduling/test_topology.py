"""Topology: the topology-filter (``required``: P and D never across domains) and the topology-scorer
(``preferred``), as the plugin scheduler runs them (docs/scheduler.md, "Topology")."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import MODEL, context, request, snapshot, view
from vllm_disagg.errors import BadRequest, ConfigError
from vllm_disagg.orchestrator.scheduling.config import default_config_text, load_config
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins.filters import topology as topology_filter
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import Role


def inst(agent_id: str, role: Role, domain: str | None = None, zone: str | None = None) -> InstanceView:
    """A ready instance with the given domain and zone labels (None: no such label)."""
    v = view(agent_id, role=role)
    labels = {k: x for k, x in (("domain", domain), ("zone", zone)) if x is not None}
    return dataclasses.replace(v, info=dataclasses.replace(v.info, labels=labels))


def scheduler(
    models: list[str] | None = None, weight: float = 0.0, drop_scorer: bool = False
) -> PluginScheduler:
    """The shipped config with the topology-filter on ``models`` and the topology-scorer's weight."""
    doc: dict[str, Any] = yaml.safe_load(default_config_text())
    for plugin in doc["plugins"]:
        if plugin["type"] == "topology-filter" and models is not None:
            plugin["parameters"]["models"] = models
    for profile in doc["profiles"]:
        refs = profile["plugins"]
        profile["plugins"] = [r for r in refs if not (drop_scorer and r["pluginRef"] == "topology-scorer")]
        for ref in profile["plugins"]:
            if ref["pluginRef"] == "topology-scorer":
                ref["weight"] = weight
    return PluginScheduler(load_config(yaml.safe_dump(doc), "t"))


REQUIRED = scheduler([MODEL])


def decide(s: PluginScheduler, *views: InstanceView, req: SchedulingRequest | None = None) -> Decision:
    return s.decide(req if req is not None else request(), snapshot(*views), 0.0)


def filtered(decision: Decision, profile: str) -> list[dict[str, str]]:
    assert decision.explanation is not None
    trace = decision.explanation.to_json()[profile]
    assert isinstance(trace, dict)
    return [f for f in trace["filtered"] if f["filter"] == "topology-filter"]


@pytest.mark.parametrize(
    ("partner", "candidates", "kept"),
    [
        pytest.param(inst("d", "decode", "a"), ["a", "b", None], ["c0"], id="only-the-partners-domain"),
        pytest.param(inst("d", "decode", None), ["a", "b"], [], id="an-unlabeled-partner-pairs-with-none"),
        pytest.param(inst("d", "decode", "a"), [None, None], [], id="unlabeled-candidates-are-never-paired"),
        pytest.param(inst("d", "decode", "c"), ["a", "b"], [], id="nothing-in-the-domain-keeps-nothing"),
    ],
)
def test_the_prefill_profile_keeps_p_only_in_ds_domain(
    partner: InstanceView, candidates: list[str | None], kept: list[str]
) -> None:
    views = [inst(f"c{i}", "prefill", d) for i, d in enumerate(candidates)]
    f = topology_filter.TopologyFilter("t", topology_filter.Params(models=("*",)))
    ctx = context(snapshot(partner, *views), profile="prefill", partner=partner)
    assert [v.agent_id for v in f.filter(ctx, views)] == kept


@pytest.mark.parametrize(
    ("views", "mode", "prefill", "decode"),
    [
        pytest.param(
            [inst("p-a", "prefill", "a"), inst("d-b", "decode", "b"), inst("d-a", "decode", "a")],
            "disaggregated", "p-a", "d-a", id="d-is-chosen-where-a-p-shares-its-domain",
        ),
        pytest.param(
            [inst("p-a", "prefill", "a"), inst("d-b", "decode", "b")],
            "colocated", None, "d-b", id="no-pair-fits-so-colocated",
        ),
        pytest.param(
            [inst("p", "prefill"), inst("d", "decode")],
            "colocated", None, "d", id="unlabeled-instances-are-never-paired",
        ),
        pytest.param(
            [inst("p", "prefill", "a"), inst("d", "decode")],
            "colocated", None, "d", id="an-unlabeled-d-is-never-paired",
        ),
    ],
)  # fmt: skip
def test_required_decisions(views: list[InstanceView], mode: str, prefill: str | None, decode: str) -> None:
    decision = decide(REQUIRED, *views)
    assert (decision.mode, decision.prefill, decision.decode) == (mode, prefill, decode)


def test_a_model_not_listed_is_paired_across_domains() -> None:
    decision = decide(scheduler(["other-model"]), inst("p-a", "prefill", "a"), inst("d-b", "decode", "b"))
    assert (decision.mode, decision.prefill) == ("disaggregated", "p-a")
    assert filtered(decision, "prefill") == []


def test_the_explanation_says_why_each_p_was_filtered() -> None:
    decision = decide(REQUIRED, inst("p-a", "prefill", "a"), inst("p", "prefill"), inst("d-b", "decode", "b"))
    assert decision.mode == "colocated"
    reasons = {f["id"]: f["reason"] for f in filtered(decision, "prefill")}
    assert reasons == {"p-a": "not in d-b's domain b", "p": "no domain label"}


def test_a_pinned_prefill_instance_gets_a_d_in_its_domain_or_a_bad_request() -> None:
    views = [inst("p-a", "prefill", "a"), inst("d-a", "decode", "a"), inst("d-b", "decode", "b")]
    pinned = dataclasses.replace(request(), pinned_prefill="p-a")
    assert decide(REQUIRED, *views, req=pinned).decode == "d-a"
    with pytest.raises(BadRequest, match="topology-filter kept 0 of 1"):
        decide(REQUIRED, *views[::2], req=pinned)
    with pytest.raises(BadRequest, match="cannot exchange KV"):
        decide(REQUIRED, *views, req=dataclasses.replace(pinned, pinned_decode="d-b"))


DOMAIN = st.sampled_from(["a", "b", "c", None])
INSTANCES = st.lists(
    st.tuples(st.sampled_from(["prefill", "decode", "both"]), DOMAIN, st.sampled_from(["z1", "z2", None])),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(INSTANCES, st.integers(min_value=0, max_value=10**6), st.booleans())
def test_a_required_domain_is_never_crossed(
    specs: list[tuple[Role, str | None, str | None]], seed: int, preferred: bool
) -> None:
    views = [inst(f"i{n}", role, domain, zone) for n, (role, domain, zone) in enumerate(specs)]
    if not any(v.info.role != "prefill" for v in views):
        return  # nothing can decode: not a topology question
    s = scheduler([MODEL], weight=1.0) if preferred else REQUIRED
    decision = decide(s, *views, req=request(f"r{seed}"))
    if decision.prefill is not None:
        labels = snapshot(*views).by_id
        domain = labels[decision.prefill].info.labels.get("domain")
        assert domain is not None, "an unlabeled instance was paired"
        assert labels[decision.decode].info.labels.get("domain") == domain


@pytest.mark.parametrize("request_id", [f"r{n}" for n in range(20)])
def test_preferred_picks_the_in_domain_p_when_otherwise_equal(request_id: str) -> None:
    views = [
        inst("p-out", "prefill", "b", "z2"),
        inst("p-zone", "prefill", "c", "z1"),
        inst("p-in", "prefill", "a", "z1"),
        inst("d", "decode", "a", "z1"),
    ]
    decision = decide(scheduler(weight=1.0), *views, req=request(request_id))
    assert decision.prefill == "p-in"
    views = [v for v in views if v.agent_id != "p-in"]
    assert decide(scheduler(weight=1.0), *views, req=request(request_id)).prefill == "p-zone"


def test_the_shipped_weight_0_scorer_changes_no_decision_nor_explanation() -> None:
    views = [inst("p-a", "prefill", "a"), inst("p-b", "prefill", "b"), inst("d", "decode", "b")]
    for n in range(10):
        shipped, without = (
            decide(s, *views, req=request(f"r{n}")) for s in (scheduler(), scheduler(drop_scorer=True))
        )
        assert shipped.explanation is not None and without.explanation is not None
        assert shipped.explanation.to_json() == without.explanation.to_json()


@pytest.mark.parametrize(
    ("plugin", "parameters", "message"),
    [
        pytest.param("topology-filter", {"models": "m"}, "models must be a list", id="models-not-a-list"),
        pytest.param("topology-filter", {"domainKey": "Bad Key"}, "domainKey must be a label", id="bad-key"),
        pytest.param("topology-scorer", {"zoneScore": 1.5}, "zone_score must be <= 1", id="zone-score-1.5"),
        pytest.param("topology-scorer", {"zoneKey": ""}, "zoneKey must be a label key", id="empty-zone-key"),
    ],
)  # fmt: skip
def test_bad_topology_parameters_are_refused(
    plugin: str, parameters: dict[str, object], message: str
) -> None:
    doc: dict[str, Any] = yaml.safe_load(default_config_text())
    next(p for p in doc["plugins"] if p["type"] == plugin)["parameters"] = parameters
    with pytest.raises(ConfigError, match=message):
        load_config(yaml.safe_dump(doc), "t")
