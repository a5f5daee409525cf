"""Engine metrics: a fast Prometheus text parser, a window of scrapes, and the ``MetricsSnapshot``.

The pure part (``parse_exposition``, ``push``, ``snapshot``) takes ``now`` as an argument so tests feed
it handwritten expositions; ``MetricsScraper`` is the thin adapter that fetches ``/metrics``.

Windowed values (TTFT, TPOT, queue time, prefill throughput, prompt length, prefix-cache hit rate)
are differences between the oldest and newest scrape in the window, so they describe the last
``metrics_window_s`` rather than the engine's lifetime. A counter that goes down means the engine
restarted: the window starts afresh. The KV pulled in (``kv_in_bytes``, ``kv_in_seconds``: the sums of
vLLM's NIXL histograms) is lifetime, as the orchestrator learns links from its differences.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from vllm_disagg.clock import Clock
from vllm_disagg.protocol.messages import MetricsSnapshot

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # v1 name first, then v0's
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
TTFT = ("vllm:time_to_first_token_seconds",)
# Per-request TPOT is observed when a request finishes; inter-token latency per token, so it has
# samples while long requests are still running. Older vLLM called TPOT time_per_output_token.
TPOT = (
    "vllm:request_time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
)

QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
PROMPT_LENGTH = "vllm:request_prompt_tokens"  # a histogram of prompt lengths, one sample per request
# Prompt tokens by where they came from; kept apart by the ``source`` label (see ``parse_exposition``).
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
COMPUTED = f"{BY_SOURCE}:local_compute"
CACHED = f"{BY_SOURCE}:local_cache_hit"
TRANSFERRED = f"{BY_SOURCE}:external_kv_transfer"
_PER_REQUEST = (QUEUE_TIME, PREFILL_TIME, PROMPT_LENGTH)
# vLLM's NixlConnector, on the engine that pulls: one sample per transfer, per engine (no source label).
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_SECONDS = "vllm:nixl_xfer_time_seconds_sum"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"

HISTOGRAM_SERIES = tuple(
    f"{h}{suffix}" for h in (*TTFT, *TPOT, *_PER_REQUEST) for suffix in ("_sum", "_count")
)
COUNTERS = frozenset(
    (
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        REQUEST_SUCCESS,
        *PREFIX_QUERIES,
        *PREFIX_HITS,
        *HISTOGRAM_SERIES,
        COMPUTED,
        CACHED,
        TRANSFERRED,
        NIXL_BYTES,
        NIXL_SECONDS,
        NIXL_TRANSFERS,
    )
)
WANTED = frozenset((RUNNING, WAITING, *KV_USAGE, *COUNTERS, BY_SOURCE))

_SOURCE = re.compile(r'source="([a-z_]+)"')

_NAME = re.compile(r"[^{\s]+")


@dataclass(frozen=True, slots=True)
class Series:
    """One metric summed over its label sets; ``n`` is how many label sets were summed."""

    total: float
    n: int

    @property
    def mean(self) -> float:
        """The mean over label sets (for gauges such as a usage fraction)."""
        return self.total / self.n if self.n else 0.0


def _end_of_labels(line: str, start: int) -> int:
    """Index just after the ``}`` closing the label set that opens at ``start``; -1 if unclosed.

    Label values may hold ``}``, spaces and escaped quotes, so quotes are tracked.
    """
    i, n, quoted = start + 1, len(line), False
    while i < n:
        c = line[i]
        if quoted:
            if c == "\\":
                i += 1  # skip the escaped character, whatever it is
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "}":
            return i + 1
        i += 1
    return -1


def parse_exposition(text: str, names: frozenset[str] = WANTED) -> dict[str, Series]:
    """Sum each wanted series of a Prometheus text exposition over its label sets.

    Lines of other metrics are skipped after reading their name, which is what keeps this fast on
    vLLM's large output (hundreds of bucket lines). Comments, malformed lines and NaN samples are
    ignored rather than failing the scrape. ``vllm:prompt_tokens_by_source_total`` is summed per
    ``source`` label, under ``NAME:SOURCE`` keys.
    """
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        match = _NAME.match(line)
        if match is None:
            continue
        name = match.group()
        if name not in names:
            continue
        rest = match.end()
        if rest < len(line) and line[rest] == "{":
            labels = rest
            rest = _end_of_labels(line, rest)
            if rest < 0:
                continue
            if name == BY_SOURCE:
                source = _SOURCE.search(line, labels, rest)
                if source is None:
                    continue
                name = f"{name}:{source.group(1)}"
        fields = line[rest:].split()
        if not fields:
            continue
        try:
            value = float(fields[0])  # also reads NaN, +Inf, -Inf and exponents
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name] = totals.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    return {name: Series(totals[name], counts[name]) for name in totals}


@dataclass(frozen=True, slots=True)
class Scrape:
    """One parsed ``/metrics`` response: when it was taken and the wanted series."""

    at: float  # monotonic seconds
    wall: float  # wall seconds, shown as MetricsSnapshot.scraped_at
    series: Mapping[str, Series]

    def value(self, name: str) -> float:
        """The summed value, 0 when the engine did not export it."""
        s = self.series.get(name)
        return s.total if s is not None else 0.0


def counters_went_back(before: Scrape, after: Scrape) -> bool:
    """True when some counter shrank (or vanished): the engine restarted between the two scrapes."""
    return any(after.value(name) < s.total for name, s in before.series.items() if name in COUNTERS)


def push(window: tuple[Scrape, ...], scrape: Scrape, window_s: float) -> tuple[Scrape, ...]:
    """The window after ``scrape``: older scrapes drop out, but one at or before the window's start
    stays as the baseline so the differences cover the whole window. A counter reset starts afresh.
    """
    if window and (scrape.at < window[-1].at or counters_went_back(window[-1], scrape)):
        return (scrape,)
    kept = (*window, scrape)
    start = scrape.at - window_s
    baseline = 0
    for i, s in enumerate(kept):
        if s.at <= start:
            baseline = i
        else:
            break
    return kept[baseline:]


def _first_present(scrape: Scrape, names: tuple[str, ...]) -> str:
    return next((n for n in names if n in scrape.series), names[0])


def _mean_latency(first: Scrape, last: Scrape, histograms: tuple[str, ...]) -> float | None:
    """Δsum/Δcount of the first histogram with samples in the window; None without samples."""
    for h in histograms:
        count = last.value(f"{h}_count") - first.value(f"{h}_count")
        if count > 0:
            return (last.value(f"{h}_sum") - first.value(f"{h}_sum")) / count
    return None


def _delta(first: Scrape, last: Scrape, name: str) -> float:
    return last.value(name) - first.value(name)


def _prefill_rate(first: Scrape, last: Scrape) -> float | None:
    """Prompt tokens per second of prefill over the requests finished in the window; None without any."""
    if _delta(first, last, f"{PREFILL_TIME}_count") <= 0:
        return None
    seconds = _delta(first, last, f"{PREFILL_TIME}_sum")
    if seconds <= 0:
        return None
    return _delta(first, last, f"{PROMPT_LENGTH}_sum") / seconds


def snapshot(window: tuple[Scrape, ...]) -> MetricsSnapshot:
    """The engine's state from a window of scrapes: gauges from the newest, rates over the window."""
    if not window:
        return MetricsSnapshot()
    first, last = window[0], window[-1]
    kv = last.series.get(_first_present(last, KV_USAGE))
    queries = _first_present(last, PREFIX_QUERIES)
    hits = _first_present(last, PREFIX_HITS)
    queried = last.value(queries) - first.value(queries)
    kv_in_bytes, kv_in_seconds, kv_in_transfers = _kv_in(last)
    return MetricsSnapshot(
        scraped_at=last.wall,
        num_running=int(last.value(RUNNING)),
        num_waiting=int(last.value(WAITING)),
        kv_cache_usage=kv.mean if kv is not None else 0.0,
        ttft_s=_mean_latency(first, last, TTFT),
        tpot_s=_mean_latency(first, last, TPOT),
        prefix_cache_hit_rate=(last.value(hits) - first.value(hits)) / queried if queried > 0 else None,
        window_s=last.at - first.at,
        requests_finished=int(last.value(REQUEST_SUCCESS)),
        prompt_tokens=int(last.value(PROMPT_TOKENS)),
        generation_tokens=int(last.value(GENERATION_TOKENS)),
        queue_s=_mean_latency(first, last, (QUEUE_TIME,)),
        prefill_tokens_per_s=_prefill_rate(first, last),
        mean_prompt_tokens=_mean_latency(first, last, (PROMPT_LENGTH,)),
        prompt_tokens_computed=_lifetime(last, COMPUTED),
        prompt_tokens_cached=_lifetime(last, CACHED),
        prompt_tokens_transferred=_lifetime(last, TRANSFERRED),
        kv_in_bytes=kv_in_bytes,
        kv_in_seconds=kv_in_seconds,
        kv_in_transfers=kv_in_transfers,
    )


def _kv_in(scrape: Scrape) -> tuple[float | None, float | None, int | None]:
    """The KV the engine pulled in, lifetime: NIXL's byte and time sums and its count of transfers;
    None where it exports neither."""
    if NIXL_BYTES not in scrape.series and NIXL_SECONDS not in scrape.series:
        return None, None, None
    transfers = int(scrape.value(NIXL_TRANSFERS)) if NIXL_TRANSFERS in scrape.series else None
    return scrape.value(NIXL_BYTES), scrape.value(NIXL_SECONDS), transfers


def _lifetime(scrape: Scrape, name: str) -> int | None:
    """A lifetime counter, None when the engine does not export it."""
    s = scrape.series.get(name)
    return int(s.total) if s is not None else None


class MetricsScraper:
    """Scrapes the engine's ``/metrics`` every ``interval_s`` and keeps the latest snapshot."""

    def __init__(
        self,
        engine_url: str,
        http: aiohttp.ClientSession,
        clock: Clock,
        *,
        interval_s: float,
        window_s: float,
        timeout_s: float = 5.0,
    ) -> None:
        self._url = f"{engine_url.rstrip('/')}/metrics"
        self._http = http
        self._clock = clock
        self._interval_s = interval_s
        self._window_s = window_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._window: tuple[Scrape, ...] = ()
        self._latest = MetricsSnapshot()
        self._started_at: float | None = None  # when the latest successful scrape began (monotonic)
        self._failing = False

    def latest(self) -> MetricsSnapshot:
        """The snapshot from the most recent successful scrape (all defaults before the first), with its
        age: the orchestrator needs to know how old the counters are to compare them with its own."""
        if self._started_at is None:
            return self._latest
        age = self._clock.monotonic() - self._started_at
        return dataclasses.replace(self._latest, age_s=age, sent_at=self._clock.wall())

    async def scrape_once(self) -> bool:
        """Fetch and fold in one scrape; False (and the old snapshot kept) when the engine did not answer."""
        started = self._clock.monotonic()
        try:
            async with self._http.get(self._url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            if not self._failing:  # log the first failure of a streak, not every interval
                log.info("cannot scrape %s: %s", self._url, exc or type(exc).__name__)
            self._failing = True
            return False
        self._failing = False
        scrape = Scrape(self._clock.monotonic(), self._clock.wall(), parse_exposition(text))
        self._window = push(self._window, scrape, self._window_s)
        self._latest = snapshot(self._window)
        self._started_at = started
        return True

    async def run(self) -> None:
        """Scrape until cancelled."""
        while True:
            await self.scrape_once()
            await self._clock.sleep(self._interval_s)
