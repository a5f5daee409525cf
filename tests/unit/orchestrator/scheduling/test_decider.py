"""The uncached-tokens decider: colocated or disaggregated, and the reason it gives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.scheduling_support import context, request, snapshot, view
from vllm_disagg.orchestrator.scheduling.framework import Mode, ModeChoice
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.deciders import uncached_tokens

DECODE = view("d1", role="decode")


@dataclass(frozen=True)
class Case:
    prompt_len: int
    threshold: int = 0
    cached: Mapping[str, int] = field(default_factory=dict)
    prefill_ready: bool = True


def choose(case: Case) -> ModeChoice:
    decider = uncached_tokens.UncachedTokensDecider("split", uncached_tokens.Params(threshold=case.threshold))
    ctx = context(snapshot(DECODE), req=request(prompt_len=case.prompt_len, cached=case.cached))
    return decider.choose(ctx, DECODE, case.prefill_ready)


@pytest.mark.parametrize(
    ("case", "mode", "reason"),
    [
        pytest.param(
            Case(prompt_len=4000, threshold=512, prefill_ready=False),
            "colocated",
            "no prefill instance is ready",
            id="no ready prefill instance runs colocated whatever the prompt",
        ),
        pytest.param(
            Case(prompt_len=100, threshold=512),
            "colocated",
            "only 100 uncached prompt tokens (below threshold 512)",
            id="a short prompt runs colocated",
        ),
        pytest.param(
            Case(prompt_len=4000, threshold=512, cached={"d1": 3800}),
            "colocated",
            "only 200 uncached prompt tokens (below threshold 512)",
            id="a long prompt mostly cached on the decode instance runs colocated",
        ),
        pytest.param(
            Case(prompt_len=511, threshold=512),
            "colocated",
            "only 511 uncached prompt tokens (below threshold 512)",
            id="one token below the threshold runs colocated",
        ),
        pytest.param(
            Case(prompt_len=512, threshold=512),
            "disaggregated",
            "512 uncached prompt tokens of 512 on d1 (threshold 512)",
            id="exactly the threshold disaggregates",
        ),
        pytest.param(
            Case(prompt_len=4000, threshold=512, cached={"p1": 3800}),
            "disaggregated",
            "4000 uncached prompt tokens of 4000 on d1 (threshold 512)",
            id="a cache hit on another instance does not count",
        ),
        pytest.param(
            Case(prompt_len=100, cached={"d1": 100}),
            "disaggregated",
            "0 uncached prompt tokens of 100 on d1 (threshold 0)",
            id="threshold 0 always disaggregates when a prefill instance is ready",
        ),
        pytest.param(
            Case(prompt_len=100, threshold=1, cached={"d1": 400}),
            "colocated",
            "only 0 uncached prompt tokens (below threshold 1)",
            id="a cache longer than the estimated prompt counts as zero uncached tokens",
        ),
    ],
)
def test_uncached_tokens_decider(case: Case, mode: Mode, reason: str) -> None:
    assert choose(case) == ModeChoice(mode, reason)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"threshold": -1}, "threshold must be >= 0, got -1", id="a negative threshold"),
        pytest.param(
            {"threshold": 1.5}, "threshold must be an integer, got 1.5", id="a fractional threshold"
        ),
        pytest.param({"threshold": "512"}, "threshold must be an integer", id="a string threshold"),
        pytest.param({"threshold": True}, "threshold must be an integer", id="a boolean threshold"),
    ],
)
def test_decider_params_reject_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^uncached-tokens-decider: {message}"):
        uncached_tokens.Params(**kwargs)


def test_the_decider_is_registered_under_its_type() -> None:
    spec = PLUGIN_SPECS["uncached-tokens-decider"]
    assert spec is uncached_tokens.PLUGIN
    assert (spec.kind, spec.params) == ("decider", uncached_tokens.Params)
    plugin = spec.factory("mine", uncached_tokens.Params())
    assert (plugin.TYPE, plugin.name) == ("uncached-tokens-decider", "mine")


def test_the_catalog_holds_every_plugin_type() -> None:
    assert sorted(PLUGIN_SPECS) == sorted(
        [
            "role-filter",
            "ready-filter",
            "kv-compat-filter",
            "kv-usage-filter",
            "slo-filter",
            "topology-filter",
            "queue-scorer",
            "kv-usage-scorer",
            "ttft-scorer",
            "tpot-scorer",
            "prefix-scorer",
            "topology-scorer",
            "max-score-picker",
            "power-of-two-picker",
            "weighted-random-picker",
            "uncached-tokens-decider",
            "kv-pool-decider",
            "transfer-pairing",
        ]
    )
    assert all(name == spec.type for name, spec in PLUGIN_SPECS.items())
