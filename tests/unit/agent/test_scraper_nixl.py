"""The KV an engine pulled in: vLLM 0.32's NIXL histograms, read by the scraper and written by the sim."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from vllm_disagg.agent.scraper import (
    NIXL_BYTES,
    NIXL_SECONDS,
    Scrape,
    counters_went_back,
    parse_exposition,
    snapshot,
)
from vllm_disagg.sim_engine.metrics import EngineMetrics, GaugeValues

# What vLLM 0.32's NixlConnector registers (nixl/stats.py, NixlPromMetrics): its names, help, buckets
# and labels; one child per engine, made at startup.
XFER_TIME = ("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.")
XFER_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
BYTES = ("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.")
BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
LABELS = ["model_name", "engine"]

# An excerpt of a vLLM 0.32 decode engine's /metrics after two pulls, as prometheus_client writes it.
VLLM_TEXT = """\
# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="tiny"} 1.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="5.0",model_name="tiny"} 2.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 2.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 2.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="tiny"} 0.0125
# HELP vllm:nixl_xfer_time_seconds_created Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds_created gauge
vllm:nixl_xfer_time_seconds_created{engine="0",model_name="tiny"} 1.7578e+09
# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="2048.0",model_name="tiny"} 0.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="2.097152e+06",model_name="tiny"} 2.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="tiny"} 2.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="tiny"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 393216.0
vllm:nixl_bytes_transferred_created{engine="0",model_name="tiny"} 1.7578e+09
"""


def vllm_registry(engines: dict[str, tuple[list[float], list[float]]]) -> bytes:
    """vLLM's two histograms, one child per engine, each observing ``(bytes, seconds)`` per transfer."""
    registry = CollectorRegistry()
    time = Histogram(*XFER_TIME, labelnames=LABELS, buckets=XFER_BUCKETS, registry=registry)
    size = Histogram(*BYTES, labelnames=LABELS, buckets=BYTES_BUCKETS, registry=registry)
    for engine, (sizes, seconds) in engines.items():
        t, b = time.labels("tiny", engine), size.labels("tiny", engine)
        for n in sizes:
            b.observe(n)
        for s in seconds:
            t.observe(s)
    return generate_latest(registry)


def kv_in(text: str) -> tuple[float | None, float | None]:
    s = snapshot((Scrape(1.0, 100.0, parse_exposition(text)),))
    return s.kv_in_bytes, s.kv_in_seconds


def transfers(text: str) -> int | None:
    return snapshot((Scrape(1.0, 100.0, parse_exposition(text)),)).kv_in_transfers


def test_kv_in_transfers_is_the_count_of_nixl_transfers_summed_over_engines() -> None:
    text = vllm_registry({"0": ([1000.0], [0.25]), "1": ([3000.0, 6000.0], [0.5, 1.0])}).decode()
    assert transfers(text) == 3
    assert transfers(VLLM_TEXT) is not None
    assert transfers("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(VLLM_TEXT, (393216.0, 0.0125), id="vllm-0.32-text"),
        pytest.param(
            vllm_registry({"0": ([262144.0, 131072.0], [0.01, 0.5])}).decode(),
            (393216.0, 0.51),
            id="one-engine",
        ),
        pytest.param(
            vllm_registry({"0": ([1000.0], [0.25]), "1": ([3000.0, 6000.0], [0.5, 1.0])}).decode(),
            (10000.0, 1.75),
            id="summed-over-engines",
        ),
        pytest.param(vllm_registry({"0": ([], [])}).decode(), (0.0, 0.0), id="at-startup-zero-not-none"),
        pytest.param(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n",
            (None, None),
            id="no-nixl-connector-is-none",
        ),
    ],
)
def test_kv_in_is_the_sum_of_the_nixl_histograms(
    text: str, expected: tuple[float | None, float | None]
) -> None:
    got = kv_in(text)
    if expected[0] is None:
        assert got == (None, None)
    else:
        assert got == pytest.approx(expected)


def test_the_nixl_sums_are_lifetime_counters_a_restart_resets() -> None:
    a = Scrape(1.0, 100.0, parse_exposition(vllm_registry({"0": ([5000.0], [0.5])}).decode()))
    b = Scrape(2.0, 101.0, parse_exposition(vllm_registry({"0": ([], [])}).decode()))
    assert counters_went_back(a, b), "a shrinking byte sum means the engine restarted"
    assert {NIXL_BYTES, NIXL_SECONDS} <= set(a.series)


def _families(text: str, name: str) -> list[str]:
    """The sample lines of one histogram, with values and the HELP/TYPE lines, less ``_created``."""
    return sorted(
        line
        for line in text.splitlines()
        if re.match(rf"(# (HELP|TYPE) )?{re.escape(name)}(_bucket|_count|_sum)?[{{ ]", line)
    )


def test_the_simulated_engine_writes_the_nixl_histograms_as_vllm_does() -> None:
    sim = EngineMetrics("tiny", lambda: GaugeValues(running=0, waiting=0, kv_cache_usage=0.0))
    for nbytes, seconds in ((262144, 0.01), (3 << 20, 0.5)):
        sim.nixl_bytes_transferred.observe(nbytes)
        sim.nixl_xfer_time.observe(seconds)
    sim_text = sim.render().decode()
    vllm_text = vllm_registry({"0": ([262144.0, float(3 << 20)], [0.01, 0.5])}).decode()
    for name in (XFER_TIME[0], BYTES[0]):
        assert _families(sim_text, name) == _families(vllm_text, name), name
    assert kv_in(sim_text) == pytest.approx((262144 + (3 << 20), 0.51))
