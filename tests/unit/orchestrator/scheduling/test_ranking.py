"""The ranking walk: the best totals of every candidate, from the holders and a few ranked instances."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.orchestrator.scheduling.ranking import Ranking, walk

TOTAL = st.floats(min_value=0.0, max_value=6.0, allow_nan=False)
# Per instance: its bound, how far below the bound its total for this prompt is, and whether a filter
# keeps it. Bounds repeat (idle instances tie), so do totals.
INSTANCE = st.tuples(
    st.sampled_from([0.5, 1.0, 2.5]) | TOTAL, st.sampled_from([0.0, 0.25]) | TOTAL, st.booleans()
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(INSTANCE, max_size=30),
    st.lists(TOTAL, max_size=4),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 29), TOTAL), max_size=20),
)
def test_the_walk_finds_every_total_the_flat_scan_would_rank_among_the_best(
    instances: list[tuple[float, float, bool]],
    holders: list[float],
    width: int,
    moves: list[tuple[int, float]],
) -> None:
    ranking = Ranking()
    bounds = {f"i{n:02}": bound for n, (bound, _, _) in enumerate(instances)}
    for agent_id, bound in bounds.items():
        ranking.set(agent_id, bound + 1.0)  # set, then moved: updates keep the order
    for n, bound in moves:  # instances report new metrics: new bounds, some of them
        if n < len(instances):
            bounds[f"i{n:02}"] = bound
    for agent_id, bound in bounds.items():
        ranking.set(agent_id, bound)
    totals = {
        agent_id: max(0.0, bounds[agent_id] - below)
        for agent_id, (_, below, kept) in zip(bounds, instances, strict=True)
        if kept
    }
    found = walk(ranking, holders, width, totals.get)
    everyone = sorted([*holders, *totals.values()], reverse=True)
    if len(everyone) >= width:
        threshold = everyone[width - 1]
        assert {a for a, t in totals.items() if t >= threshold} <= set(found)
    else:
        assert set(found) == set(totals), "fewer candidates than the width: all of them"
    assert set(found) <= set(totals), "only candidates"
    assert [b for b, _ in ranking.best_first()] == sorted(bounds.values(), reverse=True)


def test_a_walk_stops_at_the_first_bound_below_the_best_total() -> None:
    ranking = Ranking()
    for agent_id, bound in {"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.5}.items():
        ranking.set(agent_id, bound)
    scored: list[str] = []

    def score(agent_id: str) -> float:
        scored.append(agent_id)
        return {"a": 1.5, "b": 1.8, "c": 1.0, "d": 0.5}[agent_id]

    assert walk(ranking, [], 1, score) == ["a", "b"]
    assert scored == ["a", "b"], "c's bound (1.0) is below b's total (1.8): c and d are never scored"
    assert walk(ranking, [2.5], 1, score) == ["a"], "a holder's 2.5 stops the walk after a (bound 3.0)"


def test_instances_left_out_by_a_filter_do_not_stop_the_walk() -> None:
    ranking = Ranking()
    for agent_id, bound in {"full": 3.0, "free": 2.0}.items():
        ranking.set(agent_id, bound)
    assert walk(ranking, [], 1, {"free": 2.0}.get) == ["free"]


def test_an_unknown_bound_ranks_first_and_a_discarded_instance_is_gone() -> None:
    ranking = Ranking()
    ranking.set("a", 1.0)
    ranking.set("nan", math.nan)
    assert [a for _, a in ranking.best_first()] == ["nan", "a"]
    ranking.discard("nan")
    ranking.discard("never-ranked")
    assert (len(ranking), ranking.bound("a"), ranking.bound("nan")) == (1, 1.0, None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), TOTAL | st.just(math.nan) | st.none()), max_size=60))
def test_a_ranking_keeps_its_instances_in_order_of_bound_through_any_moves(
    steps: list[tuple[int, float | None]],
) -> None:
    ranking, bounds = Ranking(), dict[str, float]()
    for n, bound in steps:  # None: the instance leaves
        agent_id = f"i{n:02}"
        if bound is None:
            ranking.discard(agent_id)
            bounds.pop(agent_id, None)
        else:
            ranking.set(agent_id, bound)
            bounds[agent_id] = -math.inf if math.isnan(bound) else -bound
    expected = sorted((negated, agent_id) for agent_id, negated in bounds.items())
    assert [(-b, a) for b, a in ranking.best_first()] == expected
    assert len(ranking) == len(bounds)
