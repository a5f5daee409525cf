"""Server-sent events as OpenAI-compatible engines write them: framing, and the data of one event.

vLLM writes each event as one ``data: `` line and a blank line (``\\n\\n``). The spec allows more, and
other engines, other versions and proxies use it: lines ending in ``\\r\\n`` or ``\\r``, several
``data:`` lines joined by newlines, ``data:`` without the space, comments (``: ping``) and ``event:``
or ``id:`` fields. ``EventFramer`` cuts any of them into complete events with ``\\n`` line ends,
whatever the chunking; ``data_of`` reads one event's data as the spec joins it.
"""

from __future__ import annotations

_END = b"\n\n"


class EventFramer:
    """Cuts a byte stream into complete events (each ending in a blank line), chunk by chunk."""

    __slots__ = ("_buffer", "_cr")

    def __init__(self) -> None:
        self._buffer = b""
        self._cr = False  # the last chunk ended in ``\r``: a ``\n`` opening the next one is its pair

    def feed(self, chunk: bytes) -> bytes:
        """The complete events this chunk ends (``b""`` when none), line ends made ``\\n``."""
        if self._cr or b"\r" in chunk:
            chunk = self._lf(chunk)
        data = self._buffer + chunk if self._buffer else chunk
        end = data.rfind(_END) + 2
        if end < 2:
            self._buffer = data
            return b""
        self._buffer = data[end:]
        return data if end == len(data) else data[:end]

    @property
    def partial(self) -> bytes:
        """What was fed after the last complete event."""
        return self._buffer

    def reset(self) -> None:
        """Forget a partial event (a new response begins)."""
        self._buffer, self._cr = b"", False

    def _lf(self, chunk: bytes) -> bytes:
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the ``\n`` of a ``\r\n`` split across chunks: its ``\r`` became one
        self._cr = chunk.endswith(b"\r")
        # A raw CR never occurs inside JSON (strings escape it): every one ends a line.
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def data_of(event: bytes) -> bytes | None:
    """An event's data: its ``data`` fields' values joined by ``\\n``; None when it has none (a
    comment, a ``retry``)."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # vLLM's one line
    values = []
    for line in event.split(b"\n"):
        name, colon, value = line.partition(b":")
        if name != b"data":
            continue  # a comment (empty name), another field, or a line that only looks like one
        if colon and value.startswith(b" "):
            value = value[1:]
        values.append(value)
    return b"\n".join(values) if values else None


def with_data(event: bytes, data: bytes) -> bytes:
    """``event`` with its data replaced by ``data`` (one ``data: `` line where the first was; its other
    fields and comments kept in place)."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return b"data: " + data
    out: list[bytes] = []
    placed = False
    for line in event.split(b"\n"):
        if line.partition(b":")[0] == b"data":
            if not placed:
                out.append(b"data: " + data)
                placed = True
            continue
        out.append(line)
    if not placed:
        out.append(b"data: " + data)
    return b"\n".join(out)
