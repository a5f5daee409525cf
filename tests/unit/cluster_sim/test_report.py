"""The cluster simulator's report: what meets an SLO, goodput and attainment, percentiles, the prefix
hit rate, attainment over time, medians over rounds and the comparison table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_disagg.cluster_sim.cluster import Outcome
from vllm_disagg.cluster_sim.report import (
    Percentiles,
    Slo,
    attainment,
    attainment_over_time,
    class_table,
    goodput,
    has_classes,
    median,
    medians,
    meets,
    percentile,
    percentiles_ms,
    prefix_hit_rate,
    summarise,
    table,
)

SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def outcome(
    at: float = 0.0,
    ttft: float | None = 0.5,
    tpot: float | None = 0.02,
    *,
    ok: bool = True,
    retries: int = 0,
    resumes: int = 0,
    fallback: bool = False,
) -> Outcome:
    return Outcome(
        "r", at, 100, 10, ok=ok, ttft_s=ttft, tpot_s=tpot, retries=retries, resumes=resumes, fallback=fallback
    )


@pytest.mark.parametrize(
    ("o", "met"),
    [
        pytest.param(outcome(), True, id="finished-within-both-targets"),
        pytest.param(outcome(ttft=1.0, tpot=0.05), True, id="exactly-on-both-targets-meets-them"),
        pytest.param(outcome(ttft=1.01), False, id="ttft-over-target"),
        pytest.param(outcome(tpot=0.051), False, id="tpot-over-target"),
        pytest.param(outcome(tpot=None), True, id="one-token-answer-has-no-tpot-to-miss"),
        pytest.param(outcome(ok=False), False, id="failed-request-fast-as-it-was-never-meets"),
        pytest.param(outcome(ok=False, ttft=None, tpot=None), False, id="failed-before-first-token"),
        pytest.param(outcome(ttft=None), False, id="finished-without-a-ttft-never-meets"),
    ],
)
def test_a_request_meets_its_slo_only_when_it_finished_within_both_targets(o: Outcome, met: bool) -> None:
    assert meets(o, SLO) is met


def test_goodput_is_met_requests_per_second_of_the_trace_and_attainment_their_share() -> None:
    outcomes = [
        outcome(0.0),  # met
        outcome(1.0, ttft=2.0),  # TTFT missed
        outcome(2.0, tpot=0.1),  # TPOT missed
        outcome(3.0, ttft=0.1, tpot=0.01, ok=False),  # failed: never counts
        outcome(4.0),  # met
    ]
    assert goodput(outcomes, SLO, duration_s=4.0) == pytest.approx(0.5)
    assert attainment(outcomes, SLO) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("n", "duration_s", "expected"),
    [
        pytest.param(0, 10.0, 0.0, id="no-requests"),
        pytest.param(1, 0.0, 0.0, id="an-instant-trace-has-no-rate"),
        pytest.param(10, 2.0, 5.0, id="all-met"),
    ],
)
def test_goodput_edges(n: int, duration_s: float, expected: float) -> None:
    assert goodput([outcome() for _ in range(n)], SLO, duration_s) == expected


def test_attainment_of_no_requests_is_zero() -> None:
    assert attainment([], SLO) == 0.0


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param([float(v) for v in range(1, 11)], 0.5, 5.0, id="p50-of-1..10-is-5"),
        pytest.param([float(v) for v in range(1, 11)], 0.9, 9.0, id="p90-of-1..10-is-9"),
        pytest.param([float(v) for v in range(1, 11)], 0.99, 10.0, id="p99-of-1..10-is-10"),
        pytest.param([float(v) for v in range(100, 0, -1)], 0.99, 99.0, id="unsorted-input"),
        pytest.param([7.0], 0.5, 7.0, id="one-value"),
        pytest.param([], 0.9, 0.0, id="no-values"),
    ],
)
def test_percentile_is_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


def test_percentiles_are_reported_in_milliseconds() -> None:
    assert percentiles_ms([0.001 * v for v in range(1, 101)]) == pytest.approx(Percentiles(50.0, 90.0, 99.0))


@dataclass
class Counters:
    cached_tokens: int
    computed_tokens: int


def test_prefix_hit_rate_is_cached_over_cached_and_computed_over_all_engines() -> None:
    assert prefix_hit_rate([Counters(30, 70), Counters(10, 90), Counters(0, 0)]) == pytest.approx(0.2)
    assert prefix_hit_rate([Counters(0, 0)]) == 0.0


def test_attainment_over_time_buckets_by_arrival_and_leaves_empty_buckets_out() -> None:
    outcomes = [outcome(0.5), outcome(1.5, ttft=3.0), outcome(9.0), outcome(9.9, ok=False), outcome(1.0)]
    assert attainment_over_time(outcomes, SLO, bucket_s=2.0) == ((0.0, 2 / 3), (8.0, 0.5))
    with pytest.raises(ValueError, match="bucket_s"):
        attainment_over_time(outcomes, SLO, bucket_s=0)


def test_summarise_counts_failures_and_interventions_and_takes_latencies_of_finished_requests() -> None:
    outcomes = [
        outcome(0.0, ttft=0.1, tpot=0.01, retries=1),
        outcome(1.0, ttft=0.3, tpot=0.03, resumes=2),
        outcome(2.0, ttft=0.2, tpot=None, fallback=True),
        outcome(3.0, ttft=5.0, tpot=0.9, ok=False, retries=2),  # failed: not in the percentiles
    ]
    r = summarise(
        "ours", 2.0, outcomes, SLO, duration_s=3.0, engines=[Counters(1, 3)], shifts=4, bucket_s=10.0, seed=7
    )
    assert (r.requests, r.failed, r.met) == (4, 1, 3)
    assert (r.goodput, r.attainment) == pytest.approx((1.0, 0.75))
    assert (r.retries, r.resumes, r.fallbacks, r.shifts) == (3, 2, 1, 4)
    assert r.ttft_ms == pytest.approx(Percentiles(200.0, 300.0, 300.0))
    assert r.tpot_ms == pytest.approx(Percentiles(10.0, 30.0, 30.0))
    assert r.prefix_hit_rate == pytest.approx(0.25)
    assert r.seeds == (7,)
    assert r.over_time == ((0.0, 0.75),)
    doc = r.to_json()
    assert doc["goodput"] == pytest.approx(1.0)
    assert doc["ttft_ms"] == pytest.approx({"p50": 200.0, "p90": 300.0, "p99": 300.0})
    assert doc["attainment_over_time"] == [[0.0, 0.75]]


def test_median_over_rounds_takes_each_fields_median() -> None:
    runs = [
        summarise(
            "rr",
            1.0,
            [outcome(float(i)) for i in range(n)] + [outcome(ok=False)],
            SLO,
            duration_s=10.0,
            shifts=n,
            bucket_s=5.0,
            seed=n,
        )
        for n in (2, 9, 4)
    ]
    m = median(runs)
    assert (m.policy, m.rate, m.met, m.shifts, m.failed) == ("rr", 1.0, 4, 4, 1)
    assert m.goodput == pytest.approx(0.4)
    assert m.seeds == (2, 9, 4)
    # Per bucket, the median of the rounds that had arrivals in it.
    assert [start for start, _ in m.over_time] == [0.0, 5.0]
    assert [value for _, value in m.over_time] == pytest.approx([0.8, 1.0])
    with pytest.raises(ValueError):
        median([])


def test_medians_give_one_result_per_policy_and_rate_ordered_by_rate() -> None:
    runs = [
        summarise(p, rate, [outcome()], SLO, duration_s=1.0, seed=seed)
        for rate in (8.0, 2.0)
        for seed in (0, 1, 2)
        for p in ("round-robin", "ours")
    ]
    rows = medians(runs)
    assert [(r.policy, r.rate, r.seeds) for r in rows] == [
        ("round-robin", 2.0, (0, 1, 2)),
        ("ours", 2.0, (0, 1, 2)),
        ("round-robin", 8.0, (0, 1, 2)),
        ("ours", 8.0, (0, 1, 2)),
    ]


def test_table_has_a_header_a_rule_and_one_row_per_policy() -> None:
    runs = [
        summarise(p, 4.0, [outcome(0.0), outcome(1.0, ok=False)], SLO, duration_s=2.0, seed=seed)
        for seed in (0, 1)
        for p in ("round-robin", "least-loaded", "ours")
    ]
    lines = table(medians(runs)).splitlines()
    assert len(lines) == 2 + 3
    assert lines[0].startswith("| policy") and "goodput req/s" in lines[0]
    assert set(lines[1]) <= {"|", "-", ":", " "}
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["round-robin", "least-loaded", "ours"]
    cells = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert cells[:6] == ["round-robin", "4", "2", "1", "0.50", "50.0%"]
    assert len({len(line) for line in lines}) == 1  # columns line up


def test_table_of_nothing_is_just_the_header() -> None:
    assert len(table([]).splitlines()) == 2


def classed(priority: int, tenant: str, *, met: bool = True, shed: str = "") -> Outcome:
    """A request of a class and a tenant: met its SLO, missed it (TTFT 2 s), or refused with ``shed``."""
    o = outcome(ttft=0.5 if met else 2.0)
    o.priority, o.tenant = priority, tenant
    if shed:
        o.ok, o.ttft_s, o.tpot_s, o.status, o.shed_reason = False, None, None, 429, shed
    return o


CLASSED = [
    classed(-1, "a"),
    classed(-1, "b"),
    classed(0, "a"),
    classed(0, "a", met=False),
    classed(0, "b", shed="queue_full"),
    classed(1, "a", shed="sheddable"),
    classed(1, "a", shed="sheddable"),
    classed(1, "b", shed="deadline_unreachable"),
]


def test_summarise_breaks_attainment_goodput_and_refusals_down_by_priority_and_tenant() -> None:
    r = summarise("ours", 8.0, CLASSED, SLO, duration_s=2.0)
    assert (r.requests, r.met, r.failed, r.shed) == (8, 3, 4, 4)
    # Reasons in the admission queue's order, not the order they came in.
    assert r.shed_by_reason == (("sheddable", 2), ("queue_full", 1), ("deadline_unreachable", 1))
    by_priority = {c.key: (c.requests, c.met, c.shed, c.attainment, c.goodput) for c in r.by_priority}
    assert [c.key for c in r.by_priority] == [-1, 0, 1]  # the most important first
    assert by_priority == {
        -1: (2, 2, 0, 1.0, 1.0),
        0: (3, 1, 1, pytest.approx(1 / 3), 0.5),
        1: (3, 0, 3, 0.0, 0.0),
    }
    assert [(c.key, c.requests, c.met, c.shed) for c in r.by_tenant] == [("a", 5, 2, 2), ("b", 3, 1, 2)]
    # Goodput is over the whole trace for every class, so the classes' goodputs add up to the run's.
    assert sum(c.goodput for c in r.by_priority) == pytest.approx(r.goodput)
    assert sum(c.goodput for c in r.by_tenant) == pytest.approx(r.goodput)
    doc = r.to_json()
    assert doc["shed"] == 4 and doc["shed_by_reason"] == {
        "sheddable": 2,
        "queue_full": 1,
        "deadline_unreachable": 1,
    }
    assert doc["by_priority"][2] == {
        "priority": 1, "requests": 3, "met": 0, "shed": 3, "goodput": 0.0, "attainment": 0.0,
        "shed_by_reason": {"sheddable": 2, "deadline_unreachable": 1},
    }  # fmt: skip
    assert [t["tenant"] for t in doc["by_tenant"]] == ["a", "b"]


def test_the_median_of_rounds_takes_each_class_medians_and_counts_a_missing_reason_as_zero() -> None:
    runs = [
        summarise("ours", 8.0, CLASSED, SLO, duration_s=2.0),
        summarise("ours", 8.0, CLASSED[:4], SLO, duration_s=2.0),  # nothing refused
        summarise("ours", 8.0, CLASSED, SLO, duration_s=2.0),
    ]
    m = median(runs)
    assert m.shed == 4 and m.shed_by_reason == (
        ("sheddable", 2),
        ("queue_full", 1),
        ("deadline_unreachable", 1),
    )
    assert {c.key: c.requests for c in m.by_priority} == {-1: 2, 0: 3, 1: 3}
    assert {c.key: c.shed_by_reason for c in m.by_tenant}["b"] == (
        ("queue_full", 1),
        ("deadline_unreachable", 1),
    )


def test_the_class_table_shows_each_run_then_its_priorities_and_tenants_with_refusals() -> None:
    results = [summarise("ours", 8.0, CLASSED, SLO, duration_s=2.0)]
    assert has_classes(results)
    lines = class_table(results).splitlines()
    classes = [line.split("|")[3].strip() for line in lines[2:]]
    assert classes == ["all", "priority -1", "priority 0", "priority 1", "tenant a", "tenant b"]
    row = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]}
    assert row["priority 1"][3:] == ["3", "0.00", "0.0%", "3", "sheddable 2, deadline_unreachable 1"]
    assert row["priority -1"][-2:] == ["0", "-"]
    assert len({len(line) for line in lines}) == 1  # columns line up


def test_one_class_one_tenant_and_no_refusal_need_no_class_table() -> None:
    plain = [summarise("ours", 2.0, [outcome(), outcome(ttft=3.0)], SLO, duration_s=1.0)]
    assert not has_classes(plain)
    # A refusal alone is worth the table, without per-class rows (there is one class, one tenant).
    refused = [
        summarise("ours", 2.0, [outcome(), classed(0, "default", shed="queue_full")], SLO, duration_s=1.0)
    ]
    assert has_classes(refused)
    assert [line.split("|")[3].strip() for line in class_table(refused).splitlines()[2:]] == ["all"]
