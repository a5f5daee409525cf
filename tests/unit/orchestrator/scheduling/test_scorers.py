"""Scheduling scorers: the score each gives an instance, how scores order instances, and their range."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import context, request, snapshot, view
from vllm_disagg.orchestrator.scheduling.framework import ProfileContext, Scorer
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.scorers import kv_usage, prefix, queue, tpot, ttft
from vllm_disagg.protocol.messages import MetricsSnapshot

SCORER_MODULES: dict[str, ModuleType] = {
    "queue-scorer": queue,
    "kv-usage-scorer": kv_usage,
    "ttft-scorer": ttft,
    "tpot-scorer": tpot,
    "prefix-scorer": prefix,
}


@dataclass(frozen=True)
class Load:
    """One instance's metrics, the gateway's in-flight count on it, and its cached prompt tokens."""

    metrics: MetricsSnapshot = field(default_factory=MetricsSnapshot)
    in_flight: int = 0
    cached: int = 0


def score_one(scorer: Scorer, load: Load, *, prompt_len: int = 1000) -> float:
    candidate = view("x", metrics=load.metrics)
    req = request(prompt_len=prompt_len, cached={"x": load.cached} if load.cached else None)
    ctx = context(snapshot(candidate, in_flight={"x": load.in_flight}), req=req)
    [score] = scorer.score(ctx, [candidate])
    return score


def score_pair(scorer: Scorer, a: Load, b: Load, *, prompt_len: int = 1000) -> tuple[float, float]:
    va, vb = view("a", metrics=a.metrics), view("b", metrics=b.metrics)
    cached = {k: n for k, n in (("a", a.cached), ("b", b.cached)) if n}
    ctx = context(
        snapshot(va, vb, in_flight={"a": a.in_flight, "b": b.in_flight}),
        req=request(prompt_len=prompt_len, cached=cached),
    )
    sa, sb = scorer.score(ctx, [va, vb])
    return sa, sb


def default_scorer(type_name: str) -> Scorer:
    spec = PLUGIN_SPECS[type_name]
    assert spec.kind == "scorer"
    return spec.factory(type_name, SCORER_MODULES[type_name].Params())  # type: ignore[return-value]


# --- queue-scorer ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_queue", "load", "expected"),
    [
        pytest.param(32, Load(), 1.0, id="an idle instance scores 1"),
        pytest.param(
            32, Load(MetricsSnapshot(num_running=8, num_waiting=8)), 0.5, id="half of max_queue is 0.5"
        ),
        pytest.param(32, Load(in_flight=16), 0.5, id="the gateway's in-flight requests count as load"),
        pytest.param(
            32,
            Load(MetricsSnapshot(num_running=4, num_waiting=4), in_flight=8),
            0.5,
            id="all three sources add",
        ),
        pytest.param(32, Load(MetricsSnapshot(num_waiting=32)), 0.0, id="load at max_queue scores 0"),
        pytest.param(
            32, Load(MetricsSnapshot(num_waiting=10**9)), 0.0, id="load beyond max_queue stays at 0"
        ),
        pytest.param(4, Load(in_flight=1), 0.75, id="a smaller max_queue makes each request count more"),
    ],
)
def test_queue_scorer(max_queue: float, load: Load, expected: float) -> None:
    scorer = queue.QueueScorer("q", queue.Params(max_queue=max_queue))
    assert score_one(scorer, load) == pytest.approx(expected)


# --- kv-usage-scorer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        pytest.param(0.0, 1.0, id="an empty KV cache scores 1"),
        pytest.param(0.25, 0.75, id="a quarter-full cache scores 0.75"),
        pytest.param(1.0, 0.0, id="a full cache scores 0"),
        pytest.param(1.7, 0.0, id="a reading above 1 is clamped to 0"),
        pytest.param(-0.2, 1.0, id="a reading below 0 is clamped to 1"),
    ],
)
def test_kv_usage_scorer(usage: float, expected: float) -> None:
    scorer = kv_usage.KvUsageScorer("kv", kv_usage.Params())
    assert score_one(scorer, Load(MetricsSnapshot(kv_cache_usage=usage))) == pytest.approx(expected)


def test_kv_usage_scorer_keeps_a_nan_reading_in_range() -> None:
    scorer = kv_usage.KvUsageScorer("kv", kv_usage.Params())
    assert 0.0 <= score_one(scorer, Load(MetricsSnapshot(kv_cache_usage=math.nan))) <= 1.0


# --- ttft-scorer -------------------------------------------------------------------------------------

TPUT = 1000.0  # measured prefill throughput: the 1,000-token prompt takes 1 s


@pytest.mark.parametrize(
    ("params", "load", "predicted_s"),
    [
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(prefill_tokens_per_s=TPUT)),
            1.0,
            id="idle: this prompt over measured throughput",
        ),
        pytest.param(
            ttft.Params(default_prefill_tokens_per_s=500),
            Load(),
            2.0,
            id="unmeasured throughput falls back to the default",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(prefill_tokens_per_s=0.0)),
            1000 / 4096,
            id="a zero throughput reading falls back to the default",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(queue_s=0.5, prefill_tokens_per_s=TPUT)),
            1.5,
            id="the engine's queue wait adds",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(num_waiting=2, mean_prompt_tokens=500, prefill_tokens_per_s=TPUT)),
            2.0,
            id="waiting requests add backlog at the mean prompt length",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(mean_prompt_tokens=500, prefill_tokens_per_s=TPUT), in_flight=2),
            2.0,
            id="the gateway's in-flight requests add backlog too",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(num_waiting=1, prefill_tokens_per_s=TPUT)),
            2.0,
            id="an unmeasured mean prompt length falls back to this request's",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(num_running=50, prefill_tokens_per_s=TPUT)),
            1.0,
            id="running requests are already past prefill and add nothing",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(prefill_tokens_per_s=TPUT), cached=750),
            0.25,
            id="cached prompt tokens are skipped",
        ),
        pytest.param(
            ttft.Params(),
            Load(MetricsSnapshot(prefill_tokens_per_s=TPUT), cached=1500),
            0.0,
            id="a cache longer than the estimated prompt leaves nothing to prefill",
        ),
    ],
)
def test_ttft_scorer_predicts_time_to_first_token(
    params: ttft.Params, load: Load, predicted_s: float
) -> None:
    scorer = ttft.TtftScorer("ttft", params)
    expected = params.slo_s / (params.slo_s + predicted_s)
    assert score_one(scorer, load, prompt_len=1000) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("slo_s", "expected"),
    [
        pytest.param(1.0, 0.5, id="predicted equal to the SLO scores 0.5"),
        pytest.param(3.0, 0.75, id="a looser SLO scores the same prediction higher"),
    ],
)
def test_ttft_scorer_slo(slo_s: float, expected: float) -> None:
    scorer = ttft.TtftScorer("ttft", ttft.Params(slo_s=slo_s))
    assert score_one(scorer, Load(MetricsSnapshot(prefill_tokens_per_s=TPUT))) == pytest.approx(expected)


# --- tpot-scorer -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("load", "predicted_s"),
    [
        pytest.param(Load(), 0.02, id="idle and unmeasured: the default TPOT"),
        pytest.param(
            Load(MetricsSnapshot(tpot_s=0.04, num_running=4)), 0.05, id="joining a batch of 4 makes it 5"
        ),
        pytest.param(
            Load(MetricsSnapshot(tpot_s=0.04, num_running=4), in_flight=4),
            0.09,
            id="in-flight requests join the batch too",
        ),
        pytest.param(
            Load(MetricsSnapshot(tpot_s=0.01), in_flight=3),
            0.04,
            id="nothing running: the measured TPOT scales with in-flight plus this request",
        ),
        pytest.param(
            Load(MetricsSnapshot(num_running=1)), 0.04, id="unmeasured TPOT uses the default, still scaled"
        ),
        pytest.param(
            Load(MetricsSnapshot(tpot_s=0.0)), 0.02, id="a zero TPOT reading falls back to the default"
        ),
    ],
)
def test_tpot_scorer_predicts_time_per_output_token(load: Load, predicted_s: float) -> None:
    scorer = tpot.TpotScorer("tpot", tpot.Params())
    assert score_one(scorer, load) == pytest.approx(0.05 / (0.05 + predicted_s))


# --- prefix-scorer -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "cached", "expected"),
    [
        pytest.param(1000, 0, 0.0, id="nothing cached scores 0"),
        pytest.param(1000, 500, 0.5, id="half the prompt cached scores 0.5"),
        pytest.param(1000, 1000, 1.0, id="the whole prompt cached scores 1"),
        pytest.param(1000, 4000, 1.0, id="more cached than the estimated prompt is clamped to 1"),
        pytest.param(0, 16, 0.0, id="an empty prompt scores 0"),
    ],
)
def test_prefix_scorer(prompt_len: int, cached: int, expected: float) -> None:
    scorer = prefix.PrefixScorer("prefix", prefix.Params())
    assert score_one(scorer, Load(cached=cached), prompt_len=prompt_len) == pytest.approx(expected)


# --- how scores order instances ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("type_name", "better", "worse"),
    [
        pytest.param(
            "queue-scorer", Load(in_flight=1), Load(in_flight=5), id="queue: more in-flight scores lower"
        ),
        pytest.param(
            "queue-scorer",
            Load(MetricsSnapshot(num_waiting=1)),
            Load(MetricsSnapshot(num_waiting=3)),
            id="queue: a longer engine queue scores lower",
        ),
        pytest.param(
            "kv-usage-scorer",
            Load(MetricsSnapshot(kv_cache_usage=0.2)),
            Load(MetricsSnapshot(kv_cache_usage=0.8)),
            id="kv-usage: a fuller KV cache scores lower",
        ),
        pytest.param(
            "ttft-scorer",
            Load(in_flight=0),
            Load(in_flight=3),
            id="ttft: more in-flight requests score lower",
        ),
        pytest.param(
            "ttft-scorer",
            Load(MetricsSnapshot(prefill_tokens_per_s=20000)),
            Load(MetricsSnapshot(prefill_tokens_per_s=2000)),
            id="ttft: slower measured prefill scores lower",
        ),
        pytest.param(
            "ttft-scorer", Load(cached=900), Load(cached=0), id="ttft: a prefix-cache hit scores higher"
        ),
        pytest.param(
            "tpot-scorer",
            Load(MetricsSnapshot(tpot_s=0.02, num_running=8)),
            Load(MetricsSnapshot(tpot_s=0.02, num_running=8), in_flight=8),
            id="tpot: more in-flight requests score lower",
        ),
        pytest.param(
            "tpot-scorer",
            Load(MetricsSnapshot(tpot_s=0.01)),
            Load(MetricsSnapshot(tpot_s=0.03)),
            id="tpot: a slower measured TPOT scores lower",
        ),
        pytest.param(
            "prefix-scorer", Load(cached=600), Load(cached=200), id="prefix: a longer hit scores higher"
        ),
    ],
)
def test_the_better_instance_scores_higher(type_name: str, better: Load, worse: Load) -> None:
    good, bad = score_pair(default_scorer(type_name), better, worse)
    assert good > bad


EXTREME = Load(
    MetricsSnapshot(
        num_running=10**9,
        num_waiting=10**9,
        kv_cache_usage=1e9,
        tpot_s=1e9,
        queue_s=1e9,
        prefill_tokens_per_s=1e-9,
        mean_prompt_tokens=1e9,
    ),
    in_flight=10**9,
    cached=10**12,
)


@pytest.mark.parametrize("type_name", list(SCORER_MODULES))
@pytest.mark.parametrize(
    "load",
    [
        pytest.param(Load(), id="an idle unmeasured instance"),
        pytest.param(EXTREME, id="an absurdly loaded instance"),
    ],
)
def test_scores_stay_in_range_for_extreme_loads(type_name: str, load: Load) -> None:
    assert 0.0 <= score_one(default_scorer(type_name), load) <= 1.0


optional_s = st.none() | st.floats(0.0, 1e4)
metrics_strategy = st.builds(
    MetricsSnapshot,
    num_running=st.integers(0, 10**6),
    num_waiting=st.integers(0, 10**6),
    kv_cache_usage=st.floats(0.0, 1.5),
    ttft_s=optional_s,
    tpot_s=optional_s,
    queue_s=optional_s,
    prefill_tokens_per_s=st.none() | st.floats(0.0, 1e7),
    mean_prompt_tokens=st.none() | st.floats(0.0, 1e6),
)


@st.composite
def contexts(draw: st.DrawFn) -> tuple[ProfileContext, int]:
    """A context over random instances, in-flight counts and prefix matches; and the candidate count."""
    metrics = draw(st.lists(metrics_strategy, max_size=16))
    views = [view(f"i{n}", metrics=m) for n, m in enumerate(metrics)]
    prompt_len = draw(st.integers(0, 10**6))
    in_flight: Mapping[str, int] = {v.agent_id: draw(st.integers(0, 10**4)) for v in views}
    cached = {v.agent_id: n for v in views if (n := draw(st.integers(0, 2 * prompt_len + 1)))}
    req = request(prompt_len=prompt_len, cached=cached)
    return context(snapshot(*views, in_flight=in_flight), req=req), len(views)


@settings(deadline=None)
@given(drawn=contexts())
@pytest.mark.parametrize("type_name", list(SCORER_MODULES))
def test_every_scorer_returns_one_score_in_range_per_candidate(
    type_name: str, drawn: tuple[ProfileContext, int]
) -> None:
    ctx, n = drawn
    scores = list(default_scorer(type_name).score(ctx, ctx.snapshot.instances))
    assert len(scores) == n
    assert all(0.0 <= s <= 1.0 for s in scores), scores


# --- params and registration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "kwargs", "message"),
    [
        pytest.param(queue.Params, {"max_queue": 0}, "queue-scorer: max_queue must be > 0", id="max_queue 0"),
        pytest.param(
            queue.Params, {"max_queue": -4}, "queue-scorer: max_queue must be > 0", id="max_queue < 0"
        ),
        pytest.param(
            queue.Params,
            {"max_queue": math.inf},
            "max_queue must be a finite number",
            id="infinite max_queue",
        ),
        pytest.param(ttft.Params, {"slo_s": 0.0}, "ttft-scorer: slo_s must be > 0", id="a zero TTFT SLO"),
        pytest.param(
            ttft.Params,
            {"default_prefill_tokens_per_s": -1.0},
            "ttft-scorer: default_prefill_tokens_per_s must be > 0",
            id="a negative default prefill throughput",
        ),
        pytest.param(
            ttft.Params, {"slo_s": "1s"}, "slo_s must be a finite number", id="a TTFT SLO with a unit"
        ),
        pytest.param(
            tpot.Params, {"slo_s": -0.05}, "tpot-scorer: slo_s must be > 0", id="a negative TPOT SLO"
        ),
        pytest.param(
            tpot.Params,
            {"default_tpot_s": 0},
            "tpot-scorer: default_tpot_s must be > 0",
            id="a zero default TPOT",
        ),
        pytest.param(
            tpot.Params,
            {"default_tpot_s": math.nan},
            "default_tpot_s must be a finite number",
            id="a NaN TPOT",
        ),
    ],
)
def test_scorer_params_reject_bad_values(params: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params(**kwargs)


@pytest.mark.parametrize(("type_name", "module"), list(SCORER_MODULES.items()))
def test_every_scorer_is_registered_under_its_type(type_name: str, module: ModuleType) -> None:
    spec = PLUGIN_SPECS[type_name]
    assert spec is module.PLUGIN
    assert (spec.type, spec.kind, spec.params) == (type_name, "scorer", module.Params)
    plugin = spec.factory("mine", module.Params())
    assert (plugin.TYPE, plugin.name, module.TYPE) == (type_name, "mine", type_name)
