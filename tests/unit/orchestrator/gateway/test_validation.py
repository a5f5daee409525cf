"""Gateway request validation and the handoff bodies, as pure functions."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.gateway.handoff import decode_body, prefill_body
from vllm_disagg.orchestrator.gateway.parsing import Route, parse_request
from vllm_disagg.orchestrator.gateway.records import RequestLog, RequestRecord

OK_COMPLETION = {"model": "m", "prompt": "hello"}
OK_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("route", "raw", "param", "fragment"),
    [
        pytest.param("completions", b"{not json", None, "not valid JSON", id="malformed-json"),
        pytest.param("completions", b"", None, "not valid JSON", id="empty-body"),
        pytest.param("completions", b"[1, 2]", None, "JSON object", id="array-body-is-not-an-object"),
        pytest.param("completions", b'"text"', None, "JSON object", id="string-body-is-not-an-object"),
        pytest.param("completions", b'{"prompt": "x"}', "model", "'model'", id="missing-model"),
        pytest.param("completions", b'{"model": "", "prompt": "x"}', "model", "'model'", id="empty-model"),
        pytest.param(
            "completions", b'{"model": 3, "prompt": "x"}', "model", "'model'", id="model-not-a-string"
        ),
        pytest.param("completions", b'{"model": "m"}', "prompt", "'prompt' is required", id="missing-prompt"),
        pytest.param(
            "completions", b'{"model": "m", "prompt": 5}', "prompt", "'prompt'", id="prompt-not-text"
        ),
        pytest.param(
            "completions", b'{"model": "m", "prompt": []}', "prompt", "'prompt'", id="empty-prompt-list"
        ),
        pytest.param(
            "chat_completions", b'{"model": "m"}', "messages", "'messages' is required", id="missing-messages"
        ),
        pytest.param(
            "chat_completions",
            b'{"model": "m", "messages": []}',
            "messages",
            "non-empty",
            id="empty-messages",
        ),
        pytest.param(
            "chat_completions",
            b'{"model": "m", "messages": "hi"}',
            "messages",
            "non-empty list",
            id="messages-not-list",
        ),
        pytest.param(
            "chat_completions",
            b'{"model": "m", "messages": ["hi"]}',
            "messages",
            "object",
            id="message-not-an-object",
        ),
        pytest.param(
            "completions",
            b'{"model": "m", "prompt": "x", "stream": "yes"}',
            "stream",
            "boolean",
            id="stream-not-bool",
        ),
        pytest.param(
            "completions",
            b'{"model": "m", "prompt": "x", "max_tokens": 0}',
            "max_tokens",
            ">= 1",
            id="max-tokens-zero",
        ),
        pytest.param(
            "completions",
            b'{"model": "m", "prompt": "x", "max_tokens": 1.5}',
            "max_tokens",
            ">= 1",
            id="max-tokens-float",
        ),
        pytest.param(
            "completions",
            b'{"model": "m", "prompt": "x", "max_tokens": true}',
            "max_tokens",
            ">= 1",
            id="max-tokens-bool",
        ),
        pytest.param(
            "chat_completions",
            b'{"model": "m", "messages": [{}], "max_completion_tokens": -1}',
            "max_completion_tokens",
            ">= 1",
            id="max-completion-tokens-negative",
        ),
    ],
)
def test_bad_requests_are_refused_with_a_reason(
    route: Route, raw: bytes, param: str | None, fragment: str
) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(raw, route)
    assert info.value.param == param
    assert fragment in info.value.message
    body = info.value.to_json()["error"]
    assert isinstance(body, dict)
    assert body["code"] == 400


@pytest.mark.parametrize(
    ("route", "body", "stream"),
    [
        pytest.param("completions", OK_COMPLETION, False, id="completion-text-prompt"),
        pytest.param("completions", {"model": "m", "prompt": [1, 2, 3]}, False, id="completion-token-prompt"),
        pytest.param("completions", {**OK_COMPLETION, "stream": True}, True, id="completion-stream"),
        pytest.param(
            "completions", {**OK_COMPLETION, "stream": None, "max_tokens": None}, False, id="nulls-allowed"
        ),
        pytest.param("chat_completions", OK_CHAT, False, id="chat"),
        pytest.param(
            "chat_completions", {**OK_CHAT, "stream": True, "max_tokens": 4}, True, id="chat-stream"
        ),
    ],
)
def test_good_requests_parse(route: Route, body: dict[str, Any], stream: bool) -> None:
    parsed = parse_request(orjson.dumps(body), route)
    assert parsed.model == "m"
    assert parsed.stream is stream
    assert parsed.body == body
    assert parsed.prompt_len >= 1


def test_prompt_length_estimate_grows_with_the_prompt() -> None:
    short = parse_request(orjson.dumps({"model": "m", "prompt": "x" * 10}), "completions")
    long = parse_request(orjson.dumps({"model": "m", "prompt": "x" * 1000}), "completions")
    assert long.prompt_len > short.prompt_len


def test_prefill_body_asks_for_one_token_without_stream_and_with_remote_decode() -> None:
    client = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    body = orjson.loads(prefill_body(client))
    assert body == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.0,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert client["max_tokens"] == 50 and client["stream"] is True, "the client's body is not changed"


def test_prefill_body_adds_no_max_completion_tokens_the_client_did_not_send() -> None:
    body = orjson.loads(prefill_body({"model": "m", "prompt": "p"}))
    assert body["max_tokens"] == 1
    assert "max_completion_tokens" not in body


def test_decode_body_carries_the_prefill_kv_params_unchanged() -> None:
    kv = {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "e",
        "tp_size": 1,
        "x": {"y": None},
    }
    body = orjson.loads(decode_body({"model": "m", "prompt": "p", "stream": True, "max_tokens": 9}, kv))
    assert body == {"model": "m", "prompt": "p", "stream": True, "max_tokens": 9, "kv_transfer_params": kv}


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id, "completions", "m", "colocated", None, "d", 200, "", 0.0, 0.0, None, 0.1, 0.2
    )


def test_request_log_keeps_the_newest_records_up_to_capacity() -> None:
    log = RequestLog(capacity=3)
    for i in range(5):
        log.add(_record(f"r{i}"))
    assert len(log) == 3
    assert log.get("r0") is None and log.get("r1") is None
    assert [r.request_id for r in log.recent(10)] == ["r4", "r3", "r2"]
    assert [r.request_id for r in log.recent(1)] == ["r4"]


def test_with_a_store_connector_neither_leg_carries_kv_transfer_params() -> None:
    # The prefill engine saves every prompt to the store; the decode engine finds it there.
    client = {"model": "m", "prompt": "p", "max_tokens": 5, "kv_transfer_params": {"x": 1}}
    assert "kv_transfer_params" not in orjson.loads(prefill_body(client, "store"))
    assert "kv_transfer_params" in orjson.loads(prefill_body(client, "params"))
    assert "kv_transfer_params" not in orjson.loads(decode_body(dict(client), {}))
    assert orjson.loads(decode_body(dict(client), {"h": 1}))["kv_transfer_params"] == {"h": 1}
