"""``bench scheduler --compare``: the shipped scheduler beside the flat and the sampled ones.

- **flat**: no shards and no sampling: every eligible instance is filtered and scored, so its pick is
  the best the profiles' scorers can make; the yardstick for pick quality.
- **sampled**: no shards: the prefix holders and a window at a request-seeded offset are scored
  (the scheduler before shards).
- **shipped**: the config as given (default: shards past 256 eligible instances, ``shards.py``).

Each decides the same request on the same snapshot as the shipped decision (``Comparison``); only
the shipped one's decode pick takes the load the benchmark moves. A pick's quality is its decision's
predicted TTFT (the prefill instance's with the KV transfer where links are known, or the decode
instance's when colocated: ``predict.predicted_ttft``) and its decode instance's predicted TPOT,
each against the flat one's.

"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

from vllm_disagg.orchestrator.scheduling.config import SchedulerConfig
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins.pairing import transfer_time
from vllm_disagg.orchestrator.scheduling.predict import predicted_tpot, predicted_ttft
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.views import RegistrySnapshot

FLAT_CANDIDATES = 1 << 30  # more than any cluster: nothing is sampled


@dataclass(frozen=True)
class Variant:
    """One scheduler's decision times (µs) and its picks against the flat one's."""

    name: str
    decide_p50_us: float
    decide_p99_us: float
    total_p50_us: float  # with the decision's snapshot and prefix lookup
    total_p99_us: float
    prefill_differs: float  # share of decisions whose prefill pick is not the flat one's
    decode_differs: float
    ttft_worse_mean_ms: float  # predicted TTFT less the flat pick's, mean over all decisions
    ttft_worse_p99_ms: float
    tpot_worse_mean_ms: float  # the decode pick's predicted TPOT less the flat pick's
    tpot_worse_p99_ms: float


RECORDED = 2000  # decisions kept for the flat scheduler's second pass


class Comparison:
    """The sampled scheduler beside the shipped one on every decision, and the flat one afterwards.

    The sampled decision is made before the shipped one on odd decisions and after it on even ones, so
    that neither finds the caches warmed by the other more often. The flat scheduler is 10 to 100 times
    slower, and what it leaves in the caches would slow whatever ran next: it decides in a second pass,
    on up to ``RECORDED`` decisions' own requests and snapshots, kept evenly spread through the run.
    """

    def __init__(self, config: SchedulerConfig, decisions: int) -> None:
        flat_profiles = {
            name: dataclasses.replace(p, max_candidates=FLAT_CANDIDATES)
            for name, p in config.profiles.items()
        }
        self.flat = PluginScheduler(dataclasses.replace(config, shards=None, profiles=flat_profiles))
        self.sampled = PluginScheduler(dataclasses.replace(config, shards=None))
        self.every = max(1, decisions // RECORDED)
        self.times: dict[str, list[tuple[float, float]]] = {"shipped": [], "sampled": []}  # (decide, lookup)
        self.records: list[tuple[SchedulingRequest, RegistrySnapshot, Decision, Decision]] = []
        self._pending: tuple[Decision, float] | None = None

    def before(self, n: int, request: SchedulingRequest, snapshot: RegistrySnapshot) -> None:
        """Called before the shipped decision."""
        if n % 2:
            self._pending = self._sample(request, snapshot)

    def after(
        self,
        n: int,
        request: SchedulingRequest,
        snapshot: RegistrySnapshot,
        shipped: Decision,
        decide_s: float,
        lookup_s: float,
    ) -> None:
        """Called after the shipped decision (``decide_s``, after a lookup of ``lookup_s``)."""
        sampled, took = self._pending or self._sample(request, snapshot)
        self._pending = None
        self.times["shipped"].append((decide_s, lookup_s))
        self.times["sampled"].append((took, lookup_s))
        if n % self.every == 0:
            self.records.append((request, snapshot, shipped, sampled))

    def _sample(self, request: SchedulingRequest, snapshot: RegistrySnapshot) -> tuple[Decision, float]:
        t0 = time.perf_counter()
        decision = self.sampled.decide(request, snapshot, 0.0)
        return decision, time.perf_counter() - t0

    def results(self) -> tuple[Variant, ...]:
        """The flat pass over the records, then each scheduler's times and picks against the flat one's."""
        perf = time.perf_counter
        flat_times: list[tuple[float, float]] = []
        lookup = [t for _, t in self.times["shipped"]]
        quality: dict[str, list[Pick]] = {"shipped": [], "flat": [], "sampled": []}
        for i, (request, snapshot, shipped, sampled) in enumerate(self.records):
            t0 = perf()
            flat = self.flat.decide(request, snapshot, 0.0)
            flat_times.append((perf() - t0, lookup[min(i * self.every, len(lookup) - 1)]))
            best = predicted(flat, request, snapshot)
            for name, decision in (("shipped", shipped), ("flat", flat), ("sampled", sampled)):
                quality[name].append((decision, flat, predicted(decision, request, snapshot), best))
        times = {**self.times, "flat": flat_times}
        return tuple(_variant(name, times[name], quality[name]) for name in ("shipped", "sampled", "flat"))


# A decision, the flat one, and each one's (predicted TTFT, predicted TPOT).
Pick = tuple[Decision, Decision, tuple[float, float], tuple[float, float]]


def _variant(name: str, times: list[tuple[float, float]], picks: list[Pick]) -> Variant:
    decide = [d for d, _ in times]
    total = [d + lookup for d, lookup in times]
    n = max(1, len(picks))
    ttft = [mine[0] - best[0] for _, _, mine, best in picks]
    tpot = [mine[1] - best[1] for _, _, mine, best in picks]
    return Variant(
        name=name,
        decide_p50_us=us(decide, 50),
        decide_p99_us=us(decide, 99),
        total_p50_us=us(total, 50),
        total_p99_us=us(total, 99),
        prefill_differs=round(sum(d.prefill != f.prefill for d, f, _, _ in picks) / n, 3),
        decode_differs=round(sum(d.decode != f.decode for d, f, _, _ in picks) / n, 3),
        ttft_worse_mean_ms=round(statistics.fmean(ttft) * 1e3, 3),
        ttft_worse_p99_ms=round(statistics.quantiles(ttft, n=100)[98] * 1e3, 3),
        tpot_worse_mean_ms=round(statistics.fmean(tpot) * 1e3, 3),
        tpot_worse_p99_ms=round(statistics.quantiles(tpot, n=100)[98] * 1e3, 3),
    )


def predicted(
    decision: Decision, request: SchedulingRequest, snapshot: RegistrySnapshot
) -> tuple[float, float]:
    """(predicted TTFT, the decode instance's predicted TPOT) of a decision, in seconds."""
    first = decision.prefill if decision.prefill is not None else decision.decode
    view, d = snapshot.by_id[first], snapshot.by_id[decision.decode]
    transfer = transfer_time(snapshot, request, view, d) if decision.prefill is not None else None
    return (
        predicted_ttft(view, request, snapshot.in_flight_of(first)) + (transfer or 0.0),
        predicted_tpot(d, snapshot.in_flight_of(decision.decode)),
    )


def us(samples: list[float], pct: int) -> float:
    """The ``pct``th percentile of ``samples`` (seconds) in µs, to 0.1."""
    if pct == 50:
        return round(statistics.median(samples) * 1e6, 1)
    return round(statistics.quantiles(samples, n=100)[pct - 1] * 1e6, 1)
