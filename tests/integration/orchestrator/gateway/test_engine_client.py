"""The gateway's engine client on real loopback sockets: keep-alive reuse, bodies whole and streamed,
and every way an engine call fails, each as the error the gateway classifies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from yarl import URL

from tests.helpers import eventually, free_port
from vllm_disagg.orchestrator.gateway.upstream import EngineClient, EngineConnectError, EngineDisconnected

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Engine:
    """An aiohttp server that records the requests it saw, and from which client ports."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str | None, bytes]] = []  # path, X-Request-Id, body
        self.peers: set[object] = set()
        self.url = URL("http://127.0.0.1")

    @property
    def connections(self) -> int:
        """Connections that carried a request (each has its own client port)."""
        return len(self.peers)


@contextlib.asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[Engine]:
    state = Engine()

    async def counted(request: web.Request) -> web.StreamResponse:
        state.requests.append((request.path, request.headers.get("X-Request-Id"), await request.read()))
        assert request.transport is not None
        state.peers.add(request.transport.get_extra_info("peername"))
        return await handler(request)

    app = web.Application()
    app.router.add_post("/{tail:.*}", counted)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    state.url = URL(f"http://127.0.0.1:{port}/v1/completions")
    try:
        yield state
    finally:
        await runner.cleanup()


def client(**changes: float) -> EngineClient:
    limits = {"connect_timeout_s": 5.0, "idle_timeout_s": 5.0, "keepalive_s": 4.0, **changes}
    return EngineClient(
        connect_timeout_s=limits["connect_timeout_s"],
        idle_timeout_s=limits["idle_timeout_s"],
        keepalive_s=limits["keepalive_s"],
    )


async def _json(request: web.Request) -> web.Response:
    return web.json_response({"echo": (await request.read()).decode()})


async def test_a_post_sends_the_body_and_headers_and_reads_the_answer_on_a_connection_it_reuses() -> None:
    async with engine(_json) as e:
        c = client()
        try:
            for n in range(3):
                async with c.post(e.url, b'{"n":%d}' % n, {"X-Request-Id": f"r{n}"}) as resp:
                    assert resp.status == 200
                    assert resp.headers.get("CONTENT-TYPE") == "application/json; charset=utf-8"
                    assert await resp.read() == b'{"echo": "{\\"n\\":%d}"}' % n
            assert e.requests == [("/v1/completions", f"r{n}", b'{"n":%d}' % n) for n in range(3)]
            assert e.connections == 1, "keep-alive: one connection for the three requests"
            assert c.idle_connections() == 1
        finally:
            await c.close()


async def test_a_connection_idle_past_keepalive_is_not_reused() -> None:
    async with engine(_json) as e:
        c = client(keepalive_s=0.05)
        try:
            async with c.post(e.url, b"{}", {}) as resp:
                await resp.read()
            await asyncio.sleep(0.1)  # idle past keepalive_s: that is what is under test
            async with c.post(e.url, b"{}", {}) as resp:
                await resp.read()
            assert e.connections == 2
        finally:
            await c.close()


async def test_a_streamed_body_arrives_chunk_by_chunk_as_the_engine_writes_it() -> None:
    go = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await go.wait()
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    async with engine(stream) as e:
        c = client()
        try:
            async with c.post(e.url, b"{}", {}) as resp:
                chunks = resp.content.iter_any()
                assert await anext(chunks) == b"data: 1\n\n", "the first event, before the engine goes on"
                go.set()
                assert b"".join([part async for part in chunks]) == b"data: 2\n\n"
            assert c.idle_connections() == 1, "a chunked body read to its end leaves the connection reusable"
        finally:
            await c.close()


async def test_an_engine_that_is_not_listening_is_a_connect_error() -> None:
    c = client()
    try:
        with pytest.raises(EngineConnectError) as caught:
            async with c.post(URL(f"http://127.0.0.1:{free_port()}/v1/completions"), b"{}", {}):
                pass
        assert caught.value.os_error.strerror
    finally:
        await c.close()


async def _cut_mid_body(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"data: 1\n\n")
    assert request.transport is not None
    request.transport.close()
    return resp


async def _not_http(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.write(b"SSH-2.0-OpenSSH\r\n\r\n")
    request.transport.close()
    return web.Response()


async def _silent(request: web.Request) -> web.StreamResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("handler", "error", "message"),
    [
        pytest.param(_cut_mid_body, EngineDisconnected, "before the response ended", id="cut-mid-body"),
        pytest.param(_not_http, EngineDisconnected, "not valid HTTP", id="not-http"),
        pytest.param(_silent, TimeoutError, "no response bytes", id="silent-past-the-idle-timeout"),
    ],
)
async def test_an_engine_that_fails_after_connecting_raises_the_error_the_gateway_classifies(
    handler: Handler, error: type[Exception], message: str
) -> None:
    async with engine(handler) as e:
        c = client(idle_timeout_s=0.3)
        try:
            with pytest.raises(error, match=message):
                async with c.post(e.url, b"{}", {}) as resp:
                    await resp.read()
            assert c.idle_connections() == 0, "a failed connection is never pooled"
        finally:
            await c.close()


async def test_closing_a_response_drops_the_connection_so_the_engine_sees_its_client_leave() -> None:
    started = asyncio.Event()
    left = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        started.set()
        try:
            while True:
                await resp.write(b"data: more\n\n")
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionError):
            left.set()
            raise

    async with engine(endless) as e:
        c = client()
        try:
            async with c.post(e.url, b"{}", {}) as resp:
                await started.wait()
                resp.close()
            await eventually(left.is_set, what="the engine saw the connection go")
            assert c.idle_connections() == 0
        finally:
            await c.close()


async def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async with engine(_json) as e:
        c = client()
        try:
            with pytest.raises(ValueError, match="line break"):
                async with c.post(e.url, b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"}):
                    pass
            assert e.requests == []
        finally:
            await c.close()
