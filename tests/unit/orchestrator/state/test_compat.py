"""KV compatibility of a prefill and a decode instance: vLLM 0.32's rules per connector
(docs/vllm-kv-layout-facts.md), their cache, the filter that applies them, and the pair count."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import MODEL, context, snapshot, view
from vllm_disagg.orchestrator.scheduling.plugins.filters import kv_compat
from vllm_disagg.orchestrator.state.compat import (
    IncompatiblePairs,
    PairJudge,
    incompatible_pairs,
    judge,
    pair_mismatch,
)
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import InstanceInfo, KvLayout, Role

NIXL = "NixlConnector"
BASE = KvLayout(
    tp_size=1,
    pp_size=1,
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    kv_layout="LBHNC",
    attention_backend="FLASH_ATTN",
    vllm_version="0.32.0",
    model_path="/models/m",
)


def info(connector: str = NIXL, role: Role = "prefill", **layout: Any) -> InstanceInfo:
    return InstanceInfo(
        url="http://x",
        role=role,
        model="m",
        kv_connector=connector,
        layout=dataclasses.replace(BASE, **layout),
    )


def with_layout(v: InstanceView, layout: KvLayout) -> InstanceView:
    return dataclasses.replace(v, info=dataclasses.replace(v.info, layout=layout))


# (connector, prefill's changes, decode's changes, the reason code or None when they pair)
RULES = [
    pytest.param(NIXL, {}, {}, None, id="nixl: equal layouts pair"),
    pytest.param(
        NIXL, {"dtype": "float16"}, {}, "dtype", id="nixl: the model dtype is in the handshake hash"
    ),
    pytest.param(
        NIXL, {"kv_cache_dtype": "fp8_e4m3"}, {}, "kv_cache_dtype", id="nixl: KV cache dtype hashed"
    ),
    pytest.param(
        NIXL,
        {"attention_backend": "FLASHINFER"},
        {},
        "attention_backend",
        id="nixl: attention backend hashed",
    ),
    pytest.param(NIXL, {"vllm_version": "0.31.0"}, {}, "vllm_version", id="nixl: the vLLM version is hashed"),
    pytest.param(NIXL, {"model_path": "/other"}, {}, "model_path", id="nixl: --model is hashed"),
    pytest.param(NIXL, {"kv_layout": "LBNHC"}, {}, "kv_layout", id="nixl: layouts must be equal"),
    pytest.param(NIXL, {"tp_size": 2}, {}, None, id="nixl: TP 2 to 1 on LBHNC is heterogeneous TP"),
    pytest.param(NIXL, {"tp_size": 1}, {"tp_size": 4}, None, id="nixl: TP 1 to 4 divides"),
    pytest.param(NIXL, {"tp_size": 2}, {"tp_size": 3}, "tp_size", id="nixl: TP 2 and 3 do not divide"),
    pytest.param(
        NIXL,
        {"tp_size": 2, "kv_layout": "LBNHC"},
        {"kv_layout": "LBNHC"},
        "tp_layout",
        id="nixl: heterogeneous TP on a layout that is not block-contiguous is refused",
    ),
    pytest.param(
        NIXL,
        {"tp_size": 2, "kv_layout": "BLHNC"},
        {"kv_layout": "BLHNC"},
        None,
        id="nixl: BLHNC splits heads",
    ),
    pytest.param(NIXL, {"pp_size": 2}, {}, None, id="nixl: a PP 2 prefill feeds a PP 1 decode"),
    pytest.param(NIXL, {}, {"pp_size": 2}, "pp_size", id="nixl: no decode instance with PP above 1"),
    pytest.param(NIXL, {"kv_cache_dtype": "auto"}, {}, None, id="kv cache dtype auto is the model's dtype"),
    pytest.param("MooncakeConnector", {"tp_size": 4}, {"tp_size": 2}, None, id="mooncake: TP 4 to 2 divides"),
    pytest.param(
        "MooncakeConnector",
        {"tp_size": 3},
        {"tp_size": 2},
        "tp_size",
        id="mooncake: TP 3 and 2 do not divide",
    ),
    pytest.param("MooncakeConnector", {"dtype": "float16"}, {}, "dtype", id="mooncake: dtypes must be equal"),
    pytest.param(
        "MooncakeConnector", {"vllm_version": "0.31.0"}, {}, None, id="mooncake: the version is not checked"
    ),
    pytest.param("vllm-disagg", {"tp_size": 2}, {}, "tp_size", id="pool connector: TP must be equal"),
    pytest.param("vllm-disagg", {"pp_size": 2}, {}, "pp_size", id="pool connector: PP must be equal"),
    pytest.param("", {"kv_layout": "LBNHC"}, {}, "kv_layout", id="no connector: everything known equal"),
    pytest.param(
        "", {"tp_rank": 1, "dp_size": 2, "max_num_seqs": 9}, {}, None, id="ranks, DP, batch ignored"
    ),
]


@pytest.mark.parametrize(("connector", "p", "d", "code"), RULES)
def test_pair_rules(connector: str, p: dict[str, Any], d: dict[str, Any], code: str | None) -> None:
    found = judge(info(connector, **p), info(connector, role="decode", **d))
    assert (None if found is None else found.code) == code
    assert (pair_mismatch(info(connector, **p), info(connector, role="decode", **d)) is None) == (
        code is None
    )


@pytest.mark.parametrize(
    ("p", "d", "code"),
    [
        pytest.param({"revision": "r2"}, {}, "revision", id="another revision"),
        pytest.param({"block_size": 32}, {}, "block_size", id="another block size"),
        pytest.param({"kv_connector": "MooncakeConnector"}, {}, "connector", id="another connector"),
        pytest.param({"model": "m2"}, {}, "model", id="another model"),
    ],
)
def test_instance_fields_must_be_equal(p: dict[str, Any], d: dict[str, Any], code: str) -> None:
    found = judge(dataclasses.replace(info(), **p), dataclasses.replace(info(role="decode"), **d))
    assert found is not None and found.code == code


def test_a_connector_that_keeps_kv_under_its_own_engine_is_never_paired() -> None:
    found = judge(info("OffloadingConnector"), info("OffloadingConnector", role="decode"))
    assert found is not None and found.code == "connector" and "never crosses instances" in found.text
    assert judge(info("ExampleConnector"), info("ExampleConnector", role="decode")) is None  # a store


def test_the_reason_names_both_sides() -> None:
    assert pair_mismatch(info(tp_size=2), info(role="decode", tp_size=3)) == (
        "TP sizes must divide one another for NixlConnector: prefill 2, decode 3"
    )


def test_equal_layouts_share_a_class_and_each_pair_of_classes_is_judged_once() -> None:
    j = PairJudge()
    a, b, c = info(), info(tp_rank=1, max_num_seqs=4), info(tp_size=3)
    assert j.kv_class(a) == j.kv_class(b) != j.kv_class(c)
    d = info(role="decode", tp_size=2)
    first = j.mismatch(c, d)
    assert first is not None and j.mismatch(c, d) is first  # the cached answer


FIELDS_NAMES: tuple[str, ...] = ("tp_size", "pp_size", "dtype", "kv_cache_dtype", "kv_layout")
FIELDS_NAMES += ("attention_backend", "vllm_version", "model_path")
FIELDS = st.fixed_dictionaries(
    {
        "tp_size": st.sampled_from([0, 1, 2, 3, 4]),
        "pp_size": st.sampled_from([0, 1, 2]),
        "dtype": st.sampled_from(["", "bfloat16", "float16"]),
        "kv_cache_dtype": st.sampled_from(["", "auto", "fp8_e4m3"]),
        "kv_layout": st.sampled_from(["", "LBHNC", "LBNHC", "BLHNC"]),
        "attention_backend": st.sampled_from(["", "FLASH_ATTN", "CPU_ATTN"]),
        "vllm_version": st.sampled_from(["", "0.32.0", "0.31.0"]),
        "model_path": st.sampled_from(["", "/a", "/b"]),
    }
)
BLANK: dict[str, Any] = {name: 0 if name.endswith("_size") else "" for name in FIELDS_NAMES}
CONNECTORS = st.sampled_from([NIXL, "NixlPushConnector", "MooncakeConnector", "vllm-disagg", ""])


@settings(max_examples=300, deadline=None)
@given(connector=CONNECTORS, partner=FIELDS, layouts=st.lists(FIELDS, min_size=1, max_size=6))
def test_an_incompatible_layout_is_never_paired(
    connector: str, partner: dict[str, Any], layouts: list[dict[str, Any]]
) -> None:
    decode = with_layout(view("d", role="decode", kv_connector=connector), KvLayout(**partner))
    candidates = [
        with_layout(view(f"p{i}", role="prefill", kv_connector=connector), KvLayout(**x))
        for i, x in enumerate(layouts)
    ]
    f = kv_compat.KvCompatFilter("kv", kv_compat.Params())
    ctx = context(snapshot(decode, *candidates), profile="prefill", partner=decode)
    kept = {v.agent_id for v in f.filter(ctx, candidates)}
    for c in candidates:
        assert (c.agent_id in kept) == (judge(c.info, decode.info) is None)
    dropped = [c for c in candidates if c.agent_id not in kept]
    reasons = f.reasons(ctx, dropped)
    assert all(reasons[c.agent_id] == pair_mismatch(c.info, decode.info) for c in dropped)


@settings(max_examples=300, deadline=None)
@given(connector=CONNECTORS, p=FIELDS, d=FIELDS, blank=st.sets(st.sampled_from(sorted(BLANK))))
def test_unknown_fields_never_refuse(
    connector: str, p: dict[str, Any], d: dict[str, Any], blank: set[str]
) -> None:
    """Forgetting fields (either side) never turns a pair that can be made into one that cannot."""
    if judge(info(connector, **p), info(connector, role="decode", **d)) is not None:
        return
    forget = {name: BLANK[name] for name in blank}
    assert judge(info(connector, **{**p, **forget}), info(connector, role="decode", **d)) is None
    assert judge(info(connector, **p), info(connector, role="decode", **{**d, **forget})) is None
    unknown = InstanceInfo("http://x", "decode", "m", kv_connector=connector)
    assert judge(info(connector, **p), unknown) is None


def test_the_decode_profile_judges_the_pinned_prefill_as_the_prefill_side() -> None:
    prefill = with_layout(view("p", role="prefill"), dataclasses.replace(BASE, pp_size=2))
    decode = with_layout(view("d", role="decode"), BASE)
    f = kv_compat.KvCompatFilter("kv", kv_compat.Params())
    ctx = context(snapshot(prefill, decode), profile="decode", partner=prefill)
    assert [v.agent_id for v in f.filter(ctx, [decode])] == ["d"]  # PP 2 is refused only on decode


def test_incompatible_pairs_counts_live_pairs_by_model_and_reason() -> None:
    tp2 = dataclasses.replace(BASE, tp_size=2, kv_layout="LBNHC")
    views = [
        with_layout(view("p1", role="prefill"), BASE),
        with_layout(view("p2", role="prefill"), tp2),
        with_layout(view("d1", role="decode"), BASE),
        with_layout(view("d2", role="decode", state="dead"), tp2),
        with_layout(view("b", role="both"), dataclasses.replace(BASE, dtype="float16")),
    ]
    assert incompatible_pairs(views) == {
        (MODEL, "kv_layout"): 1,  # p2 -> d1 (d2 is dead)
        (MODEL, "dtype"): 3,  # p1 -> b, p2 -> b, b -> d1 (the dtype is compared before the layout)
    }
    pairs = IncompatiblePairs()
    snap = snapshot(*views)
    assert pairs.counts(snap) is pairs.counts(snap)  # recounted only when the membership changes
