"""What a relay reads of one stream event: from the JSON's structure, whatever its spelling, and what
counts as content a client must get (only an event without it may ever be dropped)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_disagg.wire.stream_chunk import StreamChunk, is_error, read_chunk


def completion(text: str, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{**choice, **fields}],
    }


def chat(delta: dict[str, Any], finish: str | None = None, **fields: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": "c-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{**choice, **fields}],
    }


@pytest.mark.parametrize(
    ("obj", "is_chat", "text", "content", "finished"),
    [
        pytest.param(completion(" wh", token_ids=[573]), False, True, True, False, id="completion-text"),
        pytest.param(completion("", token_ids=[244]), False, False, False, False, id="completion-held-bytes"),
        pytest.param(completion("", "length"), False, False, True, True, id="completion-bare-finish"),
        pytest.param(chat({"content": "hi"}), True, True, True, False, id="chat-content"),
        pytest.param(chat({}, token_ids=[7]), True, False, False, False, id="chat-ids-only"),
        pytest.param(chat({"content": ""}), True, False, False, False, id="chat-empty-content"),
        pytest.param(chat({"reasoning_content": "hm"}), True, True, True, False, id="chat-reasoning"),
        pytest.param(chat({"tool_calls": [{"index": 0}]}), True, False, True, False, id="chat-tool-call"),
        pytest.param(chat({"role": "assistant", "content": ""}), True, False, False, False, id="chat-role"),
        pytest.param(chat({"content": "x", "novel": 1}), True, True, True, False, id="chat-unknown-field"),
        pytest.param(completion("", x_vendor={"a": 1}), False, False, True, False, id="unknown-choice-field"),
        pytest.param(completion("", logprobs={"tokens": ["a"]}), False, False, True, False, id="logprobs"),
    ],
)
def test_content_is_what_a_client_reads_beyond_bookkeeping_and_ids(
    obj: dict[str, Any], is_chat: bool, text: bool, content: bool, finished: bool
) -> None:
    chunk = read_chunk(obj, chat=is_chat)
    assert chunk is not None
    assert (chunk.text, chunk.content, chunk.finished) == (text, content, finished)


def test_ids_are_read_where_each_route_puts_them() -> None:
    first = completion("a", prompt_token_ids=[1, 2], token_ids=[3])
    chunk = read_chunk(first, chat=False)
    assert chunk is not None and (chunk.prompt_ids, chunk.ids) == ([1, 2], [3])
    role = {**chat({"role": "assistant", "content": ""}), "prompt_token_ids": [4, 5]}
    chunk = read_chunk(role, chat=True)
    assert chunk is not None and (chunk.prompt_ids, chunk.ids, chunk.role) == ([4, 5], None, True)


@pytest.mark.parametrize(
    "ids", [None, [], [1, True], ["1"], [1.0], {"0": 1}], ids=["null", "empty", "bool", "str", "float", "map"]
)
def test_ids_that_are_not_a_list_of_ints_are_no_ids(ids: Any) -> None:
    chunk = read_chunk(completion("a", token_ids=ids), chat=False)
    assert chunk is not None and not chunk.ids


def test_spelling_does_not_change_the_reading() -> None:
    obj = completion(" café", "length", token_ids=[1, 2], prompt_token_ids=[9])
    obj["usage"] = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    spaced = json.loads(json.dumps(obj, indent=2, ensure_ascii=True))
    reordered = json.loads(json.dumps(dict(reversed(list(obj.items())))))
    first, *others = (read_chunk(o, chat=False) for o in (obj, spaced, reordered))
    assert first is not None and all(other == first for other in others)


def test_a_usage_chunk_has_no_choices_and_its_usage_is_content() -> None:
    chunk = read_chunk({"id": "x", "choices": [], "usage": {"prompt_tokens": 4}}, chat=False)
    assert chunk == StreamChunk(0, False, None, None, False, True, False, {"prompt_tokens": 4})


@pytest.mark.parametrize(
    "obj",
    [{"id": "x"}, {"choices": "no"}, {"choices": [1]}, {"choices": None}],
    ids=["no-choices", "choices-not-a-list", "a-choice-not-an-object", "null-choices"],
)
def test_what_is_not_a_chunk_is_not_read_as_one(obj: dict[str, Any]) -> None:
    assert read_chunk(obj, chat=False) is None


@pytest.mark.parametrize(
    ("obj", "error"),
    [
        pytest.param({"error": {"message": "EngineCore died", "code": 500}}, True, id="vllm"),
        pytest.param({"object": "error", "message": "boom", "code": 500}, True, id="object-error"),
        pytest.param({"choices": [], "error": None}, False, id="a-chunk-with-an-error-field"),
    ],
)
def test_error_events_are_told_from_chunks(obj: dict[str, Any], error: bool) -> None:
    assert is_error(obj) is error
