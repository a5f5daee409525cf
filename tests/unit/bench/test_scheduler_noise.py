"""``bench scheduler`` tells the machine's pauses apart from the decision's own cost."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from vllm_disagg.bench.scheduler_noise import loops_for, pauses, steady
from vllm_disagg.cli.commands import main


def _clock(steps_ns: list[int]) -> Iterator[int]:
    now = 0
    yield now
    for step in steps_ns:
        now += step
        yield now
    while True:  # past the probe's end
        now += 10**12
        yield now


def test_a_gap_between_two_clock_reads_over_5_us_is_counted_as_a_pause_and_shorter_ones_are_not() -> None:
    # A loop step of 1 µs, two pauses (8 and 40 µs) and one 5 µs step, which is not over the line.
    reads = _clock([1_000, 8_000, 1_000, 5_000, 1_000, 40_000, 1_000] + [1_000] * 1_000_000)
    result = pauses(1.0, clock=lambda: next(reads))
    assert result.per_s == 2.0
    assert result.median_us == 24.0  # of 8 and 40


def test_a_probe_without_a_pause_reports_none() -> None:
    reads = _clock([1_000] * 1_000_001)
    assert pauses(1.0, clock=lambda: next(reads)).per_s == 0.0


def _reads_of(durations_ns: list[int]) -> Iterator[int]:
    """The clock ``steady`` reads for work that takes ``durations_ns`` in turn: the probe's end is
    1 s after its first read, and after the last duration the clock is past it."""
    now = 0
    yield now  # the probe's start
    for i, took in enumerate(durations_ns):
        if i:
            yield now  # the check whether the probe is over
        yield now  # the work starts
        now += took
        yield now  # and ends
    yield 10**12


def test_steady_reports_the_median_and_99th_percentile_of_the_same_work_timed_again_and_again() -> None:
    # 98 tries of 50 µs, two of 100 µs (the machine at half speed): the p99 is the slow ones'.
    durations = [50_000] * 98 + [100_000] * 2
    reads = _reads_of(durations)
    result = steady(1.0, 10, clock=lambda: next(reads))
    assert (result.loops, result.p50_us) == (10, 50.0)
    assert 50.0 < result.p99_us <= 100.0


def test_the_fixed_work_is_sized_from_its_median_tries_to_the_length_asked_for() -> None:
    # 1,000 iterations took 10 µs in the median try (the slow ones ran at half speed, one was
    # faster): 50 µs would be 5,000; 5,000 then took 60 µs in the median try: 4,167 it is.
    first = [20_000] * 8 + [10_000] * 12 + [8_000]
    second = [120_000] * 5 + [60_000] * 15 + [55_000]
    tries = first + second
    reads = iter([t for i, took in enumerate(tries) for t in (i * 10**6, i * 10**6 + took)])
    assert loops_for(50.0, clock=lambda: next(reads)) == 4_167


def test_bench_scheduler_replays_each_recorded_decision_and_counts_the_pauses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "scheduler", "--instances", "16", "--blocks", "2048", "--decisions", "300"]
    assert main([*argv, "--replays", "3", "--pause-probe-s", "0.05", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["noise"]
    assert result["replayed"] == 300  # under 2,000 decisions: every one is kept
    assert 0 < result["replay_p50_us"] <= result["replay_p99_us"]
    assert result["pauses_per_s"] >= 0.0
    assert 0 < result["steady_p50_us"] <= result["steady_p99_us"]


def test_bench_scheduler_without_replays_reports_none(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "scheduler", "--instances", "16", "--blocks", "2048", "--decisions", "300"]
    assert main([*argv, "--replays", "0", "--pause-probe-s", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["noise"]
    assert result["replayed"] == 0 and result["replay_p50_us"] == 0.0 and result["pauses_per_s"] == 0.0
    assert result["steady_p50_us"] == 0.0
