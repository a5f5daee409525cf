"""The simulated vLLM engine on real loopback ports: P/D handoff, batching, prefix cache, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import eventually, free_port
from tests.integration.sim_support import (
    BLOCK,
    LONG_PROMPT,
    MODEL,
    STEPPED,
    TIMINGS,
    StartEngine,
    metric,
    post,
    scrape,
    sse_events,
    value,
)
from vllm_disagg.agent.scraper import Scrape, parse_exposition, snapshot
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.sim_engine import textgen
from vllm_disagg.sim_engine.engine import SimServer, build_app


async def prefill(
    http: aiohttp.ClientSession, server: SimServer, prompt: str, request_id: str
) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    status, payload, _ = await post(http, server.url + "/v1/completions", body, {"X-Request-Id": request_id})
    assert status == 200, payload
    assert payload["choices"][0]["text"] == textgen.expected_text(prompt, 1)
    params: dict[str, Any] = payload["kv_transfer_params"]
    return params


async def decode(
    http: aiohttp.ClientSession,
    server: SimServer,
    prompt: str,
    params: dict[str, Any],
    request_id: str,
    max_tokens: int = 12,
    stream: bool = False,
) -> tuple[int, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}
    if stream:
        body["stream"] = True
    status, payload, _ = await post(http, server.url + "/v1/completions", body, {"X-Request-Id": request_id})
    return status, payload


@TIMINGS
async def test_prefill_then_decode_moves_the_whole_prompt_and_answers_like_colocated(
    http: aiohttp.ClientSession, engines: StartEngine, timing: SimTiming
) -> None:
    p = await engines(timing, engine_id="prefill-0")
    d = await engines(timing)
    prompt_len = len(textgen.tokenize(LONG_PROMPT))
    blocks = -(-prompt_len // BLOCK)  # the partial last block moves too, as with vLLM 0.32's NixlConnector
    assert prompt_len % BLOCK, "the prompt ends in a partial block"
    params = await prefill(http, p, LONG_PROMPT, "pd-1")
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == blocks
    assert params["remote_engine_id"] == "prefill-0"
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port), "the actual port"
    assert (params["tp_size"], params["remote_request_id"]) == (1, "pd-1")
    held = await metric(http, p, "vllm:kv_cache_usage_perc")
    assert held == pytest.approx(len(params["remote_block_ids"]) / timing.num_blocks), "held blocks use KV"
    assert await metric(http, p, "vllm:request_params_max_tokens_bucket", le="1.0") == 1

    before = await scrape(http, d)
    status, payload = await decode(http, d, LONG_PROMPT, params, "pd-1")
    assert status == 200, payload
    assert payload["choices"][0]["text"] == textgen.expected_text(LONG_PROMPT, 12), "same text as colocated"
    after = await scrape(http, d)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == prompt_len
    assert grew("vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert grew("vllm:nixl_bytes_transferred_sum") == 4 * prompt_len
    assert value(after, "vllm:nixl_num_failed_transfers_total") == 0
    assert value(after, "vllm:request_params_max_tokens_bucket", le="1.0") == 0, "the decode leg ran on D"
    assert await metric(http, p, "vllm:kv_cache_usage_perc") == 0, "a pull frees the held blocks"
    assert await metric(http, p, "vllm:sim_kv_pulls_served_total") == blocks


@pytest.mark.parametrize("per_token", [1, 70_000], ids=["a-byte-a-token", "more-than-a-write-buffer"])
async def test_with_kv_bytes_per_token_the_pull_moves_that_payload_and_d_reports_it_as_nixl_does(
    http: aiohttp.ClientSession, engines: StartEngine, per_token: int
) -> None:
    timing = SimTiming(block_size=BLOCK, kv_bytes_per_token=per_token)
    p, d = await engines(timing, engine_id="prefill-0"), await engines(timing)
    prompt_len = len(textgen.tokenize(LONG_PROMPT))
    params = await prefill(http, p, LONG_PROMPT, "pd-payload")
    status, payload = await decode(http, d, LONG_PROMPT, params, "pd-payload")
    assert status == 200, payload
    assert payload["choices"][0]["text"] == textgen.expected_text(LONG_PROMPT, 12), "the KV still checks"
    after = await scrape(http, d)
    assert value(after, "vllm:nixl_bytes_transferred_count") == 1
    assert value(after, "vllm:nixl_xfer_time_seconds_count") == 1
    async with http.get(d.url + "/metrics") as r:
        text = await r.text()
    seen = snapshot((Scrape(1.0, 1.0, parse_exposition(text)),))  # as D's agent reads it
    assert seen.kv_in_bytes == per_token * prompt_len, "the payload bytes that crossed the link"
    assert seen.kv_in_seconds is not None and seen.kv_in_seconds > 0
    assert value(after, "vllm:nixl_num_failed_transfers_total") == 0


async def test_streamed_decode_after_remote_prefill(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    p, d = await engines(STEPPED), await engines(STEPPED)
    params = await prefill(http, p, LONG_PROMPT, "pd-stream")
    status, text = await decode(http, d, LONG_PROMPT, params, "pd-stream", max_tokens=6, stream=True)
    assert status == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == textgen.expected_text(LONG_PROMPT, 6)


async def test_a_prompt_shorter_than_a_block_moves_its_one_partial_block(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    p, d = await engines(), await engines()
    prompt_len = len(textgen.tokenize("short"))
    assert prompt_len < BLOCK
    params = await prefill(http, p, "short", "pd-short")
    assert len(params["remote_block_ids"]) == 1
    before = await scrape(http, d)
    status, payload = await decode(http, d, "short", params, "pd-short", max_tokens=3)
    assert status == 200 and payload["choices"][0]["text"] == textgen.expected_text("short", 3)
    after = await scrape(http, d)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == prompt_len
    assert grew("vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert grew("vllm:nixl_bytes_transferred_sum") == 4 * prompt_len
    assert value(after, "vllm:nixl_num_failed_transfers_total") == 0
    assert await metric(http, p, "vllm:kv_cache_usage_perc") == 0, "the pull freed the held block"


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        ("block_ids", "no KV blocks held"),
        ("engine_id", "is not 'prefill-0'"),
        ("pulled_twice", "already pulled"),
        ("other_prompt", "not this request's prompt prefix"),
        ("nobody_listens", "ClientConnectorError"),
    ],
    ids=[
        "block ids the prefill engine never gave",
        "an engine id that is not the holder's",
        "blocks a first decode already pulled",
        "blocks of a different prompt",
        "a prefill engine that is gone",
    ],
)
async def test_decode_fails_clearly_when_the_kv_cannot_be_pulled(
    http: aiohttp.ClientSession, engines: StartEngine, spoil: str, reason: str
) -> None:
    p = await engines(engine_id="prefill-0")
    d = await engines()
    params = await prefill(http, p, LONG_PROMPT, "pd-bad")
    prompt = LONG_PROMPT
    if spoil == "block_ids":
        params["remote_block_ids"] = [b + 1000 for b in params["remote_block_ids"]]
    elif spoil == "engine_id":
        params["remote_engine_id"] = "someone-else"
    elif spoil == "pulled_twice":
        assert (await decode(http, d, LONG_PROMPT, params, "pd-bad"))[0] == 200
    elif spoil == "other_prompt":
        prompt = LONG_PROMPT.upper()
    elif spoil == "nobody_listens":
        params["remote_port"] = free_port()
    failed_before = await metric(http, d, "vllm:nixl_num_failed_transfers_total")
    generated_before = await metric(http, d, "vllm:generation_tokens_total")
    status, payload = await decode(http, d, prompt, params, "pd-bad")
    assert status == 500
    message = payload["error"]["message"]
    assert "KV transfer failed" in message and params["remote_engine_id"] in message and reason in message
    assert await metric(http, d, "vllm:nixl_num_failed_transfers_total") == failed_before + 1
    assert await metric(http, d, "vllm:generation_tokens_total") == generated_before, "no output produced"


async def test_held_blocks_expire_after_the_lease(http: aiohttp.ClientSession, engines: StartEngine) -> None:
    p = await engines(kv_lease_s=0.3)
    d = await engines()
    params = await prefill(http, p, LONG_PROMPT, "pd-lease")
    assert await metric(http, p, "vllm:kv_cache_usage_perc") > 0

    async def freed() -> bool:
        return await metric(http, p, "vllm:kv_cache_usage_perc") == 0

    await eventually(freed, timeout=30, what="the lease to end")
    status, payload = await decode(http, d, LONG_PROMPT, params, "pd-lease")
    assert status == 500 and "lease expired" in payload["error"]["message"]


# -- batching, queueing, caching ---------------------------------------------------------------------


async def test_requests_beyond_max_num_seqs_wait_and_then_complete(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    server = await engines(SimTiming(decode_step_s=0.02, max_num_seqs=1, block_size=BLOCK))
    prompts = ["first request", "second request"]
    tasks = [
        asyncio.create_task(post(http, server.url + "/v1/completions", {"prompt": p, "max_tokens": 60}))
        for p in prompts
    ]

    async def one_running_one_waiting() -> bool:
        samples = await scrape(http, server)
        running = value(samples, "vllm:num_requests_running")
        waiting = value(samples, "vllm:num_requests_waiting")
        return (running, waiting) == (1, 1)

    await eventually(one_running_one_waiting, timeout=30, what="one running and one waiting request")
    results = await asyncio.gather(*tasks)
    for prompt, (status, payload, _) in zip(prompts, results, strict=True):
        assert status == 200
        assert payload["choices"][0]["text"] == textgen.expected_text(prompt, 60)
    samples = await scrape(http, server)
    assert value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert value(samples, "vllm:request_queue_time_seconds_count") == 2
    assert value(samples, "vllm:kv_cache_usage_perc") == 0


async def test_kv_capacity_limits_the_batch(http: aiohttp.ClientSession, engines: StartEngine) -> None:
    # Each request needs 4 of the 6 blocks, so only one runs at a time although max_num_seqs is 8.
    server = await engines(SimTiming(decode_step_s=0.02, num_blocks=6, block_size=BLOCK))
    tasks = [
        asyncio.create_task(
            post(http, server.url + "/v1/completions", {"prompt": "y" * 20 + p, "max_tokens": 40})
        )
        for p in "ab"
    ]

    async def queued_for_blocks() -> bool:
        samples = await scrape(http, server)
        return (
            value(samples, "vllm:num_requests_running") == 1
            and value(samples, "vllm:num_requests_waiting") == 1
            and value(samples, "vllm:kv_cache_usage_perc") == pytest.approx(4 / 6)
        )

    await eventually(queued_for_blocks, timeout=30, what="the second request to wait for KV blocks")
    results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == [200, 200]


@TIMINGS
async def test_a_repeated_prompt_hits_the_prefix_cache(
    http: aiohttp.ClientSession, engines: StartEngine, timing: SimTiming
) -> None:
    server = await engines(timing)
    prompt_len = len(textgen.tokenize(LONG_PROMPT))
    full = prompt_len // BLOCK * BLOCK
    body = {"prompt": LONG_PROMPT, "max_tokens": 3}
    assert (await post(http, server.url + "/v1/completions", body))[0] == 200
    first = await scrape(http, server)
    assert value(first, "vllm:prefix_cache_hits_total") == 0
    assert value(first, "vllm:prefix_cache_queries_total") == prompt_len
    status, payload, _ = await post(http, server.url + "/v1/completions", body)
    assert status == 200 and payload["choices"][0]["text"] == textgen.expected_text(LONG_PROMPT, 3)
    second = await scrape(http, server)
    assert value(second, "vllm:prefix_cache_hits_total") == full
    assert value(second, "vllm:prefix_cache_queries_total") == 2 * prompt_len
    assert value(second, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == full
    assert (
        value(second, "vllm:prompt_tokens_by_source_total", source="local_compute") == 2 * prompt_len - full
    )


async def test_a_client_that_leaves_mid_stream_frees_its_slot(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    server = await engines(SimTiming(decode_step_s=0.01, block_size=BLOCK))
    body = {"prompt": "a long story", "max_tokens": 2000, "stream": True}
    async with http.post(server.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        assert await metric(http, server, "vllm:num_requests_running") == 1
        r.close()  # drop the connection mid-stream

    async def aborted() -> bool:
        samples = await scrape(http, server)
        return (
            value(samples, "vllm:num_requests_running") == 0
            and value(samples, "vllm:request_success_total", finished_reason="abort") == 1
            and value(samples, "vllm:kv_cache_usage_perc") == 0
        )

    await eventually(aborted, timeout=30, what="the engine to drop the abandoned request")


async def test_build_app_on_a_foreign_runner_advertises_the_real_port(http: aiohttp.ClientSession) -> None:
    app = build_app(SimEngineConfig(port=0, model=MODEL))
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        server_url = f"http://127.0.0.1:{port}"
        body = {"prompt": LONG_PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, payload, _ = await post(http, server_url + "/v1/completions", body)
        assert status == 200
        assert payload["kv_transfer_params"]["remote_port"] == port
        assert payload["kv_transfer_params"]["remote_engine_id"] == f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("in_handle", [True, False], ids=["vllm-0.32", "no-prefill-figure"])
async def test_the_decode_engine_reports_the_prefills_cache_hits_as_its_own_as_vllm_032_does(
    http: aiohttp.ClientSession, engines: StartEngine, in_handle: bool
) -> None:
    p = await engines(prefill_cache_in_handle=in_handle)
    d = await engines(prompt_tokens_details=True)
    prompt_len = len(textgen.tokenize(LONG_PROMPT))
    full = prompt_len // BLOCK * BLOCK
    await prefill(http, p, LONG_PROMPT, "warm")  # P now holds the prompt's full blocks in its cache
    params = await prefill(http, p, LONG_PROMPT, "pd-2")
    assert params.get("remote_prefill_cached_tokens") == (full if in_handle else None)
    status, payload = await decode(http, d, LONG_PROMPT, params, "pd-2")
    assert status == 200, payload
    # vLLM 0.32's D echoes P's hits; otherwise it reports what it did not compute: the whole prompt.
    cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (full if in_handle else prompt_len)
