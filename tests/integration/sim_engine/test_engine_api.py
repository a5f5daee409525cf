"""The simulated engine's API on real loopback ports: vLLM's exact bytes, ids, resume, bad input."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.integration.sim_support import (
    BLOCK,
    LONG_PROMPT,
    MODEL,
    TIMINGS,
    StartEngine,
    post,
    sse_events,
)
from vllm_disagg import jsonutil
from vllm_disagg.config import SimTiming
from vllm_disagg.sim_engine import textgen
from vllm_disagg.sim_engine.openai_api import DONE, Kind, ResponseEncoder

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say something."}]
PLAIN: dict[str, Any] = {}
USAGE = {"stream_options": {"include_usage": True}}
IDS = {"return_token_ids": True}
RUNNING = {
    "return_token_ids": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


async def post_raw(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, bytes, Mapping[str, str]]:
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with http.post(url, data=jsonutil.dumps(body), headers=hdrs) as r:
        return r.status, await r.read(), CIMultiDict(r.headers)


def _created(raw: bytes) -> int:
    created: int = jsonutil.loads(raw.removeprefix(b"data: ").split(b"\n\n", 1)[0])["created"]
    return created


@TIMINGS
@pytest.mark.parametrize(
    ("kind", "stream", "options"),
    [
        ("completion", False, PLAIN),
        ("completion", False, IDS),
        ("completion", True, PLAIN),
        ("completion", True, USAGE),
        ("completion", True, IDS),
        ("completion", True, RUNNING),
        ("chat", False, PLAIN),
        ("chat", False, IDS),
        ("chat", True, PLAIN),
        ("chat", True, USAGE),
        ("chat", True, IDS),
        ("chat", True, RUNNING),
    ],
    ids=[
        "completion: one JSON body",
        "completion: a body with prompt and output ids",
        "completion: one SSE chunk per token",
        "completion: SSE with a usage chunk",
        "completion: SSE with prompt ids first and each token's id",
        "completion: SSE with running usage and ids",
        "chat: one JSON body with the assistant message",
        "chat: a body with prompt and output ids",
        "chat: role chunk then one chunk per token",
        "chat: SSE with a usage chunk",
        "chat: SSE with prompt ids in the role chunk and each token's id",
        "chat: SSE with running usage and ids",
    ],
)
async def test_answers_are_vllms_bytes_around_the_deterministic_output(
    http: aiohttp.ClientSession,
    engines: StartEngine,
    timing: SimTiming,
    kind: Kind,
    stream: bool,
    options: dict[str, Any],
) -> None:
    # ResponseEncoder is checked byte for byte against captured vLLM 0.32 answers in
    # tests/unit/sim_engine/test_textgen.py.
    server = await engines(timing)
    n = 7
    body: dict[str, Any] = {"model": MODEL, "max_tokens": n, "stream": stream, "temperature": 0.7, **options}
    if kind == "completion":
        path, body["prompt"], prompt = "/v1/completions", LONG_PROMPT, LONG_PROMPT
    else:
        path, body["messages"], prompt = "/v1/chat/completions", CHAT, textgen.apply_chat_template(CHAT)
    status, raw, headers = await post_raw(http, server.url + path, body, {"X-Request-Id": "req-42"})
    assert status == 200 and headers["X-Request-Id"] == "req-42"
    prompt_ids = textgen.tokenize(prompt)
    ids = textgen.output_token_ids(prompt_ids, n)
    usage = options.get("stream_options", {})
    enc = ResponseEncoder(
        kind, "req-42", MODEL, _created(raw),
        return_token_ids=bool(options.get("return_token_ids")),
        include_usage=bool(usage.get("include_usage")),
        continuous_usage=bool(usage.get("continuous_usage_stats")),
        prompt_token_ids=prompt_ids,
    )  # fmt: skip
    if not stream:
        assert raw == enc.full(textgen.expected_text(prompt, n), len(prompt_ids), n, None, token_ids=ids)
        return
    assert headers["Content-Type"].startswith("text/event-stream")
    words = [jsonutil.dumps(textgen.token_text(t)) for t in ids]
    chunks = [enc.token_chunk(w, i == n - 1, i, t) for i, (w, t) in enumerate(zip(words, ids, strict=True))]
    tail = [enc.usage_chunk(len(prompt_ids), n)] if enc.include_usage else []
    assert raw == b"".join([enc.role_chunk(), *chunks, *tail, DONE])


def token_events(text: str) -> tuple[list[int] | None, list[tuple[str, list[int], str | None]]]:
    """A return_token_ids stream's prompt ids and its token chunks as (text, token ids, finish reason)."""
    events = sse_events(text)
    assert events.pop() == "[DONE]"
    if "delta" in events[0]["choices"][0]:  # chat: the role chunk carries the prompt ids
        role = events.pop(0)
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        prompt_ids = role["prompt_token_ids"]
    else:
        prompt_ids = events[0]["choices"][0]["prompt_token_ids"]
        assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:]), "only the first chunk"
    out = []
    for e in events:
        choice = e["choices"][0]
        text = choice["delta"]["content"] if "delta" in choice else choice["text"]
        out.append((text, choice["token_ids"], choice["finish_reason"]))
    return prompt_ids, out


@TIMINGS
@pytest.mark.parametrize(
    ("kind", "resume_as"),
    [("completion", "prompt"), ("chat", "prompt"), ("chat", "kv_transfer_params")],
    ids=[
        "a completion resumed from its ids",
        "a chat resumed as a completion from its templated ids",
        "a chat resumed as a chat with kv_transfer_params.prompt_token_ids",
    ],
)
async def test_a_request_resumed_from_prompt_ids_plus_k_output_ids_streams_exactly_the_rest(
    http: aiohttp.ClientSession, engines: StartEngine, timing: SimTiming, kind: Kind, resume_as: str
) -> None:
    server = await engines(timing)
    n = 9
    base: dict[str, Any] = {"model": MODEL, "stream": True, "return_token_ids": True}
    first: dict[str, Any]
    if kind == "completion":
        path, first, prompt = "/v1/completions", {"prompt": LONG_PROMPT}, LONG_PROMPT
    else:
        path, first, prompt = "/v1/chat/completions", {"messages": CHAT}, textgen.apply_chat_template(CHAT)
    status, text, _ = await post(http, server.url + path, {**base, **first, "max_tokens": n})
    assert status == 200
    prompt_ids, original = token_events(text)
    assert prompt_ids == textgen.tokenize(prompt)
    assert [ids for _, ids, _ in original] == [[t] for t in textgen.output_token_ids(prompt, n)]
    assert "".join(t for t, _, _ in original) == textgen.expected_text(prompt, n)
    for k in (1, 4, n - 1):
        context = prompt_ids + [t for _, ids, _ in original[:k] for t in ids]
        if resume_as == "prompt":
            again = {**base, "prompt": context, "max_tokens": n - k}
            status, text, _ = await post(http, server.url + "/v1/completions", again)
        else:
            again = {
                **base,
                **first,
                "max_tokens": n - k,
                "kv_transfer_params": {"prompt_token_ids": context},
            }
            status, text, _ = await post(http, server.url + path, again)
        assert status == 200
        resumed_prompt, resumed = token_events(text)
        assert (resumed_prompt, resumed) == (context, original[k:]), f"resumed after {k} tokens"


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


@pytest.mark.parametrize(
    ("header", "body_id", "want"),
    [(None, None, None), (None, "from-body", "from-body"), ("from-header", "from-body", "from-header")],
    ids=[
        "no id given: 16 fresh hex digits, as vLLM's random_uuid",
        "the body's request_id without a header",
        "the X-Request-Id header wins over the body",
    ],
)
async def test_the_response_id_comes_from_the_header_then_the_body(
    http: aiohttp.ClientSession,
    engines: StartEngine,
    header: str | None,
    body_id: str | None,
    want: str | None,
) -> None:
    server = await engines()
    body = {"prompt": "x", "max_tokens": 1, "request_id": body_id}
    headers = {"X-Request-Id": header} if header else {}
    _, a, ha = await post(http, server.url + "/v1/completions", body, headers)
    _, b, _ = await post(http, server.url + "/v1/chat/completions", {**body, "messages": CHAT}, headers)
    assert a["id"] == "cmpl-" + ha["X-Request-Id"], "the id is echoed in the header"
    ids = a["id"].removeprefix("cmpl-"), b["id"].removeprefix("chatcmpl-")
    if want is None:
        assert all(re.fullmatch("[0-9a-f]{16}", i) for i in ids) and ids[0] != ids[1]
    else:
        assert ids == (want, want)


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
        'vllm:nixl_bytes_transferred_bucket{engine="0",le="2.097152e+06",model_name="sim-model"}',
        'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.005",model_name="sim-model"}',
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
        (
            "/v1/completions",
            {"prompt": [1, 320]},
            400,
            "BadRequestError",
            "Token id 320 is out of vocabulary",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "kv_transfer_params": {"prompt_token_ids": []}},
            400,
            "BadRequestError",
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list",
        ),
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
        "token ids beyond the vocabulary (256 bytes + 64 words) are refused, as vLLM does",
        "chat's reused prompt ids must be a non-empty id list",
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
