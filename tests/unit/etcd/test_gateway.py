"""etcd's JSON gateway on the wire: the answers etcd 3.4 and 3.5 give, decoded (recorded from a real
etcd 3.4.23; the 3.5 stream error shape from its grpc-gateway)."""

from __future__ import annotations

import pytest

from vllm_disagg.etcd.gateway import (
    EtcdError,
    KeyValue,
    WatchCanceled,
    WatchEvent,
    b64,
    error_of,
    key_range,
    key_values,
    parse_answer,
    prefix_end,
    split_lines,
    stream_result,
    watch_events,
)

ENDPOINT = "http://127.0.0.1:2379"
HEADER = (
    '"header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952",'
    '"revision":"7","raft_term":"2"}'
)


@pytest.mark.parametrize(
    ("prefix", "end"),
    [(b"a/", b"a0"), (b"a\xff", b"b"), (b"a\xff\xff", b"b"), (b"\xff", b"\0"), (b"", b"\0")],
    ids=[
        "last-byte-plus-one",
        "trailing-ff-dropped",
        "many-ff-dropped",
        "all-ff-to-the-end",
        "empty-everything",
    ],
)
def test_a_prefix_range_ends_after_its_last_key(prefix: bytes, end: bytes) -> None:
    assert prefix_end(prefix) == end


def test_a_prefix_request_carries_its_range_end_in_base64() -> None:
    assert key_range("a/", prefix=True) == {"key": b64(b"a/"), "range_end": b64(b"a0")}
    assert key_range("a/", prefix=False) == {"key": b64(b"a/")}


def test_a_range_answer_decodes_with_absent_fields_as_zero() -> None:
    raw = (
        "{" + HEADER + ',"kvs":[{"key":"Zm9v","create_revision":"2","mod_revision":"2","version":"1",'
        '"value":"YmFy"},{"key":"YmFy","create_revision":"3","mod_revision":"5","version":"2","value":"",'
        '"lease":"2324035680377304087"}],"count":"2"}'
    )
    answer = parse_answer(200, raw.encode(), endpoint=ENDPOINT, path="/v3/kv/range")
    assert key_values(answer) == [
        KeyValue("bar", b"", 3, 5, 2, 2324035680377304087),
        KeyValue("foo", b"bar", 2, 2, 1, 0),
    ]
    assert key_values({"header": {}}) == []  # nothing found: no "kvs" at all


@pytest.mark.parametrize(
    ("status", "raw", "message", "code"),
    [
        (
            400,
            b'{"error":"etcdserver: too large lease TTL","message":"etcdserver: too large lease TTL",'
            b'"code":11}',
            "too large lease TTL",
            11,
        ),
        (
            404,
            b'{"error":"etcdserver: requested lease not found",'
            b'"message":"etcdserver: requested lease not found","code":5}',
            "requested lease not found",
            5,
        ),
        (
            200,
            b'{"error":{"grpc_code":5,"http_code":404,"message":"etcdserver: requested lease not found",'
            b'"http_status":"Not Found"}}',
            "requested lease not found",
            5,
        ),
        (404, b"Not Found", "HTTP 404: 'Not Found'", 0),
        (200, b'{"kvs": [', "HTTP 200", 0),
        (503, b"{}", "HTTP 503", 0),
    ],
    ids=["3.4-error", "3.4-not-found", "3.5-stream-error", "plain-text-404", "truncated-json", "bare-status"],
)
def test_an_error_answer_raises_etcd_error_with_etcds_message(
    status: int, raw: bytes, message: str, code: int
) -> None:
    with pytest.raises(EtcdError, match=message) as raised:
        parse_answer(status, raw, endpoint=ENDPOINT, path="/v3/lease/revoke")
    assert raised.value.code == code
    assert ENDPOINT in str(raised.value)


def test_a_lease_grant_answer_is_not_mistaken_for_an_error() -> None:
    assert error_of({"ID": "1", "TTL": "5"}) is None
    assert error_of({"ID": "1", "TTL": "5", "error": ""}) is None


def test_watch_messages_decode_puts_deletes_and_progress() -> None:
    created = stream_result(
        b'{"result":{' + HEADER.encode() + b',"created":true}}', endpoint=ENDPOINT, path="w"
    )
    assert watch_events(created, endpoint=ENDPOINT) == []
    line = (
        '{"result":{' + HEADER + ',"events":[{"kv":{"key":"dy9h","create_revision":"6","mod_revision":"6",'
        '"version":"1","value":"eA==","lease":"9"}},{"type":"DELETE","kv":{"key":"dy9h","mod_revision":"7"}}]}}'
    )
    events = watch_events(stream_result(line.encode(), endpoint=ENDPOINT, path="w"), endpoint=ENDPOINT)
    assert events == [
        WatchEvent("put", KeyValue("w/a", b"x", 6, 6, 1, 9)),
        WatchEvent("delete", KeyValue("w/a", b"", 0, 7, 0, 0)),
    ]


def test_a_watch_canceled_for_compaction_says_from_where() -> None:
    line = b'{"result":{"header":{"raft_term":"2"},"canceled":true,"compact_revision":"6"}}'
    with pytest.raises(WatchCanceled, match="revision 6 and older were compacted") as raised:
        watch_events(stream_result(line, endpoint=ENDPOINT, path="w"), endpoint=ENDPOINT)
    assert raised.value.compact_revision == 6


def test_stream_lines_split_across_chunks() -> None:
    lines, rest = split_lines(b'{"a":1}\n\n{"b"')
    assert (lines, rest) == ([b'{"a":1}'], b'{"b"')
    assert split_lines(rest + b":2}\n") == ([b'{"b":2}'], b"")


@pytest.mark.parametrize(
    "answer",
    [{"kvs": "nope"}, {"kvs": [1]}, {"kvs": [{"key": "!!"}]}, {"kvs": [{"key": "YQ==", "version": "x"}]}],
    ids=["kvs-not-a-list", "kv-not-an-object", "key-not-base64", "version-not-a-number"],
)
def test_a_malformed_answer_is_etcd_error(answer: dict[str, object]) -> None:
    with pytest.raises(EtcdError):
        key_values(answer)
