"""The decode leg: relay the engine's answer to the client as bytes, with backpressure.

Non-streaming: the engine's status and body go back as they are (never re-serialised). Streaming: the
first chunk is awaited before anything is sent, so an engine failing early still becomes a clean 502
JSON; after that, bytes are written as they arrive (``write`` awaits the client, which is the
backpressure), and an engine failing mid-stream cuts the client's connection so the client sees an
incomplete response rather than a clean end. A client that goes away closes the engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from vllm_disagg.orchestrator.gateway.handoff import Target, upstream_failure
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics

_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


@dataclass(slots=True)
class LegTiming:
    """What the decode leg reports back to the route for metrics and the request record."""

    first_byte: float | None = None  # monotonic time of the first body byte from the engine
    finished: float | None = None  # monotonic time the leg ended
    client_gone: bool = False
    cut: str = ""  # why a started stream was cut, empty if it was not


async def run_decode(
    request: web.Request,
    session: aiohttp.ClientSession,
    target: Target,
    body: bytes,
    headers: dict[str, str],
    response_headers: dict[str, str],
    stream: bool,
    metrics: OrchestratorMetrics,
    now: Callable[[], float],
    timing: LegTiming,
) -> web.StreamResponse:
    """POST the decode leg and relay its answer; raises a ``RequestError`` only before the first byte."""
    try:
        async with session.post(target.url, data=body, headers=headers) as resp:
            content_type = resp.headers.get("Content-Type", "application/json")
            if not stream or resp.status != 200:
                data = await resp.read()
                timing.first_byte = timing.finished = now()
                response_headers["Content-Type"] = content_type
                return web.Response(status=resp.status, body=data, headers=response_headers)
            chunks = resp.content.iter_any()
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""
            timing.first_byte = now()
            response_headers["Content-Type"] = content_type
            response_headers["Cache-Control"] = "no-cache"
            out = web.StreamResponse(status=resp.status, headers=response_headers)
            await out.prepare(request)
            await _relay(request, resp, out, first, chunks, target, metrics, timing)
            timing.finished = now()
            return out
    except _UPSTREAM_ERRORS as exc:
        timing.finished = now()
        raise upstream_failure(target, exc, metrics) from None


async def _relay(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    out: web.StreamResponse,
    chunk: bytes,
    chunks: AsyncIterator[bytes],
    target: Target,
    metrics: OrchestratorMetrics,
    timing: LegTiming,
) -> None:
    """Copy chunks until the engine ends; the caller has prepared ``out``."""
    while True:
        if chunk:
            try:
                await out.write(chunk)
            except ConnectionError:
                # The client went away: closing the response drops the engine connection, which
                # makes the engine abort the request.
                timing.client_gone = True
                resp.close()
                return
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            break
        except _UPSTREAM_ERRORS as exc:
            error = upstream_failure(target, exc, metrics)
            timing.cut = error.message
            resp.close()
            # Headers and bytes are out: the honest signal is an incomplete response, not a clean end.
            if request.transport is not None:
                request.transport.close()
            return
    try:
        await out.write_eof()
    except ConnectionError:
        timing.client_gone = True
