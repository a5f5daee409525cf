"""Timing a streamed completion as its client sees it, for the benchmarks that measure TTFT and TPOT."""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """Text events received, and when: TTFT from ``t0`` to the first, TPOT between first and last."""

    tokens: int
    ttft_s: float
    tpot_s: float


async def time_stream(resp: aiohttp.ClientResponse, t0: float) -> StreamTiming:
    """Read a 200 SSE response to its end, timing each ``data:`` event that carries text."""
    first = last = 0.0
    tokens = 0
    buffer = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buffer += chunk
        if b"\n\n" in buffer:
            *done, buffer = buffer.split(b"\n\n")
            fresh = sum(1 for e in done if e.startswith(b"data: {") and b'"text"' in e)
            if fresh and not tokens:
                first = now
            tokens += fresh
            last = now if fresh else last
    ttft = first - t0 if tokens else 0.0
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return StreamTiming(tokens, ttft, tpot)
