"""Server-sent events as engines and proxies write them: every spelling the spec allows is framed and
read alike, however the bytes are chunked."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_disagg.wire.sse import EventFramer, data_of, with_data

STREAM = b'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\n\nid: 7\nevent: x\ndata:[DONE]\n\n'
EVENTS = [b'data: {"a":1}', b": keep-alive", b'data: {"b":\ndata: 2}', b"id: 7\nevent: x\ndata:[DONE]"]


def frame(parts: list[bytes]) -> list[bytes]:
    framer = EventFramer()
    out = b"".join(framer.feed(p) for p in parts)
    assert not framer.partial
    return out.split(b"\n\n")[:-1]


@pytest.mark.parametrize(
    "line_end", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr-alone-as-the-spec-allows"]
)
@given(cuts=st.lists(st.integers(0, 200), max_size=8))
def test_events_come_out_whole_with_lf_line_ends_whatever_the_chunking(
    line_end: bytes, cuts: list[int]
) -> None:
    data = STREAM.replace(b"\n", line_end)
    points = sorted({c % len(data) for c in cuts} - {0})
    parts = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert frame(parts) == EVENTS


def test_a_crlf_split_between_chunks_is_one_line_end_not_a_blank_line() -> None:
    # ``data: {"b":\r`` | ``\ndata: 2}``: were the ``\r`` and the ``\n`` two line ends, the event would
    # end after its first data line.
    assert frame([b'data: {"b":\r', b"\ndata: 2}\r\n\r\n"]) == [b'data: {"b":\ndata: 2}']


def test_what_follows_the_last_blank_line_waits_for_the_next_chunk() -> None:
    framer = EventFramer()
    assert framer.feed(b'data: {"a":1}\n\ndata: {"b"') == b'data: {"a":1}\n\n'
    assert framer.partial == b'data: {"b"'
    assert framer.feed(b":2}\n\n") == b'data: {"b":2}\n\n'
    framer.feed(b"data: half")
    framer.reset()
    assert framer.partial == b""


@pytest.mark.parametrize(
    ("event", "data"),
    [
        pytest.param(b'data: {"a":1}', b'{"a":1}', id="vllm-one-line"),
        pytest.param(b'data:{"a":1}', b'{"a":1}', id="no-space-after-the-colon"),
        pytest.param(b'data:  {"a":1}', b' {"a":1}', id="only-one-space-is-taken"),
        pytest.param(b'data: {"a":\ndata: 1}', b'{"a":\n1}', id="several-data-lines-joined-by-newlines"),
        pytest.param(b'id: 3\nevent: chunk\ndata: {"a":1}', b'{"a":1}', id="other-fields-around-it"),
        pytest.param(b": ping", None, id="a-comment-has-no-data"),
        pytest.param(b"retry: 1000", None, id="a-retry-field-has-no-data"),
        pytest.param(b"data", b"", id="a-bare-data-field-is-empty"),
        pytest.param(b'database: {"a":1}', None, id="a-field-that-only-starts-like-data"),
    ],
)
def test_the_data_of_an_event_is_read_as_the_spec_joins_it(event: bytes, data: bytes | None) -> None:
    assert data_of(event) == data


@pytest.mark.parametrize(
    ("event", "rewritten"),
    [
        pytest.param(b'data: {"a":1}', b"data: X", id="vllm-one-line"),
        pytest.param(b'id: 3\ndata: {"a":\ndata: 1}\n: c', b"id: 3\ndata: X\n: c", id="fields-kept-in-place"),
        pytest.param(b"data:{}", b"data: X", id="no-space"),
    ],
)
def test_rewriting_data_keeps_the_events_other_fields(event: bytes, rewritten: bytes) -> None:
    assert with_data(event, b"X") == rewritten
