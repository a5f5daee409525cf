"""Scheduling filters: which candidates each filter keeps, and that the catalog registers them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import context, snapshot, view
from vllm_disagg.orchestrator.scheduling.framework import Filter, ProfileName
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.filters import kv_compat, kv_usage, ready, role
from vllm_disagg.orchestrator.state.registry import InstanceState, Registry
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role

ROLES: tuple[Role, ...] = ("prefill", "decode", "both")


def ids(kept: Sequence[InstanceView]) -> list[str]:
    return [c.agent_id for c in kept]


# --- role-filter -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "kept"),
    [
        pytest.param("decode", ["decode", "both"], id="the decode profile keeps decode and both instances"),
        pytest.param(
            "prefill", ["prefill", "both"], id="the prefill profile keeps prefill and both instances"
        ),
    ],
)
def test_role_filter_keeps_the_roles_of_the_profile(profile: ProfileName, kept: list[str]) -> None:
    candidates = [view(r, role=r) for r in ROLES]
    f = role.RoleFilter("roles", role.Params())
    assert ids(f.filter(context(snapshot(*candidates), profile=profile), candidates)) == kept


# --- ready-filter ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReadyCase:
    state: InstanceState
    agent_draining: bool = False
    admin_draining: bool = False


@pytest.mark.parametrize(
    ("case", "kept"),
    [
        pytest.param(ReadyCase("ready"), True, id="a ready instance passes"),
        pytest.param(ReadyCase("joining"), False, id="a joining instance is filtered out"),
        pytest.param(
            ReadyCase("draining", agent_draining=True), False, id="a draining instance is filtered out"
        ),
        pytest.param(ReadyCase("dead"), False, id="a dead instance is filtered out"),
        pytest.param(
            ReadyCase("ready", agent_draining=True),
            False,
            id="a ready instance whose agent reports draining is filtered out",
        ),
        pytest.param(
            ReadyCase("ready", admin_draining=True),
            False,
            id="a ready instance an operator drained is filtered out",
        ),
    ],
)
def test_ready_filter(case: ReadyCase, kept: bool) -> None:
    candidate = view(
        "x", state=case.state, agent_draining=case.agent_draining, admin_draining=case.admin_draining
    )
    f = ready.ReadyFilter("ready", ready.Params())
    assert ids(f.filter(context(snapshot(candidate)), [candidate])) == (["x"] if kept else [])


def test_filters_preserve_candidate_order() -> None:
    candidates = [view(f"i{n}", state="ready" if n % 2 else "joining") for n in range(9, -1, -1)]
    f = ready.ReadyFilter("ready", ready.Params())
    assert ids(f.filter(context(snapshot(*candidates)), candidates)) == ["i9", "i7", "i5", "i3", "i1"]


# --- kv-compat-filter --------------------------------------------------------------------------------

PARTNER = view("partner", role="decode", revision="r1", block_size=16, kv_connector="NixlConnector")


@pytest.mark.parametrize(
    ("candidate", "kept"),
    [
        pytest.param(view("p"), True, id="same model, revision, block size and connector is kept"),
        pytest.param(view("p", model="other"), False, id="a different model is filtered out"),
        pytest.param(
            view("p", revision="r2"), False, id="a different model revision is never paired with the partner"
        ),
        pytest.param(view("p", block_size=32), False, id="a different KV block size is filtered out"),
        pytest.param(view("p", kv_connector="LMCacheConnectorV1"), False, id="a different connector is out"),
        pytest.param(view("p", kv_connector=""), False, id="no connector cannot talk to a connector"),
        pytest.param(view("partner"), False, id="the partner itself is filtered out"),
    ],
)
def test_kv_compat_filter_against_the_partner(candidate: InstanceView, kept: bool) -> None:
    f = kv_compat.KvCompatFilter("kv", kv_compat.Params())
    ctx = context(snapshot(PARTNER, candidate), profile="prefill", partner=PARTNER)
    assert ids(f.filter(ctx, [candidate])) == ([candidate.agent_id] if kept else [])


def test_kv_compat_filter_without_a_partner_keeps_everything() -> None:
    candidates = [view("a", revision="r1"), view("b", revision="r2", block_size=64, kv_connector="")]
    f = kv_compat.KvCompatFilter("kv", kv_compat.Params())
    assert ids(f.filter(context(snapshot(*candidates), partner=None), candidates)) == ["a", "b"]


@st.composite
def instance_sets(draw: st.DrawFn) -> tuple[InstanceView, list[InstanceView]]:
    """A partner and candidates drawn from a small space of KV layouts, so matches are common."""
    layouts = st.tuples(
        st.sampled_from(["m", "m2"]),
        st.sampled_from(["r1", "r2", ""]),
        st.sampled_from([16, 32]),
        st.sampled_from(["NixlConnector", "LMCacheConnectorV1", ""]),
    )
    drawn = draw(st.lists(layouts, min_size=1, max_size=12))
    views = [
        view(f"i{n}", model=m, revision=r, block_size=b, kv_connector=k)
        for n, (m, r, b, k) in enumerate(drawn)
    ]
    partner = views[draw(st.integers(0, len(views) - 1))]
    return partner, views


@settings(deadline=None)
@given(instance_sets())
def test_kv_compat_filter_keeps_exactly_the_candidates_matching_the_partner(
    drawn: tuple[InstanceView, list[InstanceView]],
) -> None:
    partner, candidates = drawn
    f = kv_compat.KvCompatFilter("kv", kv_compat.Params())
    kept = list(f.filter(context(snapshot(*candidates), profile="prefill", partner=partner), candidates))
    p = partner.info
    for c in kept:
        assert c.agent_id != partner.agent_id
        assert (c.info.model, c.info.revision, c.info.block_size, c.info.kv_connector) == (
            p.model,
            p.revision,
            p.block_size,
            p.kv_connector,
        )
    # Nothing compatible is lost either, and the order is the candidates' order.
    assert kept == [
        c
        for c in candidates
        if c.agent_id != partner.agent_id
        and c.info.model == p.model
        and c.info.revision == p.revision
        and c.info.block_size == p.block_size
        and c.info.kv_connector == p.kv_connector
    ]


def test_kv_compat_filter_in_a_cluster_of_one_class_keeps_all_but_the_partner_until_another_class_joins() -> (
    None
):
    # One class (every instance alike): one verdict stands for every candidate, kept while the
    # registry's membership holds; an instance of another class joining must end that.
    registry = Registry(heartbeat_timeout_s=1e9)

    def join(agent_id: str, role: Role, block_size: int = 16) -> None:
        info = InstanceInfo(
            url=f"http://{agent_id}:8000",
            role=role,
            model="m",
            block_size=block_size,
            kv_connector="NixlConnector",
        )
        registry.hello(agent_id, info, 0.0)
        registry.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready", metrics=MetricsSnapshot()), 0.0)

    members: tuple[tuple[str, Role], ...] = (
        ("p0", "prefill"),
        ("p1", "prefill"),
        ("both", "both"),
        ("d0", "decode"),
    )
    for agent_id, as_role in members:
        join(agent_id, as_role)
    f = kv_compat.KvCompatFilter("kv", kv_compat.Params())

    def kept(partner: str) -> list[str]:
        snap = registry.snapshot()
        ctx = context(snap, profile="prefill", partner=snap.by_id[partner])
        return ids(f.filter(ctx, [snap.by_id[i] for i in snap.prefill_ids["m"]]))

    assert kept("d0") == ["p0", "p1", "both"]
    assert kept("both") == ["p0", "p1"], "never the partner itself"
    join("p2", "prefill", block_size=32)
    assert kept("d0") == ["p0", "p1", "both"], "the new block size cannot pair with d0"


def test_kv_compat_filter_in_a_cluster_of_one_class_that_cannot_pair_keeps_none() -> None:
    # A connector that keeps KV under its own engine never crosses instances, even between two alike.
    local = [view(i, kv_connector="OffloadingConnector") for i in ("a", "b", "c")]
    f = kv_compat.KvCompatFilter("kv", kv_compat.Params())
    assert f.filter(context(snapshot(*local), profile="prefill", partner=local[0]), local) == []


# --- kv-usage-filter ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ceiling", "usage", "kept"),
    [
        pytest.param(0.95, 0.0, True, id="an empty KV cache passes"),
        pytest.param(0.95, 0.94, True, id="usage just below the ceiling passes"),
        pytest.param(0.95, 0.95, False, id="usage at the ceiling is filtered out"),
        pytest.param(0.95, 1.0, False, id="a full KV cache is filtered out"),
        pytest.param(1.0, 0.999, True, id="ceiling 1 keeps everything not full"),
        pytest.param(1.0, 1.0, False, id="ceiling 1 still filters out a full cache"),
        pytest.param(0.5, 0.6, False, id="a lower ceiling filters out a half-full cache"),
    ],
)
def test_kv_usage_filter(ceiling: float, usage: float, kept: bool) -> None:
    candidate = view("x", metrics=MetricsSnapshot(kv_cache_usage=usage))
    f = kv_usage.KvUsageFilter("kv-usage", kv_usage.Params(ceiling=ceiling))
    assert ids(f.filter(context(snapshot(candidate)), [candidate])) == (["x"] if kept else [])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"ceiling": 0.0}, "ceiling must be > 0", id="a zero ceiling would filter out everything"
        ),
        pytest.param({"ceiling": -0.5}, "ceiling must be > 0", id="a negative ceiling"),
        pytest.param({"ceiling": 1.5}, "ceiling must be <= 1", id="a ceiling above 1"),
        pytest.param({"ceiling": float("nan")}, "must be a finite number", id="a NaN ceiling"),
        pytest.param({"ceiling": "0.9"}, "must be a finite number", id="a string ceiling"),
        pytest.param({"ceiling": True}, "must be a finite number", id="a boolean ceiling"),
    ],
)
def test_kv_usage_filter_params_reject_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        kv_usage.Params(**kwargs)
    assert str(err.value).startswith("kv-usage-filter: ")


# --- registration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "type_name", "per_request"),
    [
        pytest.param(role, "role-filter", False, id="role-filter depends only on membership"),
        pytest.param(ready, "ready-filter", False, id="ready-filter depends only on membership"),
        pytest.param(kv_compat, "kv-compat-filter", True, id="kv-compat-filter depends on the partner"),
        pytest.param(
            kv_usage, "kv-usage-filter", True, id="kv-usage-filter reads metrics that every heartbeat moves"
        ),
    ],
)
def test_every_filter_is_registered_under_its_type(
    module: ModuleType, type_name: str, per_request: bool
) -> None:
    spec = PLUGIN_SPECS[type_name]
    assert spec is module.PLUGIN
    assert (spec.type, spec.kind, spec.params) == (type_name, "filter", module.Params)
    plugin = spec.factory("mine", module.Params())
    assert (plugin.TYPE, plugin.name) == (type_name, "mine")
    assert cast(Filter, plugin).PER_REQUEST is per_request
