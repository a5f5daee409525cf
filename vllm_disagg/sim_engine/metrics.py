"""The simulated engine's ``/metrics``: vLLM v1 metric names and labels on a private registry.

Observations are plain integer/float updates (the engine is one event loop, so no locks), and a
histogram can take many equal samples in one call: the zero-delay path stays cheap. The Prometheus
text is built only when ``/metrics`` is scraped.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket bounds as vLLM v1 defines them, so scrapers see the same shapes.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# vLLM 0.32's NixlConnector (nixl/stats.py): seconds per transfer, and bytes per transfer (2 KiB to 8 GiB).
XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))

PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FINISHED_REASONS = ("stop", "length", "abort", "error")


def _le(bound: float) -> str:
    # The spelling prometheus_client (so vLLM) uses for bucket bounds: "1.0", "+Inf", and Go's exponent
    # from seven integer digits on ("2.097152e+06"); its own floatToGoString is untyped.
    if bound == float("inf"):
        return "+Inf"
    s = repr(float(bound))
    dot = s.find(".")
    if bound > 0 and dot > 6:
        return f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.") + f"e+{dot - 1:02d}"
    return s


class Histogram:
    """A Prometheus histogram without locks; ``observe(value, n)`` records ``n`` equal samples."""

    __slots__ = ("_bounds", "_counts", "count", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` samples of ``value`` (``le`` semantics: a sample equal to a bound is in it)."""
        self._counts[bisect_left(self._bounds, value)] += n
        self.count += n
        self.sum += value * n

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, c in zip((*self._bounds, float("inf")), self._counts, strict=True):
            total += c
            out.append((_le(bound), float(total)))
        return out


@dataclass(frozen=True, slots=True)
class GaugeValues:
    """The engine's instantaneous state, read when ``/metrics`` is scraped."""

    running: int
    waiting: int
    kv_cache_usage: float


class EngineMetrics:
    """Every counter and histogram of one simulated engine, exposed with vLLM's v1 names."""

    def __init__(
        self,
        model_name: str,
        gauges: Callable[[], GaugeValues],
        engine: str = "0",
        cache_config: Mapping[str, str] | None = None,
    ) -> None:
        self.labels = (model_name, engine)
        self._gauges = gauges
        # vLLM's ``vllm:cache_config_info`` labels (str() of each value), as an attached agent reads them.
        self.cache_config = dict(cache_config or {})
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_SOURCES, 0)
        self.request_success = dict.fromkeys(FINISHED_REASONS, 0)
        self.num_preemptions = 0
        self.nixl_num_failed_transfers = 0
        self.sim_kv_pulls_served = 0  # blocks handed to decoders
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(TOKEN_LATENCY_BUCKETS)
        self.tpot = Histogram(TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.max_tokens_param = Histogram(TOKEN_COUNT_BUCKETS)
        self.request_prompt_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = Histogram(TOKEN_COUNT_BUCKETS)
        self.nixl_xfer_time = Histogram(XFER_BUCKETS)
        self.nixl_bytes_transferred = Histogram(NIXL_BYTES_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)


class _Collector:
    """Turns ``EngineMetrics`` into metric families at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterable[Metric]:
        """Every family, from the engine's numbers at this scrape (the gauges read first)."""
        m = self._m
        labels = ["model_name", "engine"]
        values = list(m.labels)
        g = m._gauges()
        if m.cache_config:
            yield _cache_config_info(m)
        yield from _gauge_families(g, labels, values)
        yield from _counter_families(m, labels, values)
        yield from _counters_by_label(m, labels, values)
        yield from _histogram_families(m, labels, values)


def _cache_config_info(m: EngineMetrics) -> Metric:
    """vLLM's ``cache_config_info``: the cache configuration as the labels of a constant 1."""
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=[*m.cache_config, "engine"],
    )
    info.add_metric([*m.cache_config.values(), m.labels[1]], 1.0)
    return info


def _gauge_families(g: GaugeValues, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """The requests running and waiting, and the KV cache's use."""
    for name, doc, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", g.running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g.waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g.kv_cache_usage),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=labels)
        gauge.add_metric(values, float(value))
        yield gauge


def _counter_families(m: EngineMetrics, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """The token, prefix cache, preemption and KV transfer failure counters."""
    for name, doc, count in (
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens),
        ("vllm:generation_tokens", "Number of generation tokens processed.", m.generation_tokens),
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of tokens.",
            m.prefix_cache_queries,
        ),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.", m.prefix_cache_hits),
        ("vllm:num_preemptions", "Cumulative number of preemptions.", m.num_preemptions),
        ("vllm:nixl_num_failed_transfers", "Failed KV transfers.", m.nixl_num_failed_transfers),
        ("vllm:sim_kv_pulls_served", "KV blocks this engine handed to decoders.", m.sim_kv_pulls_served),
    ):
        counter = CounterMetricFamily(name, doc, labels=labels)
        counter.add_metric(values, float(count))
        yield counter


def _counters_by_label(m: EngineMetrics, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """The counters with one more label: prompt tokens by source, finished requests by reason."""
    for name, doc, label, table in (
        (
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            m.prompt_tokens_by_source,
        ),
        (
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            m.request_success,
        ),
    ):
        counter = CounterMetricFamily(name, doc, labels=[*labels, label])
        for key, count in table.items():
            counter.add_metric([*values, key], float(count))
        yield counter


def _histogram_families(m: EngineMetrics, labels: list[str], values: list[str]) -> Iterable[Metric]:
    """The latency, phase time, request size and KV transfer time and size histograms."""
    for name, doc, hist in (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl),
        (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            m.tpot,
        ),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m.e2e),
        ("vllm:request_queue_time_seconds", "Time spent in the WAITING phase.", m.queue_time),
        ("vllm:request_prefill_time_seconds", "Time spent in the PREFILL phase.", m.prefill_time),
        ("vllm:request_decode_time_seconds", "Time spent in the DECODE phase.", m.decode_time),
        ("vllm:request_params_max_tokens", "The max_tokens request parameter.", m.max_tokens_param),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", m.request_prompt_tokens),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            m.request_generation_tokens,
        ),
        (
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            m.nixl_xfer_time,
        ),
        (
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            m.nixl_bytes_transferred,
        ),
    ):
        family = HistogramMetricFamily(name, doc, labels=labels)
        family.add_metric(values, hist.buckets(), sum_value=hist.sum)
        yield family
