"""The admission routes' pure parts: a tenant's name and weight checked, and the gateway processes'
queues summed into the one view ``GET /admin/v1/admission`` answers (and the CLI prints)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from vllm_disagg.cli.admin import format_admission
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.admin.admission import merge, tenant_name, tenant_weights, weight_of

CONFIG = AdmissionConfig()


@pytest.mark.parametrize("name", ["gold", "team-a.eu:1", "key-0123456789ab", "x" * 64])
def test_a_name_the_tenant_header_takes_names_a_tenant(name: str) -> None:
    assert tenant_name(name, CONFIG) == name


@pytest.mark.parametrize(
    "name",
    ["", "two words", " gold", "gold ", "x" * 65, "slash/ed", "ünïcode"],
    ids=["empty", "space", "leading-space", "trailing-space", "too-long", "slash", "not-ascii"],
)
def test_a_name_the_tenant_header_refuses_is_a_bad_request(name: str) -> None:
    with pytest.raises(BadRequest, match="a tenant's name is 1-64 of"):
        tenant_name(name, CONFIG)


@pytest.mark.parametrize(
    ("value", "weight"), [(2, 2.0), (0.25, 0.25), (1e6, 1e6)], ids=["int", "float", "big"]
)
def test_a_finite_positive_number_is_a_weight(value: object, weight: float) -> None:
    assert weight_of(value) == weight


@pytest.mark.parametrize(
    "value",
    [0, -1, math.inf, math.nan, True, "2", None, [2]],
    ids=["zero", "negative", "infinite", "nan", "boolean", "string", "null", "list"],
)
def test_anything_else_is_not_a_weight(value: object) -> None:
    with pytest.raises(BadRequest, match="must be a finite number > 0"):
        weight_of(value)


def test_the_weights_etcd_holds_are_checked_whole() -> None:
    assert tenant_weights({"gold": 3, "b": 0.5}, CONFIG) == {"gold": 3.0, "b": 0.5}
    assert tenant_weights({}, CONFIG) == {}
    for bad in ({"gold": 0}, {"no good": 1}, [["gold", 2]]):
        with pytest.raises(BadRequest):
            tenant_weights(bad, CONFIG)


def view(depth: int = 0, saturated: str = "", **fields: Any) -> dict[str, Any]:
    """One process's view of one model, as ``Admission.snapshot`` gives it."""
    return {
        "depth": depth,
        "by_priority": fields.get("by_priority", {}),
        "by_tenant": fields.get("by_tenant", {}),
        "oldest_wait_s": fields.get("oldest_wait_s", 0.0),
        "saturated": saturated,
        "counts": fields.get(
            "counts", {"queued": 0, "admitted": 0, "withdrawn": 0, "shed": {"queue_full": 0}}
        ),
        "ahead_of_share": fields.get("ahead_of_share", {}),
    }


def test_the_processes_queues_are_summed_the_oldest_wait_is_the_longest() -> None:
    first = view(
        2,
        "prefill",
        by_priority={"0": 2},
        by_tenant={"a": 2},
        oldest_wait_s=0.5,
        counts={"queued": 2, "admitted": 5, "withdrawn": 0, "shed": {"queue_full": 1}},
        ahead_of_share={"a": 10.0},
    )
    second = view(
        1,
        "",
        by_priority={"-1": 1},
        by_tenant={"b": 1},
        oldest_wait_s=1.25,
        counts={"queued": 1, "admitted": 3, "withdrawn": 1, "shed": {"queue_full": 2}},
        ahead_of_share={"a": 2.5, "b": -1.0},
    )
    merged = merge([{"models": {"m": first}}, {"models": {"m": second, "n": view()}}])
    assert list(merged) == ["m", "n"]
    assert merged["m"] == {
        "depth": 3,
        "by_priority": {"-1": 1, "0": 2},  # in priority order, most important first
        "by_tenant": {"a": 2, "b": 1},
        "oldest_wait_s": 1.25,
        "saturated": "prefill",
        "counts": {"queued": 3, "admitted": 8, "withdrawn": 1, "shed": {"queue_full": 3}},
        "ahead_of_share": {"a": 12.5, "b": -1.0},
    }
    assert merged["n"] == view()


@pytest.mark.parametrize(
    ("stages", "saturated"),
    [
        ((("", 0), ("", 4)), ""),
        ((("decode", 1), ("prefill", 3)), "prefill"),
        ((("decode", 5), ("", 9)), "decode"),
    ],
    ids=["none-held-back", "the-deepest-held-back-queue-says", "a-free-process-does-not-hide-it"],
)
def test_the_saturated_stage_is_that_of_the_deepest_queue_held_back(
    stages: tuple[tuple[str, int], ...], saturated: str
) -> None:
    merged = merge({"models": {"m": view(depth, stage)}} for stage, depth in stages)
    assert merged["m"]["saturated"] == saturated


def test_status_prints_each_model_with_its_shed_reasons_and_no_zeros() -> None:
    seen = {
        "enabled": True,
        "tenants": {"weights": {"gold": 3.0, "lead": 0.5}},
        "models": {
            "m": view(
                3,
                "decode",
                by_priority={"0": 2, "2": 1},
                oldest_wait_s=0.4567,
                counts={
                    "queued": 4,
                    "admitted": 9,
                    "withdrawn": 0,
                    "shed": {"queue_full": 0, "sheddable": 2},
                },
            )
        },
    }
    assert format_admission(seen).splitlines() == [
        "admission: 3 waiting; tenants' weights: gold=3, lead=0.5",
        "MODEL  WAITING  BY-PRIORITY  OLDEST-S  SATURATED  ADMITTED  QUEUED  SHED",
        "m      3        0:2 2:1      0.457     decode     9         4       sheddable=2",
    ]
    assert format_admission({"enabled": True, "models": {}}) == (
        "admission: 0 waiting; tenants' weights: all equal (no request yet)"
    )
