"""The planner's decision, as a table of looks: pools' figures in, at most one shift out."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.planner.config import PlannerConfig, load_planner_config
from vllm_disagg.orchestrator.planner.decide import (
    Memory,
    Plan,
    PoolSignals,
    plan,
    remember_change,
    suggest_ratio,
)
from vllm_disagg.orchestrator.planner.signals import SloWindow

CONFIG = PlannerConfig(
    dry_run=False, ttft_target_s=1.0, tpot_target_s=0.05, sustain=3, cooldown_s=60.0, min_samples=20
)


def pools(
    ttft_p90: float | None,
    tpot_p90: float | None,
    *,
    sizes: tuple[int, int] = (2, 2),
    samples: int = 100,
    movable: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
) -> tuple[PoolSignals, PoolSignals]:
    p, d = sizes
    prefill_ids = tuple(f"p{i}" for i in range(p))
    decode_ids = tuple(f"d{i}" for i in range(d))
    movable = movable if movable is not None else (prefill_ids, decode_ids)
    return (
        PoolSignals(p, ttft_p90, samples, movable=movable[0]),
        PoolSignals(d, tpot_p90, samples, movable=movable[1]),
    )


def run(
    looks: list[tuple[PoolSignals, PoolSignals]], config: PlannerConfig = CONFIG, step_s: float = 5.0
) -> list[Plan]:
    """Each look ``step_s`` after the last, the memory carried."""
    memory, out = Memory(), []
    for i, (prefill, decode) in enumerate(looks):
        result = plan(prefill, decode, memory, config, now=1000.0 + i * step_s)
        memory = result.memory
        out.append(result)
    return out


def shifts(plans: list[Plan]) -> list[tuple[int, str, str, str]]:
    return [(i, p.shift.agent_id, p.shift.from_role, p.shift.to_role) for i, p in enumerate(plans) if p.shift]


def test_a_step_change_moves_exactly_one_instance_after_sustain_looks_then_its_effect_is_seen() -> None:
    """Longer prompts arrive: the prefill pool's TTFT goes from 0.6 to 1.4 s (target 1). Three looks
    later one decode instance moves; on three prefill instances the same work is 0.93 s per request,
    the decode pool's TPOT goes from 0.5 to 1.0 of its target, and nothing else moves."""
    looks = [pools(0.6, 0.03)] * 5 + [pools(1.4, 0.025)] * 3
    looks += [pools(1.4 * 2 / 3, 0.025 * 2, sizes=(3, 1))] * 20  # the same work on 3P1D
    plans = run(looks)
    assert shifts(plans) == [(7, "d0", "decode", "prefill")]
    assert "short" in plans[7].reason and "3 looks in a row" in plans[7].reason
    assert plans[7].figures["prefill_pressure"] == 1.4 and plans[7].figures["decode_pressure"] == 0.5
    assert plans[7].ratio == (3, 1), "the split it would choose for this load"
    assert all("balanced" in p.reason for p in plans[8:]), [p.reason for p in plans[8:]]


@pytest.mark.parametrize(
    "series",
    [
        [(1.3, 0.05), (0.9, 0.05), (1.4, 0.05), (0.8, 0.05)] * 10,  # over and under the line in turn
        [(1.2, 0.05)] * 40,  # over the target, but within the margin of the other pool
        [(1.5, 0.02), (0.5, 0.07)] * 20,  # the pools take turns being short
    ],
    ids=["flapping around the target", "within the margin", "alternating pools"],
)
def test_noise_never_moves_an_instance(series: list[tuple[float, float]]) -> None:
    plans = run([pools(ttft, tpot) for ttft, tpot in series])
    assert shifts(plans) == []


def test_the_cooldown_spaces_shifts_while_a_pool_stays_short() -> None:
    plans = run([pools(3.0, 0.01, sizes=(1, 3))] * 30, step_s=10.0)  # the pools' figures never move
    # the 3rd look, then one every 60 s of cooldown (a look every 10 s)
    assert [i for i, *_ in shifts(plans)] == [2, 8, 14, 20, 26]
    assert all("cooldown 60 s" in p.reason for p in plans[5:8])


def test_the_giving_pool_keeps_its_minimum() -> None:
    plans = run([pools(3.0, 0.01, sizes=(3, 1))] * 10)
    assert shifts(plans) == []
    assert "the decode pool is at its minimum of 1" in plans[-1].reason


def test_pinned_instances_stay_where_operators_put_them() -> None:
    plans = run([pools(3.0, 0.01, movable=(("p0", "p1"), ()))] * 10)
    assert shifts(plans) == []
    assert "no decode instance may move" in plans[-1].reason


def test_the_least_busy_movable_instance_moves() -> None:
    plans = run([pools(0.2, 0.2, movable=(("p1", "p0"), ("d0", "d1")))] * 3)
    assert shifts(plans) == [(2, "p1", "prefill", "decode")]


def test_too_few_requests_are_not_judged() -> None:
    plans = run([pools(5.0, 0.01, samples=19)] * 10)
    assert shifts(plans) == []
    assert (
        plans[-1].reason
        == "too few requests in the window to judge (prefill pool 19 of 20, decode pool 19 of 20)"
    )
    assert plans[-1].ratio == (2, 2)


def test_a_recovering_pool_waits() -> None:
    """The pressure falls fast (a burst passing): the streak does not grow until it stops falling."""
    series = [3.0, 3.0, 2.0, 1.5, 1.5, 1.5]
    plans = run([pools(t, 0.01) for t in series])
    assert [p.memory.streak for p in plans] == [1, 2, 2, 2, 0, 1]  # 0: it moved, and starts again
    assert "recovering" in plans[2].reason and "recovering" in plans[3].reason
    assert shifts(plans) == [(4, "d0", "decode", "prefill")]


def test_a_move_that_would_press_the_giver_more_than_it_relieves_the_short_pool_waits() -> None:
    """A closed loop: each pool's p90 goes as its fixed work over its size. 4P4D with the prefill pool
    at 1.6x moves two decode instances (5P3D, then 6P2D); at 6P2D the prefill pool is still short
    (1.07x against 0.8x), but a 7th would leave one decode instance at 1.6x: the split stays."""
    sizes, memory, moves = (4, 4), Memory(), []
    for i in range(30):
        p, d = sizes
        result = plan(*pools(6.4 / p, 0.05 * 1.6 / d, sizes=sizes), memory, CONFIG, now=1000.0 + i * 30)
        memory = result.memory
        if result.shift is not None:
            moves.append(i)
            sizes = (p + 1, d - 1)
    assert sizes == (6, 2) and len(moves) == 2
    assert "moving one would press the decode pool more than it relieves the prefill pool" in result.reason
    assert "6P2D" in result.reason


@pytest.mark.parametrize(
    ("kv_usage", "moves"),
    [
        pytest.param(0.15, True, id="2D-at-15%-leaves-1D-at-about-60%"),
        pytest.param(0.3, False, id="2D-at-30%-would-leave-1D-at-about-120%"),
    ],
)
def test_a_move_that_would_fill_the_givers_kv_cache_waits(kv_usage: float, moves: bool) -> None:
    """The one decode instance left would take twice the requests and, at twice the TPOT, keep each
    twice as long: four times the KV (over the scheduler's kv-usage-filter, it would turn them away)."""
    prefill, decode = pools(3.0, 0.01, sizes=(2, 2))
    decode = dataclasses.replace(decode, kv_usage=kv_usage)
    plans = run([(prefill, decode)] * 3)
    assert bool(shifts(plans)) is moves
    if not moves:
        assert "the decode pool's KV cache would fill: 30% in use now, about 120% on one instance fewer" in (
            plans[-1].reason
        )


def test_an_operators_role_change_starts_the_cooldown() -> None:
    memory = Memory(short="prefill", streak=5, last_shift_at=990.0)
    result = plan(*pools(3.0, 0.01), memory, CONFIG, now=1000.0)
    assert result.shift is None and "10 s ago (cooldown 60 s)" in result.reason


@pytest.mark.parametrize(
    ("sizes", "pressures", "expected"),
    [
        ((2, 2), (2.0, 0.4), (3, 1)),
        ((2, 2), (0.5, 0.5), (2, 2)),
        ((4, 4), (0.2, 1.8), (1, 7)),
        ((1, 7), (None, 1.0), (1, 7)),
        ((2, 6), (1.0, 1.0), (2, 6)),
    ],
)
def test_the_suggested_split_evens_the_pools_work_per_instance(
    sizes: tuple[int, int], pressures: tuple[float | None, float | None], expected: tuple[int, int]
) -> None:
    assert suggest_ratio(sizes, pressures, CONFIG) == expected


def test_the_window_keeps_the_last_window_s_and_gives_its_p90() -> None:
    now = [0.0]
    window = SloWindow(10.0, lambda: now[0])
    for i in range(100):
        window.ttft(i / 100)
    assert window.p90("prefill") == (0.89, 100)
    assert window.p90("decode") == (None, 0)
    now[0] = 10.5  # every sample is older than the window now
    window.tpot(0.02)
    assert window.p90("prefill") == (None, 0) and window.p90("decode") == (0.02, 1)
    window.ttft(float("nan"))
    assert window.p90("prefill") == (None, 0), "not a number is not a sample"


def test_the_yaml_config_is_read_in_camel_case_and_every_field_is_checked() -> None:
    config = load_planner_config(
        "apiVersion: vllm-disagg/v1alpha1\nkind: PlannerConfig\ndryRun: false\nttftTargetS: 0.5\n"
        "sustain: 2\nminDecode: 2\n",
        "p.yaml",
    )
    assert (config.dry_run, config.ttft_target_s, config.sustain, config.min_decode) == (False, 0.5, 2, 2)
    assert config.to_json()["ttftTargetS"] == 0.5


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("dryrun: false", "unknown planner field 'dryrun'"),
        ("dryRun: 0", "dryRun: true or false"),
        ("ttftTargetS: 0", "ttftTargetS: a number > 0"),
        ("sustain: 0", "sustain: an integer >= 1"),
        ("minDecode: -1", "minDecode: an integer >= 0"),
        ("kvUsageCeiling: 1.5", "kvUsageCeiling: a number in (0, 1]"),
        ("kind: SchedulerConfig", "expected apiVersion"),
        ("- 1", "a planner config is a mapping"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=r"p\.yaml") as caught:
        load_planner_config(text, "p.yaml")
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("last_shift_at", "change_at", "remembered"),
    [
        pytest.param(None, None, None, id="no change anywhere: nothing to remember"),
        pytest.param(
            None, 50.0, 50.0, id="an operator's change and no shift yet: the cooldown counts from it"
        ),
        pytest.param(40.0, 50.0, 50.0, id="an operator's change after the last shift counts"),
        pytest.param(60.0, 50.0, 60.0, id="one before the last shift does not"),
        pytest.param(50.0, 50.0, 50.0, id="the planner's own shift, seen again, changes nothing"),
    ],
)
def test_a_role_change_made_elsewhere_counts_for_the_cooldown(
    last_shift_at: float | None, change_at: float | None, remembered: float | None
) -> None:
    memory = Memory("prefill", 2, last_shift_at, (1.5, 0.5))
    after = remember_change(memory, change_at)
    assert after == dataclasses.replace(memory, last_shift_at=remembered)
