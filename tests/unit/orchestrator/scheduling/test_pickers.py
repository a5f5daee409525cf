"""Scheduling pickers: which index each picks, determinism per request id, and how picks spread."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import context, request, snapshot
from vllm_disagg.orchestrator.scheduling.framework import Picker, ProfileContext
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.pickers import max_score, power_of_two, weighted_random

PICKER_MODULES: dict[str, ModuleType] = {
    "max-score-picker": max_score,
    "power-of-two-picker": power_of_two,
    "weighted-random-picker": weighted_random,
}
SNAP = snapshot()
MANY = 4000  # request ids for the frequency tests


def ctx_for(request_id: str) -> ProfileContext:
    return context(SNAP, req=request(request_id))


def picker(type_name: str) -> Picker:
    return PLUGIN_SPECS[type_name].factory(type_name, PICKER_MODULES[type_name].Params())  # type: ignore[return-value]


def frequencies(p: Picker, totals: Sequence[float], n: int = MANY) -> list[float]:
    counts = Counter(p.pick(ctx_for(f"req-{i}"), totals) for i in range(n))
    return [counts[i] / n for i in range(len(totals))]


# --- all pickers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", list(PICKER_MODULES))
def test_a_single_candidate_is_always_picked(type_name: str) -> None:
    p = picker(type_name)
    assert {p.pick(ctx_for(f"req-{i}"), [0.3]) for i in range(50)} == {0}


@pytest.mark.parametrize("type_name", list(PICKER_MODULES))
def test_the_pick_is_a_function_of_the_request_id(type_name: str) -> None:
    totals = [0.5, 0.5, 0.2, 0.5, 0.9, 0.9, 0.1]
    first = [picker(type_name).pick(ctx_for(f"req-{i}"), totals) for i in range(200)]
    again = [picker(type_name).pick(ctx_for(f"req-{i}"), totals) for i in range(200)]
    assert first == again
    assert all(0 <= i < len(totals) for i in first)


@pytest.mark.parametrize(("type_name", "module"), list(PICKER_MODULES.items()))
def test_every_picker_is_registered_under_its_type(type_name: str, module: ModuleType) -> None:
    spec = PLUGIN_SPECS[type_name]
    assert spec is module.PLUGIN
    assert (spec.type, spec.kind, spec.params) == (type_name, "picker", module.Params)
    plugin = spec.factory("mine", module.Params())
    assert (plugin.TYPE, plugin.name, module.TYPE) == (type_name, "mine", type_name)


# --- max-score-picker --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        pytest.param([0.1, 0.9, 0.5], 1, id="the highest total wins"),
        pytest.param([2.0, 1.0], 0, id="the highest total wins when it comes first"),
        pytest.param([0.0, 0.0, 1e-9], 2, id="a tiny margin is still a win"),
        pytest.param([-1.0, -0.5], 1, id="negative totals: the least negative wins"),
    ],
)
def test_max_score_picks_the_maximum(totals: list[float], expected: int) -> None:
    p = max_score.MaxScorePicker("max", max_score.Params())
    assert {p.pick(ctx_for(f"req-{i}"), totals) for i in range(50)} == {expected}


def test_max_score_ties_spread_over_the_tied_candidates_across_request_ids() -> None:
    p = max_score.MaxScorePicker("max", max_score.Params())
    freq = frequencies(p, [1.0, 0.5, 1.0, 1.0, 0.0, 1.0])
    assert freq[1] == freq[4] == 0.0
    for tied in (0, 2, 3, 5):
        assert freq[tied] == pytest.approx(0.25, abs=0.05)


# --- power-of-two-picker -----------------------------------------------------------------------------


def test_power_of_two_with_two_candidates_always_picks_the_better() -> None:
    # Had the two draws not been distinct, some requests would get the worse candidate.
    p = power_of_two.PowerOfTwoPicker("p2c", power_of_two.Params())
    assert frequencies(p, [0.2, 0.7]) == [0.0, 1.0]
    assert frequencies(p, [0.7, 0.2]) == [1.0, 0.0]


@settings(deadline=None)
@given(
    totals=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=20, unique=True),
    request_id=st.text(min_size=1, max_size=20),
)
def test_power_of_two_never_picks_the_lower_of_its_draws(totals: list[float], request_id: str) -> None:
    ctx = ctx_for(request_id)
    n = len(totals)
    first = int(ctx.random(0) * n)
    second = int(ctx.random(1) * (n - 1))
    second += second >= first
    chosen = power_of_two.PowerOfTwoPicker("p2c", power_of_two.Params()).pick(ctx, totals)
    assert chosen in (first, second)
    assert totals[chosen] == max(totals[first], totals[second])
    assert totals[chosen] > min(totals)  # the worst candidate loses to whatever it is drawn with


def test_power_of_two_tie_goes_to_the_first_draw() -> None:
    p = power_of_two.PowerOfTwoPicker("p2c", power_of_two.Params())
    for i in range(200):
        ctx = ctx_for(f"req-{i}")
        assert p.pick(ctx, [0.5] * 7) == int(ctx.random(0) * 7)


def test_power_of_two_spreads_by_rank() -> None:
    # With n distinct totals, the k-th worst (k from 0) wins when drawn with a worse one: k / C(n, 2).
    p = power_of_two.PowerOfTwoPicker("p2c", power_of_two.Params())
    freq = frequencies(p, [0.4, 0.1, 0.9, 0.6])
    expected = [1 / 6, 0.0, 3 / 6, 2 / 6]
    assert freq == pytest.approx(expected, abs=0.04)


# --- weighted-random-picker --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("totals", "expected"),
    [
        pytest.param([1.0, 3.0, 0.0, 6.0], [0.1, 0.3, 0.0, 0.6], id="frequency follows the totals"),
        pytest.param([0.0, 0.0, 0.0, 0.0], [0.25] * 4, id="all totals zero: uniform"),
        pytest.param([2.0, -5.0, 2.0], [0.5, 0.0, 0.5], id="a negative total counts as zero"),
        pytest.param([0.0, 0.0, 0.3], [0.0, 0.0, 1.0], id="the only positive total always wins"),
    ],
)
def test_weighted_random_frequencies(totals: list[float], expected: list[float]) -> None:
    p = weighted_random.WeightedRandomPicker("wr", weighted_random.Params())
    freq = frequencies(p, totals)
    assert freq == pytest.approx(expected, abs=0.04)
    assert all(f == 0.0 for f, e in zip(freq, expected, strict=True) if e == 0.0)
