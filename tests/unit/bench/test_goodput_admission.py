"""``bench goodput --scenario admission|tenants``: the requests' classes and tenants, the figures per
class and tenant (a refusal is a miss), medians over rounds, the 75% rate, and the issue's targets."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from vllm_disagg import jsonutil
from vllm_disagg.bench.goodput import TraceSpec, make_trace
from vllm_disagg.bench.goodput_admission import admission_spec, label, point_json
from vllm_disagg.bench.goodput_admission_report import (
    AdmissionPoint,
    Outcome,
    Slice,
    median_point,
    next_rate,
    rate_at_attainment,
    render_points,
    summarise,
    tenant_verdicts,
    verdicts,
)
from vllm_disagg.bench.goodput_main import add_arguments
from vllm_disagg.cli.commands import main

SMALL = TraceSpec(seed=7, documents=50, zipf=1.0, doc_tokens=(40, 60), question_tokens=(4, 8))
MIX = ((-1, 0.2), (0, 0.6), (1, 0.2))


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--scenario", "admission", *argv])


def test_a_request_has_the_same_class_and_tenant_at_every_rate() -> None:
    tenants = (("a", 1.0), ("b", 3.0))
    slow = label(make_trace(SMALL, 2.0, 60.0), 0, MIX, tenants)
    fast = label(make_trace(SMALL, 4.0, 60.0), 0, MIX, tenants)
    assert len(fast) > len(slow)
    for a, b in zip(slow, fast, strict=False):
        assert (a.request.prompt, a.priority, a.tenant) == (b.request.prompt, b.priority, b.tenant)
    other = label(make_trace(SMALL, 2.0, 60.0), 1, MIX, tenants)
    assert [x.priority for x in other] != [x.priority for x in slow]


def test_classes_and_tenants_are_drawn_in_their_shares() -> None:
    items = label(make_trace(SMALL, 10.0, 1000.0), 0, MIX, (("a", 1.0), ("b", 3.0)))
    priorities = Counter(i.priority for i in items)
    tenants = Counter(i.tenant for i in items)
    n = len(items)
    assert [priorities[p] / n for p, _ in MIX] == pytest.approx([0.2, 0.6, 0.2], abs=0.02)
    assert tenants["b"] / n == pytest.approx(0.75, abs=0.02)
    assert {i.priority for i in label(make_trace(SMALL, 10.0, 10.0), 0)} == {0}  # the defaults


def _o(at: float, priority: int, status: int, *, ttft: float = 0.1, tpot: float = 0.01, **kw: str) -> Outcome:
    return Outcome(
        at, priority, kw.get("tenant", "t"), status, status == 200, ttft, tpot, kw.get("reason", "")
    )


def test_a_refused_request_is_a_miss_in_attainment_and_every_answer_is_counted_by_kind() -> None:
    outcomes = [
        _o(1.0, 0, 200),  # warm-up: not counted
        _o(3.0, -1, 200, tenant="a"),  # met
        _o(4.0, -1, 200, ttft=1.5, tenant="a"),  # TTFT missed
        _o(5.0, 0, 429, reason="deadline_unreachable"),
        _o(6.0, 1, 429, reason="sheddable", tenant="a"),
        _o(7.0, 1, 429, reason="sheddable"),
        _o(8.0, 0, 503),  # a 5xx
        _o(9.0, 0, 0),  # no answer
        _o(10.0, 0, 200, tpot=0.06),  # TPOT missed
    ]
    p = summarise("admission-on", 8.0, 1.5, outcomes, ttft_ms=1000, tpot_ms=50, warmup_s=2.0, window_s=10.0)
    assert p.total == Slice(requests=8, met=1, refused=3, attainment=0.125, goodput_rps=0.1)
    assert p.classes[-1] == Slice(2, 1, 0, 0.5, 0.1)
    assert p.classes[1] == Slice(2, 0, 2, 0.0, 0.0) and p.classes[1].refused_share == 1.0
    assert (p.classes[0].requests, p.classes[0].refused) == (4, 1)
    assert p.tenants["a"] == Slice(3, 1, 1, 0.3333, 0.1)
    assert p.shed == {"deadline_unreachable": 1, "sheddable": 2}
    assert (p.server_errors, p.failed) == (1, 1)
    assert (p.ttft_p90_ms, p.tpot_p90_ms) == (1500.0, 60.0)  # of the three served


def _point(
    arm: str, rate: float, m: float, goodput: float, classes: dict[int, tuple[float, int]]
) -> AdmissionPoint:
    """``classes``: priority -> (attainment, refused), of 100 requests each."""
    slices = {k: Slice(100, round(a * 100), r, a, goodput / 3) for k, (a, r) in classes.items()}
    refused = sum(s.refused for s in slices.values())
    return AdmissionPoint(arm, rate, m, Slice(300, 0, refused, 0.0, goodput), slices)


def test_rounds_give_medians_per_class_a_class_missing_in_a_round_counts_as_none() -> None:
    rounds = [_point("on", 10, 1, g, {0: (a, 5)}) for g, a in ((5.0, 0.5), (7.0, 0.7), (6.0, 0.6))]
    rounds[0].classes[1] = Slice(30, 3, 0, 0.1, 0.3)
    rounds[1].server_errors = 2
    p = median_point(rounds)
    assert (p.total.goodput_rps, p.goodput_range, p.rounds) == (6.0, (5.0, 7.0), 3)
    assert p.classes[0].attainment == 0.6 and p.classes[1] == Slice(0, 0, 0, 0.0, 0.0)
    assert p.server_errors == 2  # any round's 5xx shows


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        pytest.param([(10, 0.9), (14, 0.8), (18, 0.4)], 14.5, id="interpolated-in-the-crossing-interval"),
        pytest.param([(18, 0.4), (10, 0.75)], 10.0, id="exactly-at-a-rate-in-any-order"),
        pytest.param([(10, 0.9), (12, 0.7), (14, 0.8), (16, 0.5)], 11.5, id="the-first-crossing"),
    ],
)
def test_the_base_rate_is_where_attainment_crosses_75_percent(
    points: list[tuple[float, float]], expected: float
) -> None:
    assert rate_at_attainment(points) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("points", "fragment"),
    [
        pytest.param([(10, 0.7), (14, 0.5)], "lower --rates", id="already-below"),
        pytest.param([(10, 0.99), (14, 0.8)], "higher --rates", id="never-below"),
        pytest.param([], "no rates", id="nothing-measured"),
    ],
)
def test_rates_that_do_not_bracket_75_percent_say_which_way_to_go(
    points: list[tuple[float, float]], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        rate_at_attainment(points)


def test_the_targets_are_checked_past_the_base_rate_each_arm_on_its_own() -> None:
    points = [
        _point("on", 10, 1.0, 8.0, {-1: (1.0, 0), 0: (0.9, 0), 1: (0.9, 0)}),  # at the base: not checked
        _point("on", 15, 1.5, 7.5, {-1: (0.96, 0), 0: (0.8, 10), 1: (0.2, 60)}),
        _point("on", 20, 2.0, 7.0, {-1: (0.94, 5), 0: (0.7, 20), 1: (0.1, 15)}),
        _point("off", 15, 1.5, 2.0, {-1: (0.3, 0), 0: (0.3, 0), 1: (0.3, 0)}),
    ]
    points[-1].server_errors = 1
    found = {(v.arm, v.rate, v.what.split()[0]): v for v in verdicts(points, sheddable_priority=1)}
    assert {k for k, v in found.items() if not v.met} == {
        ("on", 20, "goodput"),  # 7.0 < 0.9 x 8.0
        ("on", 20, "attainment"),  # priority -1 at 94%
        ("on", 20, "refused"),  # the sheddable class refused less than priority 0
        ("off", 15, "attainment"),
        ("off", 15, "5xx"),
    }
    assert found[("on", 15, "goodput")].measured == pytest.approx(7.5 / 8)
    assert found[("on", 15, "refused")].measured == pytest.approx(0.6 - 0.1)
    assert ("off", 15, "goodput") not in found and ("off", 15, "refused") not in found  # nothing lower; none


def test_the_steady_tenant_is_held_to_95_percent() -> None:
    point = AdmissionPoint("on", 20, 0, Slice(10, 5, 5, 0.5, 1.0))
    point.tenants = {"a": Slice(10, 10, 0, 0.96, 1.0), "b": Slice(30, 10, 20, 0.33, 1.0)}
    low = AdmissionPoint("off", 20, 0, point.total, tenants={"a": Slice(10, 9, 0, 0.9, 1.0)})
    found = tenant_verdicts([point, low], "a")
    assert [(v.arm, v.what, v.met) for v in found] == [
        ("on", "attainment of a", True),
        ("on", "5xx answers (negated)", True),
        ("off", "attainment of a", False),
        ("off", "5xx answers (negated)", True),
    ]


def test_the_table_says_a_refusal_is_a_miss_and_lists_every_class() -> None:
    table = "\n".join(render_points([_point("on", 15, 1.5, 7.5, {-1: (1.0, 0), 1: (0.5, 40)})]))
    assert "attainment (refused = missed)" in table
    assert "| 1.5 | 15 | on | -1 | 100 | 0 (0.0%) | 100.0% |" in table
    assert "| 1.5 | 15 | on | 1 | 100 | 40 (40.0%) | 50.0% |" in table


def test_a_point_is_json_with_its_classes_by_name() -> None:
    point = _point("on", 15, 1.5, 7.5, {-1: (1.0, 0), 1: (0.5, 40)})
    data = jsonutil.loads(jsonutil.dumps(point_json(point)))
    assert data["classes"]["-1"]["attainment"] == 1.0 and data["classes"]["1"]["refused"] == 40


def test_the_arms_differ_only_in_admission_and_carry_no_planner_or_default_targets() -> None:
    a = args()
    off, on = (admission_spec(arm, a).orchestrator_argv() for arm in ("admission-off", "admission-on"))
    assert off[-2:] == ["--admission", "off"] and on[-2:] == ["--admission", "on"]
    assert off[:-2] == on[:-2]
    assert not {"--planner-config", "--slo-ttft-ms", "--slo-tpot-ms"} & set(on)


def test_the_flags_parse_priorities_and_an_automatic_base_rate() -> None:
    a = args("--base-rate", "auto", "--priorities", "-2", "3", "--priority-shares", "1", "0.5")
    assert a.base_rate is None and (a.priorities, a.priority_shares) == ([-2, 3], [1.0, 0.5])
    assert args().base_rate > 0 and args().multipliers == [1.0, 1.5, 2.0]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--base-rate", "0"], id="no-base-rate"),
        pytest.param(["--priorities", "x"], id="priority-not-a-number"),
        pytest.param(["--scenario", "other"], id="no-such-scenario"),
    ],
)
def test_a_bad_flag_is_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        args(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--multipliers", "0"], id="no-multiple"),
        pytest.param(["--priority-shares", "0", "0", "0"], id="no-class-with-a-share"),
        pytest.param(["--priority-shares", "1", "-1", "1"], id="negative-share"),
        pytest.param(["--priorities", "0", "1"], id="a-share-per-priority"),
        pytest.param(["--warmup-s", "60"], id="warm-up-past-the-end"),
        pytest.param(["--scenario", "tenants", "--share-rps", "0"], id="tenant-without-a-share"),
    ],
)
def test_the_command_refuses_a_bad_scenario_before_starting_anything(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "goodput", "--scenario", "admission", *argv]) == 2
    assert "bench goodput: configuration error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        pytest.param([(10, 0.99), (14, 0.8)], 17.5, id="all-above-go-a-quarter-higher"),
        pytest.param([(10, 0.7), (14, 0.5)], 8.0, id="all-below-go-a-fifth-lower"),
        pytest.param([(10, 0.9), (14, 0.6)], None, id="bracketed-stop"),
    ],
)
def test_the_search_extends_the_rates_until_they_bracket_75_percent(
    points: list[tuple[float, float]], expected: float | None
) -> None:
    assert next_rate(points) == expected
