"""A stand-in for the client's response and the engine's chunks, for the resumable relay's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator


class Out:
    """Collects what the client would receive; nothing may be written after the end."""

    def __init__(self) -> None:
        self.data = b""
        self.ended = False

    async def write(self, data: bytes) -> None:
        assert not self.ended, "nothing is written after the end"
        self.data += data

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(data)
        self.ended = True


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    """The engine's body, chunk by chunk."""
    for part in parts:
        yield part
