"""The chaos command's parts on their own: the request mix, the tally, the bounds of the load (against
real HTTP servers on loopback), the counter deltas, finding an agent's engine among real processes,
and flags refused before anything starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from tests.helpers import eventually, eventually_sync, free_port
from vllm_disagg.chaos.check import Checker, RequestSpec, Verdict
from vllm_disagg.chaos.killer import alive, engine_pid
from vllm_disagg.chaos.load import (
    FAILURE_BACKOFF_S,
    HEAD_BYTES,
    LoadConfig,
    LoadGenerator,
    RequestPlanner,
    Tally,
)
from vllm_disagg.chaos.report import counter_sums
from vllm_disagg.cli.commands import main


def planner(seed: int, tag: str = "t") -> RequestPlanner:
    return RequestPlanner(random.Random(seed), tag, min_tokens=32, max_tokens=64, stream_fraction=0.8)


def test_the_same_seed_gives_the_same_requests() -> None:
    a, b = planner(7), planner(7)
    assert [a.next() for _ in range(50)] == [b.next() for _ in range(50)]
    assert [planner(8).next() for _ in range(5)] != [planner(7).next() for _ in range(5)]


def test_the_mix_has_both_routes_mostly_streams_varied_lengths_and_repeating_prefixes() -> None:
    p = planner(1)
    specs = [p.next() for _ in range(400)]
    kinds = Counter(s.kind for s in specs)
    assert kinds["chat"] > 100 and kinds["completion"] > 100
    assert 0.7 < sum(s.stream for s in specs) / len(specs) < 0.9
    assert any(s.include_usage for s in specs) and not any(s.include_usage and not s.stream for s in specs)
    assert {s.max_tokens for s in specs} <= set(range(32, 65)) and len({s.max_tokens for s in specs}) > 10
    assert len({s.request_id for s in specs}) == len(specs)
    openings = Counter((s.prompt or s.messages[0][1])[:40] for s in specs)
    assert len(openings) <= 8 and max(openings.values()) > 20  # prefixes repeat: the prefix cache matters
    assert len({s.prompt or s.messages for s in specs}) == len(specs)  # whole prompts do not


def test_request_ids_carry_the_run_tag_so_runs_never_share_one() -> None:
    assert planner(1, "aaaa").next().request_id != planner(1, "bbbb").next().request_id


def test_the_tally_counts_every_outcome_and_keeps_a_few_examples() -> None:
    tally = Tally(max_examples=2)
    spec = RequestSpec("r1", "completion", True, 4, prompt="p")
    body = b"x" * 1000
    for outcome in ("completed", "failed", "failed", "failed", "garbled"):
        tally.add(spec, Verdict(outcome, "why"), 200, body, 1.5)
    assert (tally.sent, tally.completed, tally.failed, tally.garbled) == (5, 1, 3, 1)
    assert len(tally.examples["failed"]) == 2 and len(tally.examples["garbled"]) == 1
    example = tally.examples["failed"][0]
    assert example["request_id"] == "r1" and example["status"] == 200 and example["reason"] == "why"
    assert len(example["head"]) == HEAD_BYTES and example["tail"]


@pytest.mark.parametrize(
    "base", ["http://10.0.0.1:8000", "http://example.com", "https://127.0.0.1:1"], ids=str
)
def test_load_goes_only_to_loopback(base: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        LoadConfig(base, "m", concurrency=1, duration_s=1, max_requests=1)


@pytest.mark.parametrize(
    ("concurrency", "duration", "max_requests"),
    [(0, 1.0, 1), (1, 0.0, 1), (1, 1.0, 0)],
    ids=["no-workers", "no-time", "no-requests"],
)
def test_load_is_bounded_in_count_and_time(concurrency: int, duration: float, max_requests: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        LoadConfig("http://127.0.0.1:1", "m", concurrency, duration, max_requests)


EXPOSITION = """\
# HELP vllm_disagg_retries_total Retries
# TYPE vllm_disagg_retries_total counter
vllm_disagg_retries_total{leg="prefill",reason="connect"} 3.0
vllm_disagg_retries_total{leg="decode",reason="reset"} 4.0
vllm_disagg_retries_created{leg="decode",reason="reset"} 1.7e9
vllm_disagg_resumes_total 2.0
vllm_disagg_resumes_totally_other 100
"""


def test_counters_are_summed_over_labels_and_missing_ones_are_zero() -> None:
    names = {"vllm_disagg_retries_total", "vllm_disagg_resumes_total", "vllm_disagg_fallbacks_total"}
    assert counter_sums(EXPOSITION, names) == {
        "vllm_disagg_retries_total": 7.0,
        "vllm_disagg_resumes_total": 2.0,
        "vllm_disagg_fallbacks_total": 0.0,
    }


def test_an_agents_engine_is_found_by_parent_and_port_and_is_gone_once_it_exits() -> None:
    port = free_port()
    # A stand-in engine: a child of this process whose command line says it serves ``port``.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "sim-engine", "--port", str(port)],
        stdin=subprocess.PIPE,
    )
    try:
        found = eventually_sync(lambda: engine_pid(os.getpid(), port), timeout=30, what="the stand-in engine")
        assert found == child.pid and alive(child.pid)
        assert engine_pid(os.getpid(), port + 1) is None  # another port
        assert engine_pid(child.pid, port) is None  # another parent
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert engine_pid(os.getpid(), port) is None and not alive(child.pid)


@pytest.mark.parametrize(
    "flags",
    [
        ["--kinds", "disk"],
        ["--kinds", "engine,disk"],
        ["--min-tokens", "10", "--max-tokens", "5"],
        ["--duration", "0"],
        ["--concurrency", "0"],
        ["--kill-every", "-1"],
        ["--stream-fraction", "1.5"],
        ["--decode", "0"],
    ],
    ids=[
        "unknown-fault-kind",
        "one-unknown-fault-kind",
        "min-tokens-over-max",
        "no-duration",
        "no-workers",
        "negative-interval",
        "fraction-over-one",
        "no-decode-instance",
    ],
)
def test_bad_flags_are_refused_before_anything_starts(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chaos", *flags]) == 2
    assert "configuration error" in capsys.readouterr().err


@contextlib.asynccontextmanager
async def gateway_stub(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """A real HTTP server on loopback answering every completions route with ``handler``; its base URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def generator(base: str, concurrency: int, duration_s: float, max_requests: int) -> LoadGenerator:
    cfg = LoadConfig(base, "sim-model", concurrency, duration_s, max_requests, request_timeout_s=30)
    return LoadGenerator(cfg, planner(3), Checker("sim-model"), Tally())


async def test_a_cluster_failing_every_request_at_once_is_not_hammered() -> None:
    async def unavailable(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no decode instance"}}, status=503)

    async with gateway_stub(unavailable) as base:
        load = generator(base, concurrency=2, duration_s=1.0, max_requests=100_000)
        await load.run(asyncio.Event())
    tally = load.tally
    assert tally.sent > 0 and tally.failed == tally.sent
    # Each worker pauses 50 ms, 100 ms, ... after a failure: a spinning client would send thousands.
    assert tally.sent <= 2 * 1.0 / FAILURE_BACKOFF_S
    assert tally.examples["failed"][0]["reason"] == "HTTP 503"


async def test_the_load_stops_at_the_request_count() -> None:
    async def wrong(request: web.Request) -> web.Response:
        return web.json_response({"id": "x", "created": 1, "choices": []})

    async with gateway_stub(wrong) as base:
        load = generator(base, concurrency=4, duration_s=60, max_requests=10)
        await load.run(asyncio.Event())
    tally = load.tally
    assert (tally.sent, tally.completed, tally.failed + tally.garbled) == (10, 0, 10)


async def test_stop_abandons_the_requests_in_flight_without_judging_them() -> None:
    arrived = asyncio.Event()
    release = asyncio.Event()

    async def stuck(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.Response(status=500)

    async with gateway_stub(stuck) as base:
        load = generator(base, concurrency=3, duration_s=60, max_requests=100)
        stop = asyncio.Event()
        running = asyncio.ensure_future(load.run(stop))
        await asyncio.wait_for(arrived.wait(), timeout=30)
        await eventually(lambda: load.in_flight == 3, timeout=30, what="three requests in flight")
        stop.set()
        await asyncio.wait_for(running, timeout=30)
        release.set()
    assert (load.tally.sent, load.tally.abandoned, load.in_flight) == (0, 3, 0)
