"""A request's priority and tenant (``admission.classify``): where each comes from, what wins, what
is refused, and that an API key never becomes a label itself."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.admission.classify import TenantLabels, priority_of, tenant_of

CONFIG = AdmissionConfig()


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        ({}, {}, 0),
        ({"priority": 3}, {}, 3),
        ({"priority": -2}, {}, -2),
        ({"priority": None}, {}, 0),
        ({}, {"x-priority": "7"}, 7),
        ({"priority": 3}, {"x-priority": " -1 "}, -1),  # the header wins: a proxy sets the class
    ],
)
def test_priority(body: dict[str, Any], headers: dict[str, str], expected: int) -> None:
    assert priority_of(body, headers, CONFIG) == expected


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"priority": True}, {}),
        ({"priority": 1.5}, {}),
        ({"priority": "high"}, {}),
        ({"priority": 1 << 40}, {}),
        ({}, {"x-priority": "urgent"}),
        ({}, {"x-priority": ""}),
    ],
)
def test_a_bad_priority_is_a_400_naming_the_field(body: dict[str, Any], headers: dict[str, str]) -> None:
    with pytest.raises(BadRequest, match=r"priority") as caught:
        priority_of(body, headers, CONFIG)
    assert caught.value.param == "priority"


def test_the_tenant_is_the_header_else_the_keys_hash_else_default() -> None:
    key = "sk-secret-123"
    assert tenant_of({"x-tenant-id": "team-a"}, CONFIG) == "team-a"
    hashed = tenant_of({"Authorization": f"Bearer {key}"}, CONFIG)
    assert hashed == "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    assert key not in hashed
    assert tenant_of({"x-tenant-id": "team-a", "Authorization": f"Bearer {key}"}, CONFIG) == "team-a"
    assert tenant_of({"Authorization": "Basic abc"}, CONFIG) == "default"
    assert tenant_of({}, CONFIG) == "default"


def test_the_headers_are_configurable() -> None:
    config = AdmissionConfig(tenant_header="x-org", priority_header="x-class")
    assert tenant_of({"x-org": "acme", "x-tenant-id": "other"}, config) == "acme"
    assert priority_of({}, {"x-class": "2", "x-priority": "5"}, config) == 2


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "é", "a/b"])
def test_a_bad_tenant_name_is_a_400(bad: str) -> None:
    with pytest.raises(BadRequest, match="x-tenant-id"):
        tenant_of({"x-tenant-id": bad}, CONFIG)


def test_tenant_labels_stay_bounded() -> None:
    labels = TenantLabels(AdmissionConfig(max_tenant_labels=2, tenant_weights=(("gold", 2.0),)))
    assert [labels.name(t) for t in ("t1", "t2", "t3", "t1", "gold", "default")] == [
        "t1",
        "t2",
        "other",
        "t1",
        "gold",
        "default",
    ]
    labels.add("t3")  # an operator set its weight: named from now on
    assert labels.name("t3") == "t3"
