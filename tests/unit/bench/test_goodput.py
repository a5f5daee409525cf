"""``bench goodput``'s trace and arithmetic: a seeded trace with Poisson arrivals and Zipf popularity,
the same requests at every rate, and attainment, goodput and the 75% point from client samples."""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
from collections import Counter

import pytest

from vllm_disagg.bench.goodput import (
    Point,
    Sample,
    TraceSpec,
    add_arguments,
    cluster_spec,
    knee,
    make_trace,
    median_point,
    planner_yaml,
    summarise,
    zipf_cdf,
)
from vllm_disagg.cli.commands import main
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.planner.config import load_planner_config

# Short documents and questions: the shape tests draw thousands of requests.
SMALL = TraceSpec(seed=7, documents=50, zipf=1.0, doc_tokens=(40, 60), question_tokens=(4, 8))


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(
        ["--duration-s", "12", "--warmup-s", "2", "--ttft-ms", "1000", "--tpot-ms", "50", *argv]
    )


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    assert make_trace(SMALL, 5.0, 30.0) == make_trace(SMALL, 5.0, 30.0)
    other = make_trace(
        TraceSpec(seed=8, documents=50, doc_tokens=(40, 60), question_tokens=(4, 8)), 5.0, 30.0
    )
    assert [r.prompt for r in other] != [r.prompt for r in make_trace(SMALL, 5.0, 30.0)]


def test_every_rate_plays_the_same_requests_with_the_gaps_scaled() -> None:
    slow, fast = make_trace(SMALL, 2.0, 50.0), make_trace(SMALL, 4.0, 50.0)
    assert len(fast) > len(slow)
    for a, b in zip(slow, fast, strict=False):
        assert (a.doc, a.prompt, a.max_tokens) == (b.doc, b.prompt, b.max_tokens)
        assert b.at_s == pytest.approx(a.at_s / 2)


def test_arrivals_are_poisson_at_the_rate() -> None:
    rate, duration = 10.0, 1000.0
    trace = make_trace(SMALL, rate, duration)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(trace)]
    assert len(trace) == pytest.approx(rate * duration, rel=0.05)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean, and P(gap > mean) = 1/e.
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.08)
    assert sum(g > 1 / rate for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    assert all(0 <= r.at_s < duration for r in trace)


def test_documents_are_drawn_by_zipf_popularity() -> None:
    trace = make_trace(SMALL, 10.0, 1000.0)
    counts = Counter(r.doc for r in trace)
    harmonic = sum(1 / k for k in range(1, SMALL.documents + 1))
    assert counts[0] / len(trace) == pytest.approx(1 / harmonic, rel=0.1)  # rank 1's share
    assert counts[0] / counts[1] == pytest.approx(2.0, rel=0.15)  # exponent 1: rank 1 twice rank 2
    assert counts[0] / counts[3] == pytest.approx(4.0, rel=0.25)


@pytest.mark.parametrize(
    ("n", "exponent", "expected"),
    [
        pytest.param(3, 1.0, [6 / 11, 9 / 11, 1.0], id="exponent-1-weights-1-half-third"),
        pytest.param(4, 0.0, [0.25, 0.5, 0.75, 1.0], id="exponent-0-is-uniform"),
        pytest.param(1, 2.0, [1.0], id="one-document"),
    ],
)
def test_zipf_cdf(n: int, exponent: float, expected: list[float]) -> None:
    assert zipf_cdf(n, exponent) == pytest.approx(expected)


def test_a_request_is_its_document_then_a_question_of_its_own() -> None:
    spec = TraceSpec(seed=1)  # the benchmark's default lengths
    trace = make_trace(spec, 8.0, 30.0)
    by_doc: dict[int, list[str]] = {}
    for r in trace:
        by_doc.setdefault(r.doc, []).append(r.prompt)
        assert spec.output_tokens[0] <= r.max_tokens <= spec.output_tokens[1]
        assert len(r.prompt) + r.max_tokens <= 4096  # the simulated engine's max_model_len
    shared = next(prompts for prompts in by_doc.values() if len(prompts) > 1)
    doc_len = len(shared[0].split("\nQuestion ")[0])
    assert spec.doc_tokens[0] <= doc_len <= spec.doc_tokens[1]
    assert len({p[:doc_len] for p in shared}) == 1 and len(set(shared)) == len(shared)
    starts = {prompts[0][:16] for prompts in by_doc.values()}
    assert len(starts) == len(by_doc)  # documents differ from their first block on


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        pytest.param({"documents": 0}, "--documents >= 1", id="no-documents"),
        pytest.param({"zipf": -1.0}, "--zipf >= 0", id="negative-exponent"),
        pytest.param({"doc_tokens": (10, 5)}, "--doc-tokens: need 1 <= MIN <= MAX", id="min-over-max"),
        pytest.param({"output_tokens": (0, 5)}, "--output-tokens: need 1 <= MIN", id="zero-tokens"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_flag(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        TraceSpec(**fields)  # type: ignore[arg-type]


def test_attainment_needs_both_targets_and_counts_failures_as_misses() -> None:
    samples = [
        Sample(1.0, True, 0.1, 0.01),  # warm-up: not counted
        Sample(3.0, True, 0.9, 0.049, "disaggregated"),  # met
        Sample(4.0, True, 1.2, 0.010, "colocated"),  # TTFT missed
        Sample(5.0, True, 0.5, 0.060, "disaggregated"),  # TPOT missed
        Sample(6.0, False, 0.0, 0.0),  # failed
        Sample(7.0, True, 0.2, 0.020, "colocated"),  # met
    ]
    p = summarise("before", 8.0, samples, args())
    assert (p.requests, p.failed, p.met, p.attainment) == (5, 1, 2, 0.4)
    assert p.goodput_rps == pytest.approx(2 / 10)  # met per second of the 12 - 2 s window
    assert p.colocated == 0.4
    assert p.whole_attainment == 0.5  # the warm-up's request counts here, and it met both
    assert p.ttft_p90_ms == 1200.0 and p.tpot_p90_ms == 60.0


def _point(arm: str, rate: float, attainment: float, goodput: float) -> Point:
    return Point(arm, rate, 100, 0, round(attainment * 100), attainment, goodput, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("before", "rate", "gain"),
    [
        pytest.param([(4, 1.0, 4.0), (8, 0.8, 6.4), (12, 0.5, 6.0)], 8, 0.25, id="closest-to-75"),
        pytest.param([(4, 0.85, 3.4), (8, 0.65, 5.2)], 4, 0.5, id="tie-takes-the-lower-rate"),
    ],
)
def test_the_knee_is_where_before_attains_closest_to_75_percent(
    before: list[tuple[float, float, float]], rate: float, gain: float
) -> None:
    points = [_point("before", r, a, g) for r, a, g in before]
    points += [_point("after", r, 1.0, g * (1 + gain)) for r, _, g in before]
    k = knee(points)
    assert k is not None and k.rate == rate
    assert k.gain == pytest.approx(gain)
    assert knee([p for p in points if p.arm == "before"]) is None


def test_rounds_report_medians_and_the_goodput_range() -> None:
    rounds = [_point("after", 8, a, g) for a, g in ((0.7, 5.6), (0.9, 7.2), (0.8, 6.4))]
    p = median_point(rounds)
    assert (p.attainment, p.goodput_rps, p.goodput_range, p.rounds) == (0.8, 6.4, (5.6, 7.2), 3)


def test_only_the_after_arm_gets_slo_targets_and_a_shifting_planner() -> None:
    a = args()
    config = load_planner_config(planner_yaml(a), "bench")
    assert (config.dry_run, config.ttft_target_s, config.tpot_target_s) == (False, 1.0, 0.05)
    before = cluster_spec("before", a, "planner.yaml").orchestrator_argv()
    after = cluster_spec("after", a, "planner.yaml").orchestrator_argv()
    assert not {"--planner-config", "--slo-ttft-ms", "--slo-tpot-ms"} & set(before)
    assert after[-6:] == ["--planner-config", "planner.yaml", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50"]
    assert before == after[:-6]  # the same cluster otherwise


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--zipf", "-1"], id="bad-trace"),
        pytest.param(["--rates", "0"], id="no-load"),
        pytest.param(["--warmup-s", "60"], id="warm-up-past-the-end"),
    ],
)
def test_the_command_refuses_a_bad_sweep_before_starting_anything(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "goodput", *argv]) == 2
    assert "bench goodput: configuration error" in capsys.readouterr().err
