"""What a client may not send: control fields removed from bodies, request ids checked and never keys."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_disagg import jsonutil
from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.gateway.control_fields import CONTROL_FIELDS, strip_control
from vllm_disagg.orchestrator.gateway.parsing import parse_request
from vllm_disagg.orchestrator.gateway.records import RequestLog, RequestRecord
from vllm_disagg.orchestrator.gateway.request_ids import MAX_CLIENT_ID, client_request_id, new_request_id
from vllm_disagg.orchestrator.gateway.tokenize import Tokenizers

KV = {"remote_host": "203.0.113.9", "remote_block_ids": [1, 2], "prompt_token_ids": [1, 2, 3]}


@pytest.mark.parametrize(
    ("body", "removed"),
    [
        pytest.param({"prompt": "p", "max_tokens": 3}, (), id="none-the-body-untouched"),
        pytest.param({"prompt": "p", "kv_transfer_params": KV}, ("kv_transfer_params",), id="kv-handle"),
        pytest.param({"prompt": "p", "kv_transfer_params": None}, ("kv_transfer_params",), id="even-null"),
        pytest.param(
            {"prompt": "p", "request_id": "x", "ec_transfer_params": {}, "kv_transfer_params": KV},
            ("ec_transfer_params", "kv_transfer_params", "request_id"),
            id="all-three",
        ),
        pytest.param(
            {"prompt": "p", "priority": 5, "cache_salt": "s", "session_id": "a", "vllm_xargs": {"k": 1}},
            (),
            id="the-clients-own-fields-stay",
        ),
    ],
)
def test_strip_control_removes_exactly_the_fields_vllm_takes_as_orders(
    body: dict[str, Any], removed: tuple[str, ...]
) -> None:
    kept = {k: v for k, v in body.items() if k not in CONTROL_FIELDS}
    assert strip_control(body) == removed
    assert body == kept


@pytest.mark.parametrize("route", ["completions", "chat_completions"])
def test_parse_request_removes_control_fields_and_pins_and_says_the_body_was_rebuilt(route: Any) -> None:
    prompt: dict[str, Any] = {"prompt": "p"} if route == "completions" else {"messages": [{"content": "p"}]}
    plain = parse_request(jsonutil.dumps({"model": "m", **prompt}), route)
    assert not plain.rebuilt and plain.stripped == ()
    hostile = {"model": "m", **prompt, "kv_transfer_params": KV, "request_id": "r", "decode_endpoint": "d0"}
    parsed = parse_request(jsonutil.dumps(hostile), route)
    assert parsed.rebuilt and parsed.stripped == ("kv_transfer_params", "request_id")
    assert parsed.body == {"model": "m", **prompt} and parsed.pinned_decode == "d0"


def test_a_clients_prompt_token_ids_never_replace_the_prompt_the_gateway_tokenizes() -> None:
    tokenizers = Tokenizers()
    tokenizers.register("m", "sim", "")
    try:
        messages = [{"role": "user", "content": "what the engine really runs"}]
        honest = parse_request(jsonutil.dumps({"model": "m", "messages": messages}), "chat_completions")
        forged = {"model": "m", "messages": messages, "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}}
        parsed = parse_request(jsonutil.dumps(forged), "chat_completions")
        want = tokenizers.tokenize("m", "chat_completions", honest.body)
        assert want is not None and want != [1, 2, 3]
        assert tokenizers.tokenize("m", "chat_completions", parsed.body) == want
    finally:
        tokenizers.close()


@pytest.mark.parametrize(
    ("value", "want"),
    [
        pytest.param(None, "", id="none-sent"),
        pytest.param("", "", id="empty-as-none"),
        pytest.param("req-42 from proxy/a:b", "req-42 from proxy/a:b", id="printable-ascii-kept"),
        pytest.param("x" * MAX_CLIENT_ID, "x" * MAX_CLIENT_ID, id="at-the-cap"),
        pytest.param("x" * (MAX_CLIENT_ID + 1), BadRequest, id="over-the-cap-refused-not-cut"),
        pytest.param("caf\u00e9", BadRequest, id="non-ascii-refused"),
        pytest.param("a\tb", BadRequest, id="a-tab-refused"),
        pytest.param("a\x7fb", BadRequest, id="del-refused"),
    ],
)
def test_client_request_id(value: str | None, want: str | type[BadRequest]) -> None:
    if isinstance(want, str):
        assert client_request_id(value) == want
    else:
        with pytest.raises(want, match="X-Request-Id"):
            client_request_id(value)


def test_new_request_ids_are_fresh_hex() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def _record(request_id: str, client: str) -> RequestRecord:
    return RequestRecord(
        request_id, "completions", "m", "colocated", None, "d", 200, "", 0.0, 0.0, None, 0.1, 0.2,
        client_request_id=client,
    )  # fmt: skip


def test_records_with_one_client_id_are_all_kept_and_that_id_finds_the_newest() -> None:
    log = RequestLog(capacity=3)
    first, second = _record("g1", "shared"), _record("g2", "shared")
    log.add(first)
    log.add(second)
    assert (log.get("g1"), log.get("g2")) == (first, second), "neither overwrote the other"
    assert log.get("shared") is second, "by client id: the newest"
    log.add(_record("g3", "g1"))  # a client id that is another request's gateway id
    assert log.get("g1") is first, "a gateway id wins"


def test_a_client_id_is_forgotten_with_its_newest_record_only() -> None:
    log = RequestLog(capacity=2)
    log.add(_record("g1", "a"))
    log.add(_record("g2", "a"))
    log.add(_record("g3", "b"))  # g1 leaves: "a" still finds g2
    assert log.get("a") is log.get("g2")
    log.add(_record("g4", ""))  # g2 leaves: "a" is gone
    assert log.get("a") is None and log.get("b") is log.get("g3")
