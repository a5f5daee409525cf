"""``bench scheduler --compare``: the shipped scheduler beside the flat and the sampled ones.

- **flat**: no shards and no sampling: every eligible instance is filtered and scored, so its pick is
  the best the profiles' scorers can make; the yardstick for pick quality.
- **sampled**: no shards and no ranking: the prefix holders and a window at a request-seeded offset
  are scored (the scheduler before shards).
- **shipped**: the config as given (default: the ranked path, ``ranked.py``, whose picks score as the
  flat ones do; shards past 256 eligible instances where it steps aside, ``shards.py``).

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
    """The flat and the sampled schedulers beside the shipped one, on the run's own decisions.

    Neither decides inside the run: what one leaves in the caches and the collector's generations
    (the flat one is 10 to 100 times slower) would land in the shipped decisions' times. Up to
    ``RECORDED`` decisions' requests and snapshots, evenly spread through the run, are kept, and
    after the run each is decided again by the sampled and by the flat scheduler, in the run's
    order. Their times are a second pass's (warmer than the run: nothing else runs in between).
    """

    def __init__(self, config: SchedulerConfig, decisions: int) -> None:
        flat_profiles = {
            name: dataclasses.replace(p, max_candidates=FLAT_CANDIDATES)
            for name, p in config.profiles.items()
        }
        self.flat = PluginScheduler(dataclasses.replace(config, shards=None, profiles=flat_profiles))
        self.sampled = PluginScheduler(dataclasses.replace(config, shards=None, ranked=False))
        self.every = max(1, decisions // RECORDED)
        self.times: list[tuple[float, float]] = []  # the shipped decisions' (decide, lookup)
        self.records: list[tuple[SchedulingRequest, RegistrySnapshot, Decision, float]] = []

    def after(
        self,
        n: int,
        request: SchedulingRequest,
        snapshot: RegistrySnapshot,
        shipped: Decision,
        decide_s: float,
        lookup_s: float,
    ) -> None:
        """Called after the ``n``th shipped decision (``decide_s``, after a lookup of ``lookup_s``)."""
        self.times.append((decide_s, lookup_s))
        if n % self.every == 0:
            self.records.append((request, snapshot, shipped, lookup_s))

    def results(self) -> tuple[Variant, ...]:
        """The second pass over the records, then each scheduler's times and picks against the flat one's."""
        perf = time.perf_counter
        times: dict[str, list[tuple[float, float]]] = {"shipped": self.times, "sampled": [], "flat": []}
        quality: dict[str, list[Pick]] = {"shipped": [], "flat": [], "sampled": []}
        decided: dict[str, list[Decision]] = {"sampled": [], "flat": []}
        # One scheduler through all the records, then the other: the flat one's lists and what it
        # leaves in the caches would otherwise land in the sampled one's times.
        for name, scheduler in (("sampled", self.sampled), ("flat", self.flat)):
            for request, snapshot, _, lookup_s in self.records:
                t0 = perf()
                decided[name].append(scheduler.decide(request, snapshot, 0.0))
                times[name].append((perf() - t0, lookup_s))
        for (request, snapshot, shipped, _), sampled, flat in zip(
            self.records, decided["sampled"], decided["flat"], strict=True
        ):
            best = predicted(flat, request, snapshot)
            for name, decision in (("shipped", shipped), ("flat", flat), ("sampled", sampled)):
                quality[name].append((decision, flat, predicted(decision, request, snapshot), best))
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
