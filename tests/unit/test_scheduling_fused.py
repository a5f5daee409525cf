"""Scheduling scorers' fused pass: the same totals, bit for bit, as each scorer's column summed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import METRICS, SCORERS, context, request, snapshot, view
from vllm_disagg.orchestrator.registry import Registry
from vllm_disagg.orchestrator.scheduling import scheduler as scheduler_module
from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, SchedulingRequest, Scorer
from vllm_disagg.orchestrator.scheduling.fused import fused_totals, weighted_sum
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.scorers import queue
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot

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
        role = "prefill" if i % 2 else "decode"
        registry.hello(f"{role}-{i}", InstanceInfo(url=f"http://h{i}:8000", role=role, model="m"), 0.0)
        metrics = MetricsSnapshot(num_running=i % 5, num_waiting=i % 3, kv_cache_usage=(i % 10) / 10)
        registry.heartbeat(f"{role}-{i}", Heartbeat(seq=1, engine_state="ready", metrics=metrics), 0.0)
    return registry


def test_decisions_and_explanations_are_the_same_with_and_without_the_fused_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fused = PluginScheduler()
    monkeypatch.setattr(scheduler_module, "fused_totals", lambda scorers: None)
    generic = PluginScheduler()
    snap = _cluster().snapshot()
    for n in range(200):
        cached = {f"prefill-{2 * (n % 7) + 1}": 16 * (n % 5), f"decode-{2 * (n % 4)}": 32} if n % 3 else {}
        req = SchedulingRequest(f"r{n}", "m", 50 + n, False, True, cached, True)
        a, b = fused.decide(req, snap, 0.0), generic.decide(req, snap, 0.0)
        assert (a.mode, a.prefill, a.decode) == (b.mode, b.prefill, b.decode)
        assert a.explanation is not None and b.explanation is not None
        assert a.explanation.to_json() == b.explanation.to_json(), "the lazily computed scores match"
