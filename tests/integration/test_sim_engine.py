"""The simulated vLLM engine on real loopback ports: API shapes, P/D handoff, batching, metrics, CLI."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import eventually, free_port
from vllm_disagg import jsonutil
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.sim import textgen
from vllm_disagg.sim.engine import SimServer, build_app, start_engine

MODEL = "sim-model"
BLOCK = 16
LONG_PROMPT = "The quick brown fox jumps over the lazy dog; " * 2 + "and then?"  # 99 tokens: 6 full blocks
STEPPED = SimTiming(decode_step_s=0.002, prefill_s_per_token=0.00001, block_size=BLOCK)
ZERO = SimTiming(block_size=BLOCK)
TIMINGS = pytest.mark.parametrize("timing", [ZERO, STEPPED], ids=["zero-delay", "stepped"])

StartEngine = Callable[..., Awaitable[SimServer]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def engines() -> AsyncIterator[StartEngine]:
    """Start engines on free ports (``start(timing=..., **config)``); all are closed at the end."""
    started: list[SimServer] = []

    async def start(timing: SimTiming = ZERO, **kwargs: Any) -> SimServer:
        server = await start_engine(SimEngineConfig(port=0, model=MODEL, timing=timing, **kwargs))
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, Mapping[str, str]]:
    data = body if isinstance(body, bytes) else jsonutil.dumps(body)
    async with http.post(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        raw = await r.read()
        ctype = r.headers.get("Content-Type", "")
        payload: Any = raw.decode() if ctype.startswith("text/event-stream") else jsonutil.loads(raw)
        return r.status, payload, CIMultiDict(r.headers)


def sse_events(text: str) -> list[Any]:
    """Each ``data:`` event of an SSE body, JSON-decoded, with ``[DONE]`` kept as the string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else jsonutil.loads(data))
    return events


async def scrape(http: aiohttp.ClientSession, server: SimServer) -> dict[tuple[str, frozenset[Any]], float]:
    async with http.get(server.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[tuple[str, frozenset[Any]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels`` (plus the engine's own labels)."""
    want = {("model_name", MODEL), ("engine", "0"), *labels.items()}
    hits = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


async def metric(http: aiohttp.ClientSession, server: SimServer, name: str, **labels: str) -> float:
    return value(await scrape(http, server), name, **labels)


# -- output and API shapes ---------------------------------------------------------------------

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say something."}]
SHAPES = [
    ("completion", False, False),
    ("completion", True, False),
    ("completion", True, True),
    ("chat", False, False),
    ("chat", True, False),
    ("chat", True, True),
]


@TIMINGS
@pytest.mark.parametrize(
    ("kind", "stream", "usage"),
    SHAPES,
    ids=[
        "completion: one JSON body",
        "completion: one SSE chunk per token",
        "completion: SSE with a usage chunk",
        "chat: one JSON body with the assistant message",
        "chat: role chunk then one chunk per token",
        "chat: SSE with a usage chunk",
    ],
)
async def test_output_is_exactly_the_deterministic_text(
    http: aiohttp.ClientSession, engines: StartEngine, timing: SimTiming, kind: str, stream: bool, usage: bool
) -> None:
    server = await engines(timing)
    n = 7
    body: dict[str, Any] = {"model": MODEL, "max_tokens": n, "stream": stream, "temperature": 0.7}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if kind == "completion":
        body["prompt"] = LONG_PROMPT
        path, expected = "/v1/completions", textgen.expected_text(LONG_PROMPT, n)
        prompt_tokens = len(textgen.tokenize(LONG_PROMPT))
    else:
        body["messages"] = CHAT
        path, expected = "/v1/chat/completions", textgen.expected_chat_text(CHAT, n)
        prompt_tokens = len(textgen.tokenize(textgen.apply_chat_template(CHAT)))
    status, payload, headers = await post(http, server.url + path, body, {"X-Request-Id": "req-42"})
    assert status == 200
    assert headers["X-Request-Id"] == "req-42"
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    if not stream:
        assert payload["id"] == prefix + "req-42"
        assert payload["object"] == ("text_completion" if kind == "completion" else "chat.completion")
        assert payload["model"] == MODEL and isinstance(payload["created"], int)
        choice = payload["choices"][0]
        text = choice["text"] if kind == "completion" else choice["message"]["content"]
        if kind == "chat":
            assert choice["message"]["role"] == "assistant"
        assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
        assert text == expected
        assert payload["usage"]["prompt_tokens"] == prompt_tokens
        assert payload["usage"]["completion_tokens"] == n
        assert payload["usage"]["total_tokens"] == prompt_tokens + n
        assert payload["kv_transfer_params"] is None
        return
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(payload)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    if usage:
        final = chunks.pop()
        assert final["choices"] == []
        assert final["usage"]["prompt_tokens"] == prompt_tokens
        assert final["usage"]["completion_tokens"] == n
    assert all(c["id"] == prefix + "req-42" and c["model"] == MODEL for c in chunks)
    if kind == "chat":
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
        deltas = [c["choices"][0]["delta"]["content"] for c in chunks]
    else:
        assert all(c["object"] == "text_completion" for c in chunks)
        deltas = [c["choices"][0]["text"] for c in chunks]
    assert len(chunks) == n, "one chunk per token"
    assert "".join(deltas) == expected
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None] * (n - 1) + ["length"], "only the last content chunk finishes"
    assert all("usage" not in c for c in chunks)


async def test_token_id_prompt_answers_like_its_text(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    server = await engines()
    ids = textgen.tokenize("hello there")
    _, by_ids, _ = await post(http, server.url + "/v1/completions", {"prompt": ids, "max_tokens": 4})
    _, by_text, _ = await post(
        http, server.url + "/v1/completions", {"prompt": "hello there", "max_tokens": 4}
    )
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"] == textgen.expected_text(ids, 4)


@pytest.mark.parametrize(
    ("path", "body", "max_tokens"),
    [
        ("/v1/completions", {"prompt": "hi"}, 5),
        ("/v1/chat/completions", {"messages": CHAT}, 5),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 9}, 9),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 3}, 3),
    ],
    ids=[
        "completions default to default_max_tokens",
        "chat defaults to default_max_tokens",
        "chat honours max_tokens",
        "chat prefers max_completion_tokens",
    ],
)
async def test_max_tokens_defaults_and_aliases(
    http: aiohttp.ClientSession, engines: StartEngine, path: str, body: dict[str, Any], max_tokens: int
) -> None:
    server = await engines(default_max_tokens=5)
    status, payload, _ = await post(http, server.url + path, body)
    assert status == 200
    assert payload["usage"]["completion_tokens"] == max_tokens


async def test_request_without_id_header_gets_a_fresh_one(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    server = await engines()
    _, a, ha = await post(http, server.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
    _, _, hb = await post(http, server.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert ha["X-Request-Id"] != hb["X-Request-Id"]
    assert a["id"] == "cmpl-" + ha["X-Request-Id"]


async def test_info_endpoints(http: aiohttp.ClientSession, engines: StartEngine) -> None:
    server = await engines(max_model_len=2048)
    async with http.get(server.url + "/health") as r:
        assert (r.status, await r.read()) == (200, b"")
    async with http.get(server.url + "/version") as r:
        assert await r.json() == {"version": "0.32.0+sim"}
    async with http.get(server.url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL, "model", 2048)]
    async with http.get(server.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_bytes_transferred_total",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim-model",source="local_compute"}',
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-model"}',
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        'vllm:request_params_max_tokens_bucket{engine="0",le="1.0",model_name="sim-model"}',
    ):
        assert name in text, name


# -- bad input -----------------------------------------------------------------------------------

TOO_LONG = "x" * 120


@pytest.mark.parametrize(
    ("path", "body", "status", "err_type", "message"),
    [
        ("/v1/completions", b"{not json", 400, "BadRequestError", "malformed JSON"),
        ("/v1/completions", b"[1, 2]", 400, "BadRequestError", "JSON object"),
        (
            "/v1/completions",
            {"model": "other", "prompt": "hi"},
            404,
            "NotFoundError",
            "`other` does not exist",
        ),
        (
            "/v1/chat/completions",
            {"model": "other", "messages": CHAT},
            404,
            "NotFoundError",
            "does not exist",
        ),
        ("/v1/completions", {"model": MODEL}, 400, "BadRequestError", "'prompt' is required"),
        ("/v1/completions", {"prompt": ""}, 400, "BadRequestError", "empty"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "BadRequestError", "batched"),
        ("/v1/completions", {"prompt": [1, -2]}, 400, "BadRequestError", "token ids"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "BadRequestError", "'messages' is required"),
        ("/v1/chat/completions", {"messages": []}, 400, "BadRequestError", "non-empty"),
        ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 9}, 400, "BadRequestError", "maximum context"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "BadRequestError", "at least 1"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}, 400, "BadRequestError", "wrong type"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "BadRequestError",
            "stream=True",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}},
            400,
            "BadRequestError",
            "remote_host",
        ),
    ],
    ids=[
        "malformed JSON is a 400",
        "a body that is not an object is a 400",
        "an unknown model is a 404 in vLLM's shape",
        "chat with an unknown model is a 404",
        "a completion without prompt is a 400",
        "an empty prompt is a 400",
        "a batch of prompts is refused",
        "negative token ids are refused",
        "a chat without messages is a 400",
        "an empty message list is a 400",
        "prompt plus max_tokens beyond max_model_len is a 400",
        "max_tokens below 1 is a 400",
        "a mistyped field is a 400",
        "stream_options without stream is a 400",
        "remote prefill params without a host are a 400",
    ],
)
async def test_bad_requests_are_refused_and_the_server_stays_up(
    http: aiohttp.ClientSession,
    engines: StartEngine,
    path: str,
    body: Any,
    status: int,
    err_type: str,
    message: str,
) -> None:
    server = await engines(max_model_len=128)
    got, payload, _ = await post(http, server.url + path, body)
    assert got == status
    error = payload["error"]
    assert (error["type"], error["code"]) == (err_type, status)
    assert message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    ok, answer, _ = await post(http, server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok == 200 and answer["choices"][0]["text"] == textgen.expected_text("hi", 2)


async def test_a_request_larger_than_the_whole_kv_cache_is_refused(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    server = await engines(SimTiming(num_blocks=2, block_size=BLOCK))
    status, payload, _ = await post(
        http, server.url + "/v1/completions", {"prompt": "x" * 30, "max_tokens": 5}
    )
    assert status == 400 and "KV cache" in payload["error"]["message"]


# -- prefill/decode handoff ------------------------------------------------------------------------


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
async def test_prefill_then_decode_moves_the_full_blocks_and_answers_like_colocated(
    http: aiohttp.ClientSession, engines: StartEngine, timing: SimTiming
) -> None:
    p = await engines(timing, engine_id="prefill-0")
    d = await engines(timing)
    prompt_len = len(textgen.tokenize(LONG_PROMPT))
    full = prompt_len // BLOCK * BLOCK
    params = await prefill(http, p, LONG_PROMPT, "pd-1")
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == prompt_len // BLOCK
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

    assert grew("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == full
    assert grew("vllm:prompt_tokens_by_source_total", source="local_compute") == prompt_len - full
    assert grew("vllm:nixl_bytes_transferred_total") == 4 * full
    assert value(after, "vllm:nixl_num_failed_transfers_total") == 0
    assert value(after, "vllm:request_params_max_tokens_bucket", le="1.0") == 0, "the decode leg ran on D"
    assert await metric(http, p, "vllm:kv_cache_usage_perc") == 0, "a pull frees the held blocks"
    assert await metric(http, p, "vllm:sim_kv_pulls_served_total") == prompt_len // BLOCK


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


async def test_a_prompt_without_a_full_block_hands_over_no_blocks(
    http: aiohttp.ClientSession, engines: StartEngine
) -> None:
    p, d = await engines(), await engines()
    params = await prefill(http, p, "short", "pd-short")
    assert params["remote_block_ids"] == []
    before = await metric(http, d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    status, payload = await decode(http, d, "short", params, "pd-short", max_tokens=3)
    assert status == 200 and payload["choices"][0]["text"] == textgen.expected_text("short", 3)
    after = await metric(http, d, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert after - before == len("short")
    assert await metric(http, d, "vllm:nixl_num_failed_transfers_total") == 0


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
