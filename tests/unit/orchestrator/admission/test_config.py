"""The admission section refuses what cannot work, naming the field, before anything starts."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import ConfigError


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_queue": 0}, "max_queue"),
        ({"max_wait_s": 0.0}, "max_wait_s"),
        ({"ttft_s": -1.0}, "ttft_s"),
        ({"kv_usage_high": 0.0}, "kv_usage_high"),
        ({"engine_share": 0.0}, "engine_share"),
        ({"engine_share": 1.5}, "engine_share"),
        ({"max_tenant_labels": -1}, "max_tenant_labels"),
        ({"tenant_weights": (("a b", 1.0),)}, "tenant_weights"),
        ({"tenant_weights": (("a", 0.0),)}, "tenant_weights[a]"),
        ({"tenant_weights": (("a", float("inf")),)}, "tenant_weights[a]"),
        ({"priority_header": "x priority"}, "priority_header"),
        ({"tenant_header": ""}, "tenant_header"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=f"admission.{named}".replace("[", r"\[").replace("]", r"\]")):
        AdmissionConfig(**fields)


def test_the_defaults_are_valid_and_on() -> None:
    config = AdmissionConfig()
    assert config.enabled and config.max_queue == 1024 and config.sheddable_priority == 1
