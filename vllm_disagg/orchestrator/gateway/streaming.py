"""The decode leg: relay the engine's answer to the client as bytes, with backpressure.

Non-streaming: the engine's 2xx (or its own 4xx) goes back as it is (never re-serialised); a 5xx, 408
or 429 raises an ``UpstreamError`` so the gateway can retry elsewhere. Streaming: the first chunk is
awaited before anything is sent, so an engine failing early is still retried cleanly; after that, bytes
are written as they arrive (``write`` awaits the client, which is the backpressure). An engine failing
mid-stream ends the leg with ``LegTiming.cut`` set and the client's response still open: the gateway
resumes it elsewhere or ends it with ``end_with_error`` (an error event, then ``[DONE]``, as vLLM
itself ends a stream that fails). A client that goes away closes the engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.errors import UpstreamError
from vllm_disagg.orchestrator.gateway.handoff import Target, status_failure, upstream_failure
from vllm_disagg.orchestrator.gateway.resume import StreamBroken, StreamState
from vllm_disagg.orchestrator.gateway.server import Answer, ClientRequest, ClientStream, FastRequest
from vllm_disagg.orchestrator.gateway.upstream import EngineClient, EngineHTTPError, EngineResponse
from vllm_disagg.orchestrator.gateway.watch import LegWatch
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics

_UPSTREAM_ERRORS = (EngineHTTPError, TimeoutError, OSError, UpstreamError)
_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class LegTiming:
    """What the decode leg reports back to the route for metrics and the request record."""

    first_byte: float | None = None  # monotonic time of the first body byte from the engine
    finished: float | None = None  # monotonic time the leg ended
    client_gone: bool = False
    cut: str = ""  # why a started stream was cut, empty if it was not
    cut_cause: str = ""  # the cut's ``UpstreamError.cause``


class _EventStream(web.StreamResponse):
    """A streamed answer whose headers go out with its first chunk: one write instead of two. It is
    prepared only once the engine's first bytes are in hand, so nothing waits for them. (aiohttp
    >= 3.12 reads this flag; older versions send the headers at once, as before.)"""

    _send_headers_immediately = False


async def run_decode(
    request: ClientRequest,
    session: EngineClient,
    target: Target,
    body: bytes,
    headers: dict[str, str],
    response_headers: dict[str, str],
    stream: bool,
    metrics: OrchestratorMetrics,
    now: Callable[[], float],
    timing: LegTiming,
    watch: LegWatch,
    state: StreamState | None = None,
) -> Answer:
    """POST the decode leg and relay its answer; raises ``UpstreamError`` only before the first byte.

    After it, a failure returns the prepared response with ``timing.cut`` set (the caller resumes or
    ends it). ``state``: relay event by event, keeping what a resume needs.
    """
    out: Answer | None = None
    try:
        async with (
            watch.leg(target.agent_id, target.describe()),
            session.post(target.url, data=body, headers=headers) as resp,
        ):
            status = resp.status
            if status >= 500 or status in (408, 429):
                raise status_failure(target, status, await resp.read(), metrics)
            content_type = resp.headers.get("Content-Type", "application/json")
            if not stream or status != 200:
                data = await resp.read()
                timing.first_byte = timing.finished = now()
                response_headers["Content-Type"] = content_type
                return web.Response(status=status, body=data, headers=response_headers)
            chunks = resp.content.iter_any()
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""
            timing.first_byte = now()
            response_headers["Content-Type"] = content_type
            response_headers["Cache-Control"] = "no-cache"
            out = await open_stream(request, status, response_headers)
            if state is None:
                await _relay(resp, out, first, chunks, timing)
            else:
                await _relay_events(resp, out, first, chunks, timing, state)
            timing.finished = now()
            return out
    except _UPSTREAM_ERRORS as exc:
        timing.finished = now()
        error = _leg_error(target, exc, metrics)
        if out is None:
            raise error from None
        timing.cut, timing.cut_cause = error.message, error.cause
        return out


async def open_stream(request: ClientRequest, status: int, headers: dict[str, str]) -> Answer:
    """The client's streamed answer, on whichever server ``request`` came."""
    if isinstance(request, FastRequest):
        return request.stream(status, headers)
    out = _EventStream(status=status, headers=headers)
    await out.prepare(request)
    return out


def _leg_error(target: Target, exc: BaseException, metrics: OrchestratorMetrics) -> UpstreamError:
    """Any failure of a decode leg as an ``UpstreamError`` naming the instance, counted once."""
    if isinstance(exc, StreamBroken):
        metrics.upstream_error(target.leg, exc.cause)
        return UpstreamError(f"{target.describe()} {exc.message}", cause=exc.cause)
    if isinstance(exc, UpstreamError) and exc.cause != "lost":
        return exc  # classified (and counted) where it was raised
    return upstream_failure(target, exc, metrics)


async def _relay(
    resp: EngineResponse,
    out: ClientStream,
    chunk: bytes,
    chunks: AsyncIterator[bytes],
    timing: LegTiming,
) -> None:
    """Copy chunks until the engine ends; the caller has prepared ``out``. Upstream errors propagate."""
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
    try:
        await out.write_eof()
    except ConnectionError:
        timing.client_gone = True


async def _relay_events(
    resp: EngineResponse,
    out: ClientStream,
    first: bytes,
    chunks: AsyncIterator[bytes],
    timing: LegTiming,
    state: StreamState,
) -> None:
    try:
        await state.relay(out, first, chunks)
        await out.write_eof()
    except ConnectionError:
        timing.client_gone = True
        resp.close()


async def continue_stream(
    out: ClientStream,
    session: EngineClient,
    target: Target,
    body: bytes,
    headers: dict[str, str],
    metrics: OrchestratorMetrics,
    now: Callable[[], float],
    timing: LegTiming,
    watch: LegWatch,
    state: StreamState,
) -> None:
    """POST a resumed leg and relay it into the client's open stream; ``UpstreamError`` if it fails."""
    try:
        async with (
            watch.leg(target.agent_id, target.describe()),
            session.post(target.url, data=body, headers=headers) as resp,
        ):
            if resp.status != 200:
                error = status_failure(target, resp.status, await resp.read(), metrics)
                # Even an engine's 4xx ends this resume: the client's stream is already under way.
                raise error if isinstance(error, UpstreamError) else UpstreamError(str(error))
            await _relay_events(resp, out, b"", resp.content.iter_any(), timing, state)
    except _UPSTREAM_ERRORS as exc:
        timing.finished = now()
        raise _leg_error(target, exc, metrics) from None
    timing.finished = now()


def error_event(message: str) -> bytes:
    """An SSE error event shaped like the one vLLM sends when a stream fails: an ``UpstreamError``'s."""
    return b"data: " + jsonutil.dumps(UpstreamError(message).to_json()) + b"\n\n"


async def end_stream(out: ClientStream, timing: LegTiming) -> None:
    """End a stream whose client has the whole answer but ``[DONE]``: ``[DONE]``, then the end."""
    try:
        await out.write_eof(_DONE)
    except ConnectionError:
        timing.client_gone = True


async def end_with_error(out: ClientStream, message: str, timing: LegTiming) -> None:
    """End a cut stream honestly: an error event, then ``[DONE]``, then the end of the response."""
    try:
        await out.write(error_event(message) + _DONE)
        await out.write_eof()
    except ConnectionError:
        timing.client_gone = True
