"""Slow clients on the gateway's port (docs/operations.md, "Slow clients"): a head or a body dribbled byte
by byte is cut with 408 at its deadline, a client that never reads its stream is dropped after the write
timeout (and its engine leg cancelled), connections past the cap are refused with 503; clients that send
and read at any steady pace are not touched. Real sockets on loopback against a real orchestrator."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import expected, text_of, wait_ready
from tests.integration.orchestrator.gateway.test_server import ROUTE, Answer, completion, post, read_answer
from tests.integration.orchestrator_support import MODEL, fake_engine, orch_config
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import METRICS_KEY, OrchestratorServer, start_orchestrator

# Small deadlines, so that each cut comes within a second or two.
LIMITS: dict[str, Any] = {
    "client_head_timeout_s": 1.0,
    "client_body_timeout_s": 1.0,
    "client_body_min_rate": 1000.0,
    "client_write_timeout_s": 1.0,
    "max_client_connections": 64,
}
PACE_S = 0.2  # a slow client's pause between its bytes
CUT_WITHIN_S = 4.0  # a deadline of 1 s, swept every 0.25 s, on a busy 2-core machine


@pytest.fixture
async def orch(request: pytest.FixtureRequest) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator with ``LIMITS`` (a test's ``indirect`` parameter overrides some)."""
    overrides = getattr(request, "param", {})
    server = await start_orchestrator(orch_config(**{**LIMITS, **overrides}), shutdown_timeout_s=2.0)
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def pd(orch: OrchestratorServer, fake_agent: AgentFactory, sim_engine: EngineFactory) -> None:
    """One simulated prefill and one simulated decode engine, registered and ready."""
    await fake_agent("p0", (await sim_engine()).url, "prefill")
    await fake_agent("d0", (await sim_engine()).url, "decode")
    await wait_ready(orch, 1, 1)


def address(orch: OrchestratorServer) -> tuple[str, int]:
    host, port = orch.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def closed_on(orch: OrchestratorServer, reason: str) -> float:
    """Connections the gateway closed on ``reason`` so far."""
    registry = orch.app[METRICS_KEY].registry
    return registry.get_sample_value("vllm_disagg_client_connections_closed_total", {"reason": reason}) or 0.0


async def closed(reader: asyncio.StreamReader) -> bool:
    """The gateway closed the connection: EOF, or a reset (bytes the client sent after the answer were
    left unread, so the kernel resets rather than closes)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout=CUT_WITHIN_S) == b""
    except ConnectionResetError:
        return True


async def dribble(orch: OrchestratorServer, first: bytes, rest: bytes, step: int) -> tuple[Answer, float]:
    """Send ``first`` at once, then ``rest`` ``step`` bytes every ``PACE_S`` until the gateway answers;
    the answer and the seconds from the first byte to it. Fails if all of ``rest`` went out first."""
    reader, writer = await asyncio.open_connection(*address(orch))
    started = time.monotonic()
    answer = asyncio.create_task(read_answer(reader))
    try:
        writer.write(first)
        for at in range(0, len(rest), step):
            await asyncio.wait({answer}, timeout=PACE_S)  # the slow client's pace (what is under test)
            if answer.done():
                break
            writer.write(rest[at : at + step])
        result = await asyncio.wait_for(answer, timeout=CUT_WITHIN_S)
        elapsed = time.monotonic() - started
        assert await closed(reader), "closed after the 408"
        return result, elapsed
    finally:
        answer.cancel()
        writer.close()


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(b"", id="from its first byte"),
        pytest.param(b"POST /v1/completions HTTP/1.1\r\n", id="after its request line"),
    ],
)
async def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_head_deadline_with_408(
    orch: OrchestratorServer, first: bytes
) -> None:
    head = post(completion(), "slowloris")
    head = head[: head.index(b"\r\n\r\n")]  # never complete: only a deadline ends it
    answer, elapsed = await dribble(orch, first, head[len(first) :], step=1)
    assert answer.status == 408 and answer.headers["connection"] == "close"
    assert jsonutil.loads(answer.body)["error"]["type"] == "RequestTimeoutError"
    assert elapsed < CUT_WITHIN_S
    assert closed_on(orch, "head_timeout") == 1


async def test_a_body_sent_slower_than_the_minimum_rate_is_cut_with_408(orch: OrchestratorServer) -> None:
    body = completion() + b" " * 20_000  # JSON allows the trailing blanks
    request = post(body, "slow-body")
    split = len(request) - len(body)
    answer, elapsed = await dribble(orch, request[:split], request[split:], step=20)  # 100 B/s
    assert answer.status == 408 and answer.headers["connection"] == "close"
    assert "too slowly" in jsonutil.loads(answer.body)["error"]["message"]
    assert elapsed < CUT_WITHIN_S
    assert closed_on(orch, "body_timeout") == 1


async def test_a_new_connection_that_sends_nothing_is_closed_at_the_head_deadline(
    orch: OrchestratorServer,
) -> None:
    reader, writer = await asyncio.open_connection(*address(orch))
    try:
        assert await asyncio.wait_for(reader.read(), timeout=CUT_WITHIN_S) == b""  # nothing to answer
    finally:
        writer.close()
    assert closed_on(orch, "head_timeout") == 1


@pytest.mark.usefixtures("pd")
async def test_a_body_in_a_few_fast_chunks_longer_than_the_body_timeout_is_served(
    orch: OrchestratorServer,
) -> None:
    body = completion() + b" " * 40_000  # 40 kB over 2 s: 20 kB/s, well above the minimum rate
    request = post(body, "steady-body")
    reader, writer = await asyncio.open_connection(*address(orch))
    try:
        for at in range(0, len(request), len(request) // 10 + 1):
            writer.write(request[at : at + len(request) // 10 + 1])
            await asyncio.sleep(PACE_S)  # the client's pace
        answer = await asyncio.wait_for(read_answer(reader), timeout=30)
    finally:
        writer.close()
    assert answer.status == 200, answer.body
    assert text_of(ROUTE, answer.body, False) == expected(ROUTE)
    assert closed_on(orch, "body_timeout") == 0


async def flood(request: web.Request, events: int | None) -> web.StreamResponse:
    """A decode engine streaming 16 kB events as fast as its client takes them (``None``: for ever)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    event = b"data: " + jsonutil.dumps({"choices": [{"index": 0, "text": "x" * 16_000}]}) + b"\n\n"
    n = 0
    while events is None or n < events:
        await resp.write(event)
        n += 1
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def test_a_client_that_never_reads_its_stream_is_dropped_and_its_engine_leg_cancelled(
    orch: OrchestratorServer, fake_agent: AgentFactory
) -> None:
    async with fake_engine(lambda r: flood(r, None)) as d:
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 0, 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(sock, address(orch))
            body = jsonutil.dumps({"model": MODEL, "prompt": "x", "stream": True})
            await loop.sock_sendall(sock, post(body, "never-reads"))
            await eventually(lambda: orch.registry.snapshot().in_flight_of("d0") == 1, what="streaming")
            await asyncio.wait_for(d.disconnected.wait(), timeout=15)  # never read: only the timeout ends it
            await eventually(lambda: orch.registry.snapshot().in_flight_of("d0") == 0, what="leg released")
        finally:
            sock.close()
    assert closed_on(orch, "write_timeout") == 1


async def test_a_long_stream_read_steadily_is_not_cut(
    orch: OrchestratorServer, fake_agent: AgentFactory
) -> None:
    async with fake_engine(lambda r: flood(r, 150)) as d:  # 2.4 MB, read over about 2 s
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 0, 1)
        body = jsonutil.dumps({"model": MODEL, "prompt": "x", "stream": True})
        received = 0
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
            http.post(f"{orch.url}{ROUTE}", data=body) as resp,
        ):
            assert resp.status == 200
            while chunk := await resp.content.read(65_536):
                received += len(chunk)
                await asyncio.sleep(0.05)  # a slow reader, steady: never stalled for the write timeout
    assert received > 150 * 16_000
    assert closed_on(orch, "write_timeout") == 0


@pytest.mark.usefixtures("pd")
@pytest.mark.parametrize(
    "orch",
    [pytest.param({"max_client_connections": 4, "client_head_timeout_s": 60.0}, id="a cap of 4")],
    indirect=True,
)
async def test_past_the_connection_cap_a_new_connection_gets_503_and_a_client_works_after(
    orch: OrchestratorServer,
) -> None:
    held = [await asyncio.open_connection(*address(orch)) for _ in range(4)]
    reader, writer = await asyncio.open_connection(*address(orch))
    try:
        answer = await asyncio.wait_for(read_answer(reader), timeout=15)
        assert answer.status == 503 and answer.headers["retry-after"] == "1"
        assert await closed(reader)
        assert closed_on(orch, "cap") == 1
    finally:
        writer.close()
        for _, w in held:
            w.close()

    async def served() -> bool:
        reader, writer = await asyncio.open_connection(*address(orch))
        try:
            writer.write(post(completion(), "after-the-cap"))
            return (await asyncio.wait_for(read_answer(reader), timeout=15)).status == 200
        finally:
            writer.close()

    await eventually(served, what="a client served once the held connections closed")
