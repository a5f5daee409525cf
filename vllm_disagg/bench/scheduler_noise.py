"""``bench scheduler``'s account of its own tail: how much of a decision's p99 is the machine's.

A virtual machine's guest is paused now and then by its host, in ways its own interrupt counters do
not show (on the 2-core machine the project is built on: about 400 pauses a second of 15 to 25 µs
each). A pause lands in a decision in proportion to the decision's length, so one of 70 µs is hit
about one time in 35, and the 99th percentile of many is one that was. Two figures, measured in the
same run, tell that apart from what the decision itself costs:

- ``pauses``: a tight loop that reads the clock for a while and counts the gaps of over 5 µs
  between two reads: nothing runs in between, so each gap is time the process did not have.
- ``Replay``: the run's last decisions (their prompt's block keys, request and snapshot)
  decided again, each ``rounds`` times in turn, lookup included; each decision's fastest try is its
  cost without a pause. The replay is warmer than the run (nothing else runs between two
  decisions), so its figures are a floor, reported beside the run's, never instead of them.
- ``steady``: the same pure-Python work every time (a loop sized to the run's median decision),
  timed as a decision is: its p99 over its p50 is the spread the machine alone gives any work of
  that length (on the project's machine about 2x: its CPU runs at half speed for stretches of tens
  of milliseconds, in thread CPU time too, so not a pause the probe above sees).
"""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from vllm_disagg.bench.scheduler_variants import us
from vllm_disagg.orchestrator.scheduling.framework import SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.orchestrator.state.views import RegistrySnapshot

GAP_NS = 5_000  # a gap between two clock reads longer than this is a pause, not the loop's own step
RECORDED = 2000  # decisions kept for the replay: the run's last ones


@dataclass(frozen=True)
class Pauses:
    """Gaps in a process that only reads the clock."""

    per_s: float
    median_us: float
    p99_us: float


def pauses(seconds: float, clock: Callable[[], int] = time.perf_counter_ns) -> Pauses:
    """Count the pauses in ``seconds`` of reading ``clock`` (nanoseconds) in a loop."""
    gaps: list[int] = []
    last = start = clock()
    end = start + int(seconds * 1e9)
    while last < end:
        now = clock()
        if now - last > GAP_NS:
            gaps.append(now - last)
        last = now
    if not gaps:
        return Pauses(0.0, 0.0, 0.0)
    p99 = statistics.quantiles(gaps, n=100)[98] if len(gaps) > 1 else gaps[0]
    return Pauses(round(len(gaps) / seconds, 1), round(statistics.median(gaps) / 1e3, 1), round(p99 / 1e3, 1))


@dataclass(frozen=True)
class Steady:
    """The times of one fixed piece of work, repeated."""

    loops: int  # iterations of the work's loop
    p50_us: float
    p99_us: float


def _work(loops: int) -> int:
    """The fixed work: a loop of integer arithmetic, the same every call."""
    total = 0
    for i in range(loops):
        total += i * i
    return total


def loops_for(target_us: float, clock: Callable[[], int] = time.perf_counter_ns) -> int:
    """Iterations of ``_work`` that take about ``target_us`` here: 1,000 scaled by the median of 21
    tries (the machine's usual speed, as the run's median decision had it), then that count scaled
    the same way once more (a short loop's speed is not a long one's)."""
    loops = 1000
    for _ in range(2):
        median = statistics.median(_timed(loops, clock) for _ in range(21))
        loops = max(1, round(loops * target_us * 1e3 / max(1, median)))
    return loops


def steady(seconds: float, loops: int, clock: Callable[[], int] = time.perf_counter_ns) -> Steady:
    """Time ``_work(loops)`` again and again for ``seconds``: its p50 and p99."""
    times: list[int] = []
    end = clock() + int(seconds * 1e9)
    while not times or clock() < end:
        times.append(_timed(loops, clock))
    if len(times) < 2:
        return Steady(loops, times[0] / 1e3, times[0] / 1e3)
    q = statistics.quantiles(times, n=100)
    return Steady(loops, round(q[49] / 1e3, 1), round(q[98] / 1e3, 1))


def _timed(loops: int, clock: Callable[[], int]) -> int:
    t0 = clock()
    _work(loops)
    return clock() - t0


@dataclass(frozen=True)
class Noise:
    """What ``bench scheduler`` reports of its tail (zeros where not measured)."""

    pauses_per_s: float = 0.0  # gaps of over 5 µs in a loop reading the clock, after the run
    pause_median_us: float = 0.0
    replayed: int = 0  # recorded decisions (lookup and decide) decided again, each one's fastest try
    replay_p50_us: float = 0.0
    replay_p99_us: float = 0.0
    steady_p50_us: float = 0.0  # the fixed work sized to the run's median decision, repeated
    steady_p99_us: float = 0.0


def measure(
    replay: Replay, scheduler: PluginScheduler, index: KvIndex, rounds: int, probe_s: float, median_us: float
) -> Noise:
    """Count the pauses for ``probe_s`` seconds, time the fixed work sized to ``median_us`` (the run's
    median decision) for as long, then replay the recorded decisions ``rounds`` times."""
    probe = pauses(probe_s) if probe_s > 0 else Pauses(0.0, 0.0, 0.0)
    fixed = steady(probe_s, loops_for(median_us)) if probe_s > 0 and median_us > 0 else Steady(0, 0.0, 0.0)
    fastest = replay.fastest(scheduler, index, rounds) if rounds > 0 else []
    many = len(fastest) > 1  # percentiles need two
    return Noise(
        probe.per_s,
        probe.median_us,
        len(fastest),
        us(fastest, 50) if many else 0.0,
        us(fastest, 99) if many else 0.0,
        fixed.p50_us,
        fixed.p99_us,
    )


class Replay:
    """Up to ``RECORDED`` decisions of a run, decided again ``rounds`` times each afterwards."""

    def __init__(self, decisions: int) -> None:
        # The last ones, in a row: a ranked profile follows each snapshot from the one before, as in
        # the run (records spread through it would follow ten decisions' changes at once).
        self.first = decisions - RECORDED
        # The prompts as arrays, which the garbage collector does not track: each kept list (or tuple)
        # of ~500 ids was walked by the next young collection, tens of them each time (0.4-0.9 ms
        # a collection against 40 µs without), the benchmark's cost landing in the decisions' p99.
        self.records: list[tuple[array[int], SchedulingRequest, RegistrySnapshot]] = []

    def record(
        self, n: int, prompt: PromptTokens, request: SchedulingRequest, snapshot: RegistrySnapshot
    ) -> None:
        """Keep the ``n``th timed decision's inputs (one of the last ``RECORDED``)."""
        if n >= self.first:
            self.records.append((array("q", prompt), request, snapshot))

    def fastest(self, scheduler: PluginScheduler, index: KvIndex, rounds: int) -> list[float]:
        """Each recorded decision's fastest of ``rounds`` tries (lookup and decide), in seconds; the
        rounds go through all the records in turn, so a pause hits one try of a decision, not all.
        Each round has a scheduler of its own, of ``scheduler``'s config: a ranked profile follows
        the snapshots forward only (an older one is sampled), as it does in the run."""
        perf = time.perf_counter
        best = [float("inf")] * len(self.records)
        records = []
        for ids, request, snapshot in self.records:
            prompt = PromptTokens(ids)
            index.cached_tokens(prompt)  # its block keys, hashed with the tokenization in a run
            records.append((prompt, request, snapshot))
        for _ in range(rounds):
            scheduler = PluginScheduler(scheduler.config)
            for i, (prompt, request, snapshot) in enumerate(records):
                t0 = perf()
                index.cached_tokens(prompt)
                scheduler.decide(request, snapshot, 0.0)
                took = perf() - t0
                if took < best[i]:
                    best[i] = took
        return best
