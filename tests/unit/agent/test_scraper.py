"""The agent's metrics scraper: parsing vLLM's Prometheus text, the scrape window, the snapshot."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_disagg.agent.scraper import Scrape, Series, parse_exposition, push, snapshot
from vllm_disagg.protocol.messages import MetricsSnapshot
from vllm_disagg.sim_engine.metrics import EngineMetrics, GaugeValues

HEADER = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
"""


def vllm_text(
    *,
    running: float = 0,
    waiting: float = 0,
    kv: float = 0.0,
    prompt: float = 0,
    gen: float = 0,
    ok: float = 0,
    queries: float = 0,
    hits: float = 0,
    ttft: tuple[float, float] = (0.0, 0),
    tpot: tuple[float, float] = (0.0, 0),
    itl: tuple[float, float] = (0.0, 0),
    queue: tuple[float, float] = (0.0, 0),
    prefill: tuple[float, float] = (0.0, 0),
    prompt_len: tuple[float, float] = (0.0, 0),
    engine: str = "0",
) -> str:
    """An exposition shaped like vLLM v1's (HELP/TYPE lines, labels, buckets, _created series)."""
    labels = f'engine="{engine}",model_name="tiny"'
    lines = [
        HEADER.rstrip("\n"),
        f"vllm:num_requests_running{{{labels}}} {running}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
        "# TYPE vllm:prompt_tokens counter",
        f"vllm:prompt_tokens_total{{{labels}}} {prompt}",
        f"vllm:prompt_tokens_created{{{labels}}} 1.7e+09",
        f"vllm:generation_tokens_total{{{labels}}} {gen}",
        f'vllm:request_success_total{{{labels},finished_reason="stop"}} {ok}',
        f'vllm:request_success_total{{{labels},finished_reason="length"}} 0.0',
        f"vllm:prefix_cache_queries_total{{{labels}}} {queries}",
        f"vllm:prefix_cache_hits_total{{{labels}}} {hits}",
    ]
    for name, (total, count) in (
        ("vllm:time_to_first_token_seconds", ttft),
        ("vllm:request_time_per_output_token_seconds", tpot),
        ("vllm:inter_token_latency_seconds", itl),
        ("vllm:request_queue_time_seconds", queue),
        ("vllm:request_prefill_time_seconds", prefill),
        ("vllm:request_prompt_tokens", prompt_len),
    ):
        lines += [
            f"# HELP {name} Histogram.",
            f"# TYPE {name} histogram",
            f'{name}_bucket{{{labels},le="0.001"}} 0.0',
            f'{name}_bucket{{{labels},le="+Inf"}} {count}',
            f"{name}_count{{{labels}}} {count}",
            f"{name}_sum{{{labels}}} {total}",
        ]
    return "\n".join(lines) + "\n"


PARSE_CASES = [
    pytest.param(
        vllm_text(running=3, waiting=2, kv=0.5, prompt=100, gen=40),
        {
            "vllm:num_requests_running": Series(3, 1),
            "vllm:num_requests_waiting": Series(2, 1),
            "vllm:kv_cache_usage_perc": Series(0.5, 1),
            "vllm:prompt_tokens_total": Series(100, 1),
            "vllm:generation_tokens_total": Series(40, 1),
        },
        id="vllm-shaped text: gauges and counters by name, _created series ignored",
    ),
    pytest.param(
        vllm_text(ok=7),
        {"vllm:request_success_total": Series(7, 2)},
        id="label sets of one counter are summed (finished_reason stop + length)",
    ),
    pytest.param(
        vllm_text(running=1, engine="0") + vllm_text(running=2, engine="1"),
        {"vllm:num_requests_running": Series(3, 2), "vllm:kv_cache_usage_perc": Series(0.0, 2)},
        id="several engines (data parallel) are summed",
    ),
    pytest.param(
        vllm_text(ttft=(1.5, 3)),
        {
            "vllm:time_to_first_token_seconds_sum": Series(1.5, 1),
            "vllm:time_to_first_token_seconds_count": Series(3, 1),
        },
        id="histograms: _sum and _count kept, buckets with +Inf skipped",
    ),
    pytest.param(
        'vllm:num_requests_running{model_name="a \\"quoted\\" } name",engine="x y"} 4\n',
        {"vllm:num_requests_running": Series(4, 1)},
        id="label values with escaped quotes, braces and spaces",
    ),
    pytest.param(
        'vllm:num_requests_running{model_name="back\\\\slash\\n"} 5 1700000000000\n',
        {"vllm:num_requests_running": Series(5, 1)},
        id="escaped backslash and newline in a label value, and a timestamp after the value",
    ),
    pytest.param(
        "vllm:num_requests_running 6\n",
        {"vllm:num_requests_running": Series(6, 1)},
        id="a series without labels",
    ),
    pytest.param(
        'vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:kv_cache_usage_perc{engine="1"} 0.25\n',
        {"vllm:kv_cache_usage_perc": Series(0.25, 1)},
        id="NaN samples are ignored",
    ),
    pytest.param(
        'vllm:prompt_tokens_total{engine="0"} 1.5e+06\n',
        {"vllm:prompt_tokens_total": Series(1.5e6, 1)},
        id="exponent notation",
    ),
    pytest.param(
        'vllm:num_requests_running{engine="0" 3\nvllm:num_requests_waiting{} abc\n'
        "vllm:num_requests_running\n\n   \nvllm:prompt_tokens_total{} 2\n",
        {"vllm:prompt_tokens_total": Series(2, 1)},
        id="malformed lines are skipped, the rest is still read",
    ),
    pytest.param(
        "# HELP vllm:num_requests_running 9\n# TYPE vllm:num_requests_running gauge\n",
        {},
        id="comments only: nothing",
    ),
    pytest.param(
        "vllm:num_requests_running_other 1\nprocess_cpu_seconds_total 4\n",
        {},
        id="names that merely start like a wanted one are not it",
    ),
]


@pytest.mark.parametrize(("text", "expected"), PARSE_CASES)
def test_parse_exposition(text: str, expected: dict[str, Series]) -> None:
    parsed = parse_exposition(text)
    assert {k: v for k, v in parsed.items() if k in expected} == expected
    for name in set(parsed) - set(expected):
        assert parsed[name].total == 0, f"{name} should be 0 in this text"


def scrape(at: float, **values: Any) -> Scrape:
    return Scrape(at=at, wall=at + 1.7e9, series=parse_exposition(vllm_text(**values)))


def window_of(*scrapes: Scrape, window_s: float = 10.0) -> tuple[Scrape, ...]:
    window: tuple[Scrape, ...] = ()
    for s in scrapes:
        window = push(window, s, window_s)
    return window


def test_no_scrape_yet_is_the_empty_snapshot() -> None:
    assert snapshot(()) == MetricsSnapshot()


SNAPSHOT_CASES = [
    pytest.param(
        [
            scrape(
                0, running=2, waiting=1, kv=0.25, prompt=10, gen=5, ok=1, ttft=(3.0, 2), queries=100, hits=50
            )
        ],
        dict(
            num_running=2,
            num_waiting=1,
            kv_cache_usage=0.25,
            prompt_tokens=10,
            generation_tokens=5,
            requests_finished=1,
            ttft_s=None,
            tpot_s=None,
            prefix_cache_hit_rate=None,
            window_s=0.0,
        ),
        id="one scrape: gauges and lifetime counters, no windowed values yet",
    ),
    pytest.param(
        [scrape(0, ttft=(1.0, 10), tpot=(0.5, 10)), scrape(5, ttft=(4.0, 13), tpot=(0.7, 12))],
        dict(ttft_s=1.0, tpot_s=pytest.approx(0.1), window_s=5.0),
        id="ttft and tpot are delta-sum over delta-count across the window",
    ),
    pytest.param(
        [scrape(0, ttft=(1.0, 10)), scrape(5, ttft=(1.0, 10))],
        dict(ttft_s=None, tpot_s=None),
        id="no new samples in the window: None, not a lifetime average",
    ),
    pytest.param(
        [scrape(0, itl=(1.0, 100)), scrape(2, itl=(1.5, 150))],
        dict(tpot_s=pytest.approx(0.01)),
        id="tpot falls back to inter-token latency while no request finished",
    ),
    pytest.param(
        [
            scrape(0, queue=(1.0, 10), prefill=(2.0, 10), prompt_len=(5000, 10)),
            scrape(5, queue=(1.5, 14), prefill=(2.5, 14), prompt_len=(9000, 14)),
        ],
        dict(queue_s=0.125, prefill_tokens_per_s=8000.0, mean_prompt_tokens=1000.0),
        id="queue time, prefill throughput and prompt length are per-request deltas over the window",
    ),
    pytest.param(
        [
            scrape(0, queue=(1.0, 10), prefill=(2.0, 10), prompt_len=(5000, 10)),
            scrape(5, queue=(1.0, 10), prefill=(2.0, 10), prompt_len=(5000, 10)),
        ],
        dict(queue_s=None, prefill_tokens_per_s=None, mean_prompt_tokens=None),
        id="no request finished in the window: no queue time, throughput or prompt length",
    ),
    pytest.param(
        [
            scrape(0, prefill=(2.0, 10), prompt_len=(5000, 10)),
            scrape(5, prefill=(2.0, 12), prompt_len=(5200, 12)),
        ],
        dict(prefill_tokens_per_s=None, mean_prompt_tokens=100.0),
        id="requests that took no prefill time (KV pulled from a prefill engine) give no throughput",
    ),
    pytest.param(
        [scrape(0, queue=(3.0, 3), prefill=(1.0, 2), prompt_len=(64, 2))],
        dict(queue_s=None, prefill_tokens_per_s=None, mean_prompt_tokens=None),
        id="one scrape: no per-request averages yet, not lifetime ones",
    ),
    pytest.param(
        [scrape(0, queries=100, hits=10), scrape(1, queries=300, hits=110)],
        dict(prefix_cache_hit_rate=0.5),
        id="prefix cache hit rate is delta hits over delta queries",
    ),
    pytest.param(
        [
            scrape(0, prompt=500, gen=900, ok=9, ttft=(9.0, 9)),
            scrape(1, prompt=5, gen=2, ok=1, ttft=(0.1, 1)),
        ],
        dict(prompt_tokens=5, generation_tokens=2, requests_finished=1, ttft_s=None, window_s=0.0),
        id="a counter going down (engine restarted) starts the window afresh",
    ),
    pytest.param(
        [scrape(t, ttft=(float(t), t)) for t in range(0, 31)],
        dict(window_s=10.0, ttft_s=1.0),
        id="old scrapes leave the window; the baseline is the last one at its start",
    ),
    pytest.param(
        [
            scrape(0, kv=0.2, engine="0"),
            Scrape(
                1,
                1.7e9 + 1,
                parse_exposition(vllm_text(kv=0.2, running=1) + vllm_text(kv=0.6, running=2, engine="1")),
            ),
        ],
        dict(kv_cache_usage=pytest.approx(0.4), num_running=3),
        id="kv usage is the mean over engines, running is the sum",
    ),
]


@pytest.mark.parametrize(("scrapes", "expected"), SNAPSHOT_CASES)
def test_snapshot(scrapes: list[Scrape], expected: dict[str, object]) -> None:
    snap = snapshot(window_of(*scrapes))
    assert {k: getattr(snap, k) for k in expected} == expected
    assert snap.scraped_at == scrapes[-1].wall


def test_old_vllm_names_are_understood() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n'
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 5\n'
        'vllm:time_per_output_token_seconds_sum{model_name="m"} 2\n'
        'vllm:time_per_output_token_seconds_count{model_name="m"} 4\n'
    )
    snap = snapshot((Scrape(0, 0, {}), Scrape(1, 1, parse_exposition(text))))
    assert (snap.kv_cache_usage, snap.prefix_cache_hit_rate, snap.tpot_s) == (0.75, 0.5, 0.5)


@pytest.mark.parametrize(
    ("times", "window_s", "kept"),
    [
        ([0, 1, 2], 10, [0, 1, 2]),
        ([0, 5, 10, 15], 10, [5, 10, 15]),
        ([0, 4, 8, 12, 16], 10, [4, 8, 12, 16]),
        ([0, 30], 10, [0, 30]),
    ],
    ids=[
        "all within the window are kept",
        "a scrape exactly at the window's start is the baseline",
        "the newest scrape before the start stays as the baseline",
        "after a long gap the only older scrape is the baseline",
    ],
)
def test_push_keeps_a_baseline_at_or_before_the_window_start(
    times: list[float], window_s: float, kept: list[float]
) -> None:
    window = window_of(*(Scrape(t, t, {}) for t in times), window_s=window_s)
    assert [s.at for s in window] == kept


def test_parsing_a_large_exposition_reads_only_the_wanted_series() -> None:
    noise = "".join(
        f'vllm:e2e_request_latency_seconds_bucket{{engine="{e}",le="{b}",model_name="m"}} {b}\n'
        for e in range(8)
        for b in range(500)
    )
    parsed = parse_exposition(noise + vllm_text(running=7))
    assert parsed["vllm:num_requests_running"] == Series(7, 1)
    assert not any(name.startswith("vllm:e2e") for name in parsed)


def test_reads_what_prometheus_client_writes_including_awkward_label_values() -> None:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "doc", ["model_name", "engine"], registry=registry)
    running.labels('we"ird} name\\ with\nnewline', "0").set(2)
    running.labels("m", "1").set(3)
    Counter("vllm:prompt_tokens", "doc", ["model_name"], registry=registry).labels("m").inc(5)
    ttft = Histogram("vllm:time_to_first_token_seconds", "doc", ["model_name"], registry=registry)
    ttft.labels("m").observe(0.25)
    ttft.labels("m").observe(0.5)
    parsed = parse_exposition(generate_latest(registry).decode())
    assert parsed["vllm:num_requests_running"] == Series(5, 2)
    assert parsed["vllm:prompt_tokens_total"] == Series(5, 1)
    assert parsed["vllm:time_to_first_token_seconds_count"] == Series(2, 1)
    assert parsed["vllm:time_to_first_token_seconds_sum"] == Series(0.75, 1)


def test_the_simulated_engines_exposition_gives_queue_time_prefill_throughput_and_prompt_length() -> None:
    engine = EngineMetrics("sim-model", lambda: GaugeValues(running=0, waiting=0, kv_cache_usage=0.0))
    before = Scrape(0, 0, parse_exposition(engine.render().decode()))
    for queue_s, prefill_s, prompt in ((0.5, 0.25, 1000), (0.25, 0.75, 3000)):
        engine.queue_time.observe(queue_s)
        engine.prefill_time.observe(prefill_s)
        engine.request_prompt_tokens.observe(prompt)
    after = Scrape(1, 1, parse_exposition(engine.render().decode()))
    snap = snapshot((before, after))
    assert (snap.queue_s, snap.prefill_tokens_per_s, snap.mean_prompt_tokens) == (0.375, 4000.0, 2000.0)


def test_prompt_tokens_are_kept_apart_by_source_and_summed_over_engines() -> None:
    registry = CollectorRegistry()
    by_source = Counter(
        "vllm:prompt_tokens_by_source", "doc", ["engine", "model_name", "source"], registry=registry
    )
    for engine, (computed, cached, transferred) in (("0", (10, 32, 236)), ("1", (5, 0, 41))):
        by_source.labels(engine, "m", "local_compute").inc(computed)
        by_source.labels(engine, "m", "local_cache_hit").inc(cached)
        by_source.labels(engine, "m", "external_kv_transfer").inc(transferred)
    snap = snapshot((Scrape(0, 0, parse_exposition(generate_latest(registry).decode())),))
    assert (snap.prompt_tokens_computed, snap.prompt_tokens_cached, snap.prompt_tokens_transferred) == (
        15,
        32,
        277,
    )


def test_an_engine_without_prompt_tokens_by_source_reports_none_rather_than_zero() -> None:
    snap = snapshot((Scrape(0, 0, parse_exposition(vllm_text(prompt=100))),))
    assert snap.prompt_tokens == 100
    assert (snap.prompt_tokens_computed, snap.prompt_tokens_cached, snap.prompt_tokens_transferred) == (
        None,
        None,
        None,
    )


def test_the_simulated_engine_counts_a_colocated_prompt_as_computed() -> None:
    engine = EngineMetrics("sim-model", lambda: GaugeValues(running=0, waiting=0, kv_cache_usage=0.0))
    engine.prompt_tokens_by_source["local_compute"] += 7
    engine.prompt_tokens_by_source["external_kv_transfer"] += 64
    snap = snapshot((Scrape(0, 0, parse_exposition(engine.render().decode())),))
    assert (snap.prompt_tokens_computed, snap.prompt_tokens_cached, snap.prompt_tokens_transferred) == (
        7,
        0,
        64,
    )
