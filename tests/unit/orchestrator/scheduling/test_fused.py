"""Scheduling scorers' fused pass: the same totals, bit for bit, as each scorer's column summed."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import METRICS, POSITIVE, SCORERS, context, request, snapshot, view
from vllm_disagg.orchestrator.scheduling import scheduler as scheduler_module
from vllm_disagg.orchestrator.scheduling.config import default_config
from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, SchedulingRequest, Scorer
from vllm_disagg.orchestrator.scheduling.fused import fused_totals, weighted_sum
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.scorers import kv_usage, prefix, queue, tpot, ttft
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role

WEIGHT = st.sampled_from([0.0, 1.0, 2.0, 0.5]) | st.floats(min_value=0.0, max_value=10.0)


def hexes(values: list[float]) -> list[str]:
    return [v.hex() for v in values]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(SCORERS, WEIGHT), min_size=1, max_size=6),
    st.lists(st.tuples(METRICS, st.integers(0, 40), st.integers(-5, 3000)), min_size=1, max_size=8),
    st.integers(-10, 2000),
)
def test_fused_totals_are_the_scorers_columns_weighted_and_added_bit_for_bit(
    scorers: list[tuple[Scorer, float]], loads: list[tuple[MetricsSnapshot, int, int]], prompt_len: int
) -> None:
    candidates = [view(f"c{i}", metrics=m) for i, (m, _, _) in enumerate(loads)]
    in_flight = {f"c{i}": f for i, (_, f, _) in enumerate(loads) if f}
    cached = {f"c{i}": k for i, (_, _, k) in enumerate(loads) if k}
    ctx = context(
        snapshot(*candidates, in_flight=in_flight), req=request(prompt_len=prompt_len, cached=cached)
    )
    fused = fused_totals(scorers)
    columns = [s.score(ctx, candidates) for s, _ in scorers]
    expected = weighted_sum([w for _, w in scorers])(columns, len(candidates))
    if fused is None:
        assert not any(w for _, w in scorers), "every shipped scorer fuses: only all-zero weights do not"
        return
    assert hexes(fused(ctx, candidates)) == hexes(expected)


# The shipped profiles' scorers in their order (default.yaml), any parameters, any positive weights.
SHIPPED = st.tuples(
    st.builds(queue.Params, max_queue=POSITIVE).map(lambda p: PLUGIN_SPECS[queue.TYPE].factory("q", p)),
    st.just(PLUGIN_SPECS[kv_usage.TYPE].factory("kv", kv_usage.Params())),
    st.builds(tpot.Params, slo_s=POSITIVE, default_tpot_s=POSITIVE).map(
        lambda p: PLUGIN_SPECS[tpot.TYPE].factory("tpot", p)
    )
    | st.builds(ttft.Params, slo_s=POSITIVE, default_prefill_tokens_per_s=POSITIVE).map(
        lambda p: PLUGIN_SPECS[ttft.TYPE].factory("ttft", p)
    ),
    st.just(PLUGIN_SPECS[prefix.TYPE].factory("prefix", prefix.Params())),
)
POSITIVE_WEIGHT = st.sampled_from([1.0, 2.0, 0.5]) | st.floats(min_value=1e-3, max_value=10.0)


@settings(max_examples=400, deadline=None)
@given(
    SHIPPED,
    st.tuples(POSITIVE_WEIGHT, POSITIVE_WEIGHT, POSITIVE_WEIGHT, POSITIVE_WEIGHT),
    st.lists(st.tuples(METRICS, st.integers(0, 40), st.integers(-5, 3000)), min_size=1, max_size=8),
    st.integers(-10, 2000),
)
def test_the_shipped_profiles_pass_gives_what_their_terms_give_bit_for_bit(
    shipped: tuple[Scorer, Scorer, Scorer, Scorer],
    weights: tuple[float, float, float, float],
    loads: list[tuple[MetricsSnapshot, int, int]],
    prompt_len: int,
) -> None:
    # Its three candidate-only scores are written out a second time for speed: this is what keeps
    # them the terms' (and its prediction the one formula's).
    scorers = list(zip(shipped, weights, strict=True))
    candidates = [view(f"c{i}", metrics=m) for i, (m, _, _) in enumerate(loads)]
    in_flight = {f"c{i}": f for i, (_, f, _) in enumerate(loads) if f}
    cached = {f"c{i}": k for i, (_, _, k) in enumerate(loads) if k}
    ctx = context(
        snapshot(*candidates, in_flight=in_flight), req=request(prompt_len=prompt_len, cached=cached)
    )
    fused = fused_totals(scorers)
    assert fused is not None and fused.__qualname__.startswith("_shipped"), "the precompiled pass is chosen"
    columns = [s.score(ctx, candidates) for s in shipped]  # each the scorer's term, candidate by candidate
    expected = weighted_sum(list(weights))(columns, len(candidates))
    assert hexes(fused(ctx, candidates)) == hexes(expected)


@settings(max_examples=200, deadline=None)
@given(
    SHIPPED,
    st.lists(METRICS, min_size=1, max_size=4),
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3000)), min_size=1, max_size=6
        ),
        min_size=2,
        max_size=5,
    ),
    st.integers(0, 2000),
)
def test_what_the_shipped_pass_keeps_between_decisions_never_changes_a_total(
    shipped: tuple[Scorer, Scorer, Scorer, Scorer],
    metrics: list[MetricsSnapshot],
    decisions: list[list[tuple[int, int, int]]],
    prompt_len: int,
) -> None:
    # One pass (one profile's weights) over decisions in turn, each of candidates whose metrics objects
    # and in-flight counts come back in new combinations, as instances report and requests come and
    # go: every decision's totals are its terms', whatever earlier decisions left kept.
    scorers = [(s, 1.0) for s in shipped]
    fused = fused_totals(scorers)
    assert fused is not None
    for n, drawn in enumerate(decisions):
        candidates = [view(f"c{i}", metrics=metrics[m % len(metrics)]) for i, (m, _, _) in enumerate(drawn)]
        in_flight = {f"c{i}": f for i, (_, f, _) in enumerate(drawn) if f}
        cached = {f"c{i}": k for i, (_, _, k) in enumerate(drawn) if k}
        ctx = context(
            snapshot(*candidates, in_flight=in_flight),
            req=request(f"r{n}", prompt_len=prompt_len, cached=cached),
        )
        columns = [s.score(ctx, candidates) for s in shipped]
        expected = weighted_sum([1.0] * 4)(columns, len(candidates))
        assert hexes(fused(ctx, candidates)) == hexes(expected), f"decision {n}"


@pytest.mark.parametrize(
    "types",
    [
        pytest.param(
            (prefix.TYPE, tpot.TYPE, kv_usage.TYPE, queue.TYPE), id="the shipped scorers in another order"
        ),
        pytest.param((queue.TYPE, kv_usage.TYPE, tpot.TYPE), id="one of them left out"),
        pytest.param((queue.TYPE, kv_usage.TYPE, ttft.TYPE, tpot.TYPE), id="both predictions"),
    ],
)
def test_any_other_profile_adds_its_scorers_terms(types: tuple[str, ...]) -> None:
    modules = {m.TYPE: m for m in (queue, kv_usage, tpot, ttft, prefix)}
    scorers: list[tuple[Scorer, float]] = [
        (PLUGIN_SPECS[t].factory(t, modules[t].Params()), 1.0)  # type: ignore[misc]
        for t in types
    ]
    fused = fused_totals(scorers)
    assert fused is not None and not fused.__qualname__.startswith("_shipped")


class Opaque:
    """A scorer without a ``term``."""

    TYPE = "opaque-scorer"

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, ctx: object, candidates: list[object]) -> list[float]:
        return [0.5] * len(candidates)


@pytest.mark.parametrize(
    ("weight", "fuses"),
    [
        pytest.param(1.0, False, id="a weighted scorer without a term keeps the profile on the generic path"),
        pytest.param(0.0, True, id="one of weight 0 is never computed, so it does not matter"),
    ],
)
def test_a_profile_fuses_only_when_every_weighted_scorer_has_a_term(weight: float, fuses: bool) -> None:
    spec: PluginSpec = PLUGIN_SPECS[queue.TYPE]
    scorers: list[tuple[Scorer, float]] = [(spec.factory("q", queue.Params()), 1.0), (Opaque("o"), weight)]  # type: ignore[list-item]
    assert (fused_totals(scorers) is not None) == fuses


def _cluster() -> Registry:
    registry = Registry(heartbeat_timeout_s=1e9)
    for i in range(40):
        role: Role = "prefill" if i % 2 else "decode"
        registry.hello(f"{role}-{i}", InstanceInfo(url=f"http://h{i}:8000", role=role, model="m"), 0.0)
        metrics = MetricsSnapshot(num_running=i % 5, num_waiting=i % 3, kv_cache_usage=(i % 10) / 10)
        registry.heartbeat(f"{role}-{i}", Heartbeat(seq=1, engine_state="ready", metrics=metrics), 0.0)
    return registry


def test_decisions_and_explanations_are_the_same_with_and_without_the_fused_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sampled = dataclasses.replace(default_config(), ranked=False)  # the ranked path needs the fused pass
    fused = PluginScheduler(sampled)
    monkeypatch.setattr(scheduler_module, "fused_pass", lambda scorers: (None, None))
    generic = PluginScheduler(sampled)
    snap = _cluster().snapshot()
    for n in range(200):
        cached = {f"prefill-{2 * (n % 7) + 1}": 16 * (n % 5), f"decode-{2 * (n % 4)}": 32} if n % 3 else {}
        req = SchedulingRequest(f"r{n}", "m", 50 + n, False, True, cached, True)
        a, b = fused.decide(req, snap, 0.0), generic.decide(req, snap, 0.0)
        assert (a.mode, a.prefill, a.decode) == (b.mode, b.prefill, b.decode)
        assert a.explanation is not None and b.explanation is not None
        assert a.explanation.to_json() == b.explanation.to_json(), "the lazily computed scores match"
