"""The engine client's measure of a stream's open event: bytes since the last blank line, however the
engine spells its line ends and wherever its chunks split them (an upper bound of what a relay that
cuts events holds)."""

from __future__ import annotations

import pytest

from vllm_disagg.orchestrator.gateway.upstream import open_event_bytes
from vllm_disagg.wire.sse import EventFramer


@pytest.mark.parametrize(
    ("before", "last", "chunk", "open_after"),
    [
        (0, b"", b'data: {"a":1}\n\n', 0),
        (0, b"", b"data: 1\n\ndata: 23", 8),
        (5, b"x", b"abc", 8),
        (0, b"", b"data: 1\r\n\r\nab", 3),  # the pair's LF counted: an upper bound
        (0, b"", b"data: 1\r\rab", 2),
        (0, b"", b"data: 1\n\rab", 2),
        (7, b"\n", b"\nab", 2),
        (7, b"\n", b"\r\nab", 3),
        (7, b"\r", b"\rab", 2),
        (7, b"\r", b"\nab", 10),
        (7, b"\n", b"ab", 9),
        (0, b"", b"data: 1\r\nx", 10),
    ],
    ids=[
        "vllm-chunk",
        "an-event-then-a-part",
        "a-part-goes-on",
        "crlf-blank-line",
        "cr-blank-line",
        "lf-then-cr",
        "lf-split-across-chunks",
        "crlf-after-lf-across-chunks",
        "cr-split-across-chunks",
        "crlf-split-is-one-line-end",
        "no-line-end",
        "one-crlf-is-no-blank-line",
    ],
)
def test_open_event_bytes(before: int, last: bytes, chunk: bytes, open_after: int) -> None:
    assert open_event_bytes(before, last, chunk) == open_after


@pytest.mark.parametrize(
    "stream",
    [
        b"data: 1\n\ndata: 2\r\n\r\ndata: 3\r\rdata: 4\r\n\ndata: 5",
        b": ping\n\nevent: x\ndata: y\n\ndata: tail-without-end",
    ],
    ids=["mixed-line-ends", "fields-and-comments"],
)
@pytest.mark.parametrize("size", [1, 2, 3, 7], ids=lambda n: f"chunks-of-{n}")
def test_it_is_never_less_than_what_the_event_framer_holds(stream: bytes, size: int) -> None:
    framer, open_bytes, last = EventFramer(), 0, b""
    for i in range(0, len(stream), size):
        chunk = stream[i : i + size]
        open_bytes = open_event_bytes(open_bytes, last, chunk)
        last = chunk[-1:]
        framer.feed(chunk)
        assert len(framer.partial) <= open_bytes
