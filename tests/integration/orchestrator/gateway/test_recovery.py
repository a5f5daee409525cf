"""Recovery on real sockets: prefill retries and colocated fallback, decode retries, lost instances,
streams cut mid-way, and the record of every attempt.

Which instance the scheduler tries first is made deterministic by the heartbeats: the healthy
instance reports a long queue, so the failing one (idle) wins the first pick.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import eventually, free_port
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator_support import fake_engine, sample, scrape
from tests.integration.recovery_support import (
    PROMPT,
    Cluster,
    Handler,
    attempts,
    complete,
    record,
    start_cluster,
    text_of,
)
from vllm_disagg import jsonutil
from vllm_disagg.config import SimTiming
from vllm_disagg.orchestrator.app import REQUEST_LOG_KEY
from vllm_disagg.sim_engine.textgen import expected_text


async def _hang(request: web.Request) -> web.Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _status_500(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "boom in the engine"}}, status=500)


async def _not_json(request: web.Request) -> web.Response:
    return web.Response(text="<html>hello</html>")


async def _no_kv(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": None})


async def _drop_before_first_byte(request: web.Request) -> web.Response:
    assert request.transport is not None
    request.transport.close()
    return web.Response()


PREFILL_FAILURES = [
    pytest.param(None, "connect", id="prefill-instance-down"),
    pytest.param(_hang, "timeout", id="prefill-hangs-past-the-idle-timeout"),
    pytest.param(_status_500, "status", id="prefill-answers-500"),
    pytest.param(_not_json, "invalid_response", id="prefill-answers-garbage"),
    pytest.param(_no_kv, "invalid_response", id="prefill-answers-without-kv-params"),
]


async def _failing_url(handler: Handler | None, stack: contextlib.AsyncExitStack) -> str:
    if handler is None:
        return f"http://127.0.0.1:{free_port()}"  # nothing listens there
    return (await stack.enter_async_context(fake_engine(handler))).url


@pytest.mark.parametrize(("handler", "cause"), PREFILL_FAILURES)
async def test_a_failed_prefill_is_retried_on_another_prefill_instance(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    handler: Handler | None,
    cause: str,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        await cluster.add("p-bad", await _failing_url(handler, stack), "prefill")
        await cluster.add("p-good", (await sim_engine()).url, "prefill", busy=True)
        await cluster.add("d0", (await sim_engine()).url, "decode")
        await cluster.ready(2, 1)
        status, raw, headers = await complete(http, cluster, "retry-1")
        assert status == 200, raw
        assert text_of(raw, False) == expected_text(PROMPT, 8)
        assert (headers["X-Disagg-Mode"], headers["X-Disagg-Prefill"]) == ("disaggregated", "p-good")
        rec = await record(http, cluster, "retry-1")
        assert attempts(rec) == [
            ("prefill", "p-bad", cause),
            ("prefill", "p-good", "ok"),
            ("decode", "d0", "ok"),
        ]
        assert rec["attempts"][0]["error"].startswith("prefill instance 'p-bad'")
        samples = await scrape(http, cluster.server.url)
        assert sample(samples, "vllm_disagg_retries_total", leg="prefill", cause=cause) == 1
        assert sample(samples, "vllm_disagg_instance_in_flight", instance="p-bad") == 0


@pytest.mark.parametrize(("handler", "cause"), PREFILL_FAILURES)
async def test_when_no_prefill_instance_succeeds_the_request_runs_colocated_on_its_decode_instance(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    handler: Handler | None,
    cause: str,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        await cluster.add("p-bad", await _failing_url(handler, stack), "prefill")
        d = await sim_engine()
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(1, 1)
        for stream in (False, True):
            status, raw, headers = await complete(http, cluster, f"fallback-{stream}", stream=stream)
            assert status == 200, raw
            assert text_of(raw, stream) == expected_text(PROMPT, 8), "the client gets a normal answer"
            assert headers["X-Disagg-Mode"] == "colocated"
        rec = await record(http, cluster, "fallback-False")
        assert attempts(rec) == [("prefill", "p-bad", cause), ("decode", "d0", "ok")]
        assert (rec["mode"], rec["fallback"], rec["status"]) == ("colocated", cause, 200)
        samples = await scrape(http, cluster.server.url)
        assert sample(samples, "vllm_disagg_fallbacks_total", cause=cause) == 2
        assert sample(samples, "vllm_disagg_requests_total", mode="fallback", status="200") == 2
        assert sample(samples, "vllm_disagg_requests_total", mode="colocated") == 0
        d_samples = await scrape(http, d.url)
        assert sample(d_samples, "vllm:nixl_num_failed_transfers_total") == 0, "D computed, never pulled"


async def test_an_engine_refusing_the_request_itself_is_answered_as_is_without_retries(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    async def too_long(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "prompt is too long"}}, status=400)

    async with fake_engine(too_long) as p:
        await cluster.add("p0", p.url, "prefill")
        await cluster.add("p1", (await sim_engine()).url, "prefill", busy=True)
        await cluster.add("d0", (await sim_engine()).url, "decode")
        await cluster.ready(2, 1)
        status, raw, _ = await complete(http, cluster, "refused")
    assert status == 400
    assert "prompt is too long" in jsonutil.loads(raw)["error"]["message"]
    assert attempts(await record(http, cluster, "refused")) == [("prefill", "p0", "rejected")]
    assert len(p.requests) == 1


@pytest.mark.parametrize(
    ("handler", "cause", "prefills"),
    [
        pytest.param(None, "connect", 1, id="decode-down-reuses-the-kv"),
        pytest.param(_drop_before_first_byte, "disconnect", 2, id="decode-drops-so-prefill-runs-again"),
        pytest.param(_status_500, "status", 2, id="decode-answers-500-so-prefill-runs-again"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_decode_failing_before_its_first_byte_is_retried_on_another_decode_instance(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    handler: Handler | None,
    cause: str,
    prefills: int,
    stream: bool,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        await cluster.add("p0", (await sim_engine()).url, "prefill")
        await cluster.add("d-bad", await _failing_url(handler, stack), "decode")
        d_good = await sim_engine()
        await cluster.add("d-good", d_good.url, "decode", busy=True)
        await cluster.ready(1, 2)
        status, raw, headers = await complete(http, cluster, "decode-retry", stream=stream)
        assert status == 200, raw
        assert text_of(raw, stream) == expected_text(PROMPT, 8)
        assert (headers["X-Disagg-Mode"], headers["X-Disagg-Decode"]) == ("disaggregated", "d-good")
        rec = await record(http, cluster, "decode-retry")
        legs = attempts(rec)
        assert legs[:2] == [("prefill", "p0", "ok"), ("decode", "d-bad", cause)]
        assert legs[-1] == ("decode", "d-good", "ok")
        assert [leg for leg, _, _ in legs].count("prefill") == prefills
        samples = await scrape(http, cluster.server.url)
        assert sample(samples, "vllm_disagg_retries_total", leg="decode", cause=cause) == 1
        d_samples = await scrape(http, d_good.url)
        assert sample(d_samples, "vllm:nixl_num_failed_transfers_total") == 0, "the KV it pulled was there"


async def test_a_stream_cut_mid_way_ends_with_an_error_event_and_counts_as_failed(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    first = b'data: {"choices": [{"text": " alpha"}]}\n\n'

    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        assert request.transport is not None
        request.transport.close()  # the engine dies mid-stream
        return resp

    async with fake_engine(decode) as d:
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(0, 1)
        status, raw, _ = await complete(http, cluster, "cut", stream=True)
    assert status == 200, "the headers were out before the engine failed"
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[0] == first.rstrip(b"\n")
    error = jsonutil.loads(events[1].removeprefix(b"data: "))["error"]
    assert "decode instance 'd0'" in error["message"] and error["code"] == 502
    assert events[2:] == [b"data: [DONE]"], "the stream ends cleanly, with the error said"
    rec = await record(http, cluster, "cut")
    assert rec["status"] == 502, "a cut stream is a failure, never a 200"
    assert attempts(rec) == [("decode", "d0", "disconnect")]
    samples = await scrape(http, cluster.server.url)
    assert (
        sample(samples, "vllm_disagg_requests_total", route="completions", mode="colocated", status="502")
        == 1
    )
    assert sample(samples, "vllm_disagg_instance_in_flight", instance="d0") == 0


async def test_a_request_on_an_instance_that_goes_silent_moves_on_once_the_instance_is_declared_dead(
    http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    # The engine accepts the request and then says nothing, and its agent stops heartbeating (a frozen
    # host, a partition): the request moves on when the instance is declared dead, not after the
    # (here: one minute) idle timeout.
    async with start_cluster(idle_timeout_s=60.0) as cluster, fake_engine(_hang) as frozen:
        await cluster.add("p0", (await sim_engine()).url, "prefill")
        silent = await cluster.add("d-frozen", frozen.url, "decode")
        await cluster.add("d-good", (await sim_engine()).url, "decode", busy=True)
        await cluster.ready(1, 2)
        task = asyncio.ensure_future(complete(http, cluster, "frozen", max_tokens=4))
        await eventually(lambda: len(frozen.requests) == 1, what="the request reached the frozen engine")
        silent.stop_heartbeats()
        status, raw, headers = await task
        assert status == 200, raw
        assert text_of(raw, False) == expected_text(PROMPT, 4)
        assert headers["X-Disagg-Decode"] == "d-good"
        rec = await record(http, cluster, "frozen")
        assert ("decode", "d-frozen", "lost") in attempts(rec)
        assert "no heartbeat" in next(a["error"] for a in rec["attempts"] if a["outcome"] == "lost")


async def test_repeated_failures_open_the_breaker_and_routing_stops_until_a_probe_succeeds(
    http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    real_p = await sim_engine()
    broken = True

    async def flaky(request: web.Request) -> web.Response:
        if broken:
            return web.json_response({"error": {"message": "sick"}}, status=503)
        async with (
            aiohttp.ClientSession() as s,
            s.post(real_p.url + request.path, data=await request.read(), headers=request.headers) as r,
        ):
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async with start_cluster(breaker_failures=2, breaker_open_s=0.3, prefill_attempts=1) as cluster:
        server = cluster.server
        async with fake_engine(flaky) as p:
            await cluster.add("p0", p.url, "prefill")
            await cluster.add("d0", (await sim_engine()).url, "decode")
            await cluster.ready(1, 1)
            for n in range(2):
                status, _, headers = await complete(http, cluster, f"sick-{n}")
                assert (status, headers["X-Disagg-Mode"]) == (200, "colocated")
            view = server.registry.get("p0")
            assert view is not None and view.state == "suspect" and view.breaker.state == "open"
            status, _, headers = await complete(http, cluster, "while-open")
            assert headers["X-Disagg-Mode"] == "colocated"
            assert len(p.requests) == 2, "nothing is sent to an instance whose breaker is open"
            broken = False
            await eventually(
                lambda: (v := server.registry.get("p0")) is not None and v.state == "ready",
                what="the breaker half-opens",
            )
            status, raw, headers = await complete(http, cluster, "probe")
            assert status == 200 and headers["X-Disagg-Prefill"] == "p0", raw
            view = server.registry.get("p0")
            assert view is not None and view.breaker.state == "closed"


async def test_a_client_that_leaves_during_the_prefill_leaves_no_kv_held_on_the_prefill_instance(
    http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    async with start_cluster() as cluster:
        await _leave_during_prefill(cluster, http, sim_engine)


async def _leave_during_prefill(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    # A prefill takes ~0.3 s here (they queue up behind each other); its engine holds the prompt's
    # blocks for a decode for 30 s.
    p = await sim_engine(timing=SimTiming(prefill_s_per_token=0.002))
    await cluster.add("p0", p.url, "prefill")
    await cluster.add("d0", (await sim_engine()).url, "decode")
    await cluster.ready(1, 1)
    for n in range(5):
        # A new prompt each time: a cached one would be prefilled too fast to leave during it.
        # Streams asking for usage too: the one-token decode that frees the KV must drop stream options.
        usage = {"stream_options": {"include_usage": True}} if n % 2 else None
        task = asyncio.ensure_future(
            complete(http, cluster, f"gone-{n}", prompt=f"{n} {PROMPT}", stream=n % 2 == 1, extra=usage)
        )
        await eventually(
            lambda: cluster.server.registry.snapshot().in_flight_of("p0") == 1, what="the prefill leg running"
        )
        task.cancel()  # the client goes away mid-prefill
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await eventually(
            functools.partial(cluster.server.app[REQUEST_LOG_KEY].get, f"gone-{n}"),
            what="the gateway saw the client leave",
        )

    async def released() -> bool:
        return sample(await scrape(http, cluster.server.url), "vllm_disagg_kv_released_total") == 5

    await eventually(released, what="a release for each abandoned prefill")

    async def idle() -> bool:
        return sample(await scrape(http, p.url), "vllm:kv_cache_usage_perc") == 0.0

    await eventually(idle, timeout=10, what="P's KV back at idle long before its 30 s lease")
    rec = await record(http, cluster, "gone-4")
    assert rec["status"] == 499


@pytest.mark.parametrize(
    ("handler", "cause", "tries"),
    [
        pytest.param(_status_500, "status", 1, id="decode-answers-500"),
        pytest.param(_drop_before_first_byte, "transport", 2, id="decode-drops-the-connection-twice"),
    ],
)
async def test_a_kv_freeing_decode_that_fails_is_counted_by_cause_and_a_dropped_connection_is_tried_twice(
    http: aiohttp.ClientSession, sim_engine: EngineFactory, handler: Handler, cause: str, tries: int
) -> None:
    seen: list[str] = []

    async def decode(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("X-Request-Id", ""))
        return await handler(request)

    async with start_cluster() as cluster, fake_engine(decode) as d:
        p = await sim_engine(timing=SimTiming(prefill_s_per_token=0.002))
        await cluster.add("p0", p.url, "prefill")
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(1, 1)
        task = asyncio.ensure_future(complete(http, cluster, "gone", prompt=f"gone {PROMPT}"))
        await eventually(lambda: cluster.server.registry.snapshot().in_flight_of("p0") == 1, what="prefill")
        task.cancel()  # the client goes away mid-prefill: D gets only the KV-freeing decode
        with contextlib.suppress(asyncio.CancelledError):
            await task

        async def failures() -> float | None:
            text = await scrape(http, cluster.server.url)
            return sample(text, "vllm_disagg_kv_release_failures_total", cause=cause) or None

        assert await eventually(failures, what="the failed release counted") == 1
        # The gateway's own id (never the client's "gone"), marked as the release's.
        assert len(seen) == tries and len(set(seen)) == 1 and re.fullmatch(r"[0-9a-f]{32}-release", seen[0])
        assert sample(await scrape(http, cluster.server.url), "vllm_disagg_kv_released_total") == 0


async def test_when_the_last_decode_instance_fails_a_prefill_instance_serves_the_request_by_itself(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    await cluster.add("p0", (await sim_engine()).url, "prefill")
    await cluster.add("d0", f"http://127.0.0.1:{free_port()}", "decode")  # nothing listens there
    await cluster.ready(1, 1)
    status, raw, headers = await complete(http, cluster, "last-one")
    assert status == 200, raw
    assert text_of(raw, False) == expected_text(PROMPT, 8)
    assert (headers["X-Disagg-Mode"], headers["X-Disagg-Decode"]) == ("colocated", "p0")
    assert attempts(await record(http, cluster, "last-one")) == [
        ("prefill", "p0", "ok"),
        ("decode", "d0", "connect"),
        ("decode", "p0", "ok"),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_decode_instance_that_recomputes_instead_of_loading_the_kv_is_caught_and_its_link_avoided(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory, stream: bool
) -> None:
    # P forgets the blocks it holds at once, so D's pull finds nothing and (vLLM's "recompute"
    # policy) D computes the prompt itself: the answer is right, only slow. Its usage says so (an
    # engine whose handle does not carry P's own figure, which vLLM 0.32's D would report instead).
    p = await sim_engine(kv_lease_s=1e-6, prefill_cache_in_handle=False)
    d = await sim_engine(prompt_tokens_details=True, kv_load_failure_policy="recompute")
    await cluster.add("p0", p.url, "prefill")
    await cluster.add("d0", d.url, "decode")
    await cluster.ready(1, 1)
    for n in range(3):
        status, raw, headers = await complete(
            http, cluster, f"slow-{n}", stream=stream, prompt=f"{n} {PROMPT}"
        )
        assert status == 200 and text_of(raw, stream) == expected_text(f"{n} {PROMPT}", 8)
        assert headers["X-Disagg-Mode"] == "disaggregated"
        assert b"cached_tokens" not in raw or not stream, "the usage the gateway asked for stays with it"
    rec = await record(http, cluster, "slow-0")
    decode = rec["attempts"][-1]
    assert (decode["leg"], decode["outcome"]) == ("decode", "recomputed")
    assert "computed the rest" in decode["error"]
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_kv_recomputed_total", prefill="p0", decode="d0") == 3
    assert sample(samples, "vllm_disagg_link_breaker_open", prefill="p0", decode="d0") == 1
    # The pair is no longer made; D serves by itself until the link's half-open probe.
    status, raw, headers = await complete(http, cluster, "after", stream=stream)
    assert status == 200 and headers["X-Disagg-Mode"] == "colocated"


async def test_a_decode_instance_that_loads_the_kv_is_not_flagged(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    await cluster.add("p0", (await sim_engine(prefill_cache_in_handle=False)).url, "prefill")
    await cluster.add("d0", (await sim_engine(prompt_tokens_details=True)).url, "decode")
    await cluster.ready(1, 1)
    for stream in (False, True):
        status, _, headers = await complete(http, cluster, f"fine-{stream}", stream=stream)
        assert status == 200 and headers["X-Disagg-Mode"] == "disaggregated"
        assert attempts(await record(http, cluster, f"fine-{stream}"))[-1] == ("decode", "d0", "ok")
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_kv_recomputed_total", prefill="p0", decode="d0") == 0


async def test_with_no_decode_instance_ready_a_prefill_instance_serves_new_requests_by_itself(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    await cluster.add("p0", (await sim_engine()).url, "prefill")
    d = await cluster.add("d0", (await sim_engine()).url, "decode")
    await cluster.ready(1, 1)
    d.engine_state = "restarting"  # its engine died; the agent is bringing it back
    d.heartbeat_now()
    await cluster.ready(1, 0)
    status, raw, headers = await complete(http, cluster, "no-decode")
    assert status == 200 and text_of(raw, False) == expected_text(PROMPT, 8)
    assert (headers["X-Disagg-Mode"], headers["X-Disagg-Decode"]) == ("colocated", "p0")
    explanation = (await record(http, cluster, "no-decode"))["explanation"]
    assert (
        explanation["scheduler"] == "last-resort" and "no ready instance can decode" in explanation["reason"]
    )


async def audited(http: aiohttp.ClientSession, cluster: Cluster, outcome: str, n: int) -> None:
    """Wait until the KV audit has judged ``n`` of D's legs as ``outcome`` (loaded, recomputed)."""

    async def judged() -> bool:
        samples = await scrape(http, cluster.server.url)
        return sample(samples, "vllm_disagg_kv_audited_legs_total", decode="d0", outcome=outcome) >= n

    await eventually(judged, what=f"{n} legs audited as {outcome}")


async def counters_reported(cluster: Cluster) -> None:
    def reported() -> bool:
        view = cluster.server.registry.get("d0")
        return view is not None and view.metrics.prompt_tokens_transferred is not None

    await eventually(reported, what="d0's agent reports its prompt_tokens_by_source counters")


async def test_vllm_032_decode_figures_that_only_echo_the_prefill_cache_never_flag_a_recompute(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    # vLLM 0.32's P adds its own prefix-cache hits to the handle as remote_prefill_cached_tokens, and D
    # reports that figure as its cached tokens (0 for a fresh prompt) whether it loaded the KV or not.
    # D does recompute here (P forgets its blocks at once), yet no verdict can be drawn from its
    # figure, and without its counters (this agent reports none) nothing else can tell.
    p = await sim_engine(kv_lease_s=1e-6)
    await cluster.add("p0", p.url, "prefill")
    d = await sim_engine(prompt_tokens_details=True, kv_load_failure_policy="recompute")
    await cluster.add("d0", d.url, "decode")
    await cluster.ready(1, 1)
    for n in range(4):
        status, _, headers = await complete(http, cluster, f"echo-{n}", prompt=f"{n} {PROMPT}")
        assert status == 200 and headers["X-Disagg-Mode"] == "disaggregated", "the pair is still made"
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_kv_recomputed_total", prefill="p0", decode="d0") == 0


async def test_a_vllm_032_decode_instance_that_recomputes_is_caught_by_its_counters_and_its_link_avoided(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    p = await sim_engine(kv_lease_s=1e-6)  # it forgets its blocks at once: D's pulls fail
    await cluster.add("p0", p.url, "prefill")
    d = await sim_engine(prompt_tokens_details=True, kv_load_failure_policy="recompute")
    await cluster.add("d0", d.url, "decode", scrape=d.url)
    await cluster.ready(1, 1)
    await counters_reported(cluster)
    for n in range(3):
        prompt = f"{n} {PROMPT}"
        status, raw, headers = await complete(http, cluster, f"slow-{n}", stream=n == 1, prompt=prompt)
        assert status == 200 and text_of(raw, n == 1) == expected_text(prompt, 8)
        assert headers["X-Disagg-Mode"] == "disaggregated"
        await audited(http, cluster, "recomputed", n + 1)
    rec = await record(http, cluster, "slow-0")
    assert "decode instance 'd0' computed" in rec["kv_check"] and "p0" in rec["kv_check"]
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_kv_recomputed_total", prefill="p0", decode="d0") == 3
    recomputed_tokens = sample(samples, "vllm_disagg_kv_recomputed_tokens_total", prefill="p0", decode="d0")
    assert recomputed_tokens >= 3 * len(PROMPT)  # the sim's tokens are the prompt's bytes
    assert sample(samples, "vllm_disagg_link_breaker_open", prefill="p0", decode="d0") == 1
    # The pair is no longer made; D serves by itself until the link's half-open probe.
    status, _, headers = await complete(http, cluster, "after")
    assert status == 200 and headers["X-Disagg-Mode"] == "colocated"


async def test_a_vllm_032_decode_instance_that_loads_the_kv_is_never_flagged_by_its_counters(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    p = await sim_engine()
    await cluster.add("p0", p.url, "prefill")
    d = await sim_engine(prompt_tokens_details=True, kv_load_failure_policy="recompute")
    await cluster.add("d0", d.url, "decode", scrape=d.url)
    await cluster.ready(1, 1)
    await counters_reported(cluster)
    prompts = [f"{n % 3} {PROMPT}" for n in range(6)]  # repeats: D may find them in its own cache
    answers = await asyncio.gather(
        *(complete(http, cluster, f"fine-{n}", stream=n % 2 == 1, prompt=pr) for n, pr in enumerate(prompts))
    )
    for status, _, headers in answers:
        assert status == 200 and headers["X-Disagg-Mode"] == "disaggregated"
    await audited(http, cluster, "loaded", len(prompts))
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_kv_audited_legs_total", decode="d0", outcome="recomputed") == 0
    assert sample(samples, "vllm_disagg_kv_recomputed_total", prefill="p0", decode="d0") == 0
    assert (await record(http, cluster, "fine-0"))["kv_check"] == ""
