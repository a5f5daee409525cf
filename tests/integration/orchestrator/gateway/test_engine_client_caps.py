"""How much of an engine's answer the gateway's engine client reads: a whole body up to its cap, a
stream's events each up to theirs, headers up to 64 KiB; past them the call fails and the connection is
dropped, so the engine's further bytes are never read. Real aiohttp engines on loopback."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from yarl import URL

from tests.integration.orchestrator.gateway.test_engine_client import client, engine
from vllm_disagg.orchestrator.gateway.upstream import EngineAnswerTooLarge, EngineDisconnected

MIB = 1 << 20
CHUNK = 64 << 10


class Flood:
    """A handler that streams ``total`` bytes (chunked, no length) and records how many it got out."""

    def __init__(
        self, total: int, piece: bytes = b"x" * CHUNK, content_type: str = "application/json"
    ) -> None:
        self.total, self.piece, self.content_type = total, piece, content_type
        self.written = 0
        self.ended = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": self.content_type})
        try:
            await resp.prepare(request)
            while self.written < self.total:
                await resp.write(self.piece)
                self.written += len(self.piece)
            await resp.write_eof()
        finally:
            self.ended.set()  # written all, or the gateway dropped the connection (reset or cancelled)
        return resp


async def test_a_body_past_the_cap_fails_the_read_and_the_rest_is_never_read() -> None:
    flood = Flood(256 * MIB)
    async with engine(flood) as e:
        c = client()
        c.max_body_bytes = MIB
        try:
            async with c.post(e.url, b"{}", {}) as resp:
                with pytest.raises(EngineAnswerTooLarge, match=f"passed the {MIB} bytes"):
                    await resp.read()
            await asyncio.wait_for(flood.ended.wait(), 60)
            # Socket buffers hold some MiB; reading on would have taken all 256.
            assert flood.written < 32 * MIB, flood.written
            assert c.idle_connections() == 0, "a connection cut mid-answer is never pooled"
        finally:
            await c.close()


async def test_a_declared_length_past_the_cap_fails_before_the_body_is_read() -> None:
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (2 * MIB), content_type="application/json")

    async with engine(big) as e:
        c = client()
        c.max_body_bytes = MIB
        try:
            async with c.post(e.url, b"{}", {}) as resp:
                with pytest.raises(EngineAnswerTooLarge, match=f"its body is {2 * MIB} bytes"):
                    await resp.read()
        finally:
            await c.close()


async def test_a_body_of_exactly_the_cap_is_read_whole() -> None:
    flood = Flood(MIB)
    async with engine(flood) as e:
        c = client()
        c.max_body_bytes = MIB
        try:
            async with c.post(e.url, b"{}", {}) as resp:
                assert len(await resp.read()) == MIB
        finally:
            await c.close()


async def test_a_stream_is_bounded_per_event_not_in_total() -> None:
    event = b"data: " + b"t" * 200 + b"\n\n"
    fine = Flood(4 * MIB, piece=event * 16, content_type="text/event-stream")
    endless = Flood(256 * MIB, piece=b"data: " + b"t" * (CHUNK - 6), content_type="text/event-stream")
    async with engine(fine) as ok, engine(endless) as bad:
        c = client()
        c.max_event_bytes = CHUNK
        try:
            async with c.post(ok.url, b"{}", {}) as resp:
                assert sum([len(chunk) async for chunk in resp.iter_any()]) >= 4 * MIB
            async with c.post(bad.url, b"{}", {}) as resp:
                with pytest.raises(EngineAnswerTooLarge, match="one event of its stream"):
                    async for _ in resp.iter_any():
                        pass
            await asyncio.wait_for(endless.ended.wait(), 60)
            assert endless.written < 32 * MIB, endless.written
        finally:
            await c.close()


async def test_headers_without_end_fail_the_call() -> None:
    written, ended = 0, asyncio.Event()

    async def endless_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        try:
            writer.write(b"HTTP/1.1 200 OK\r\n")
            while written < 256 * MIB:
                line = b"X-Pad-%d: %s\r\n" % (written, b"v" * 1000)
                writer.write(line)
                await writer.drain()
                written += len(line)
        except ConnectionError:
            pass
        finally:
            writer.close()
            ended.set()

    server = await asyncio.start_server(endless_head, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    c = client()
    try:
        with pytest.raises(EngineAnswerTooLarge, match="bytes of headers"):
            async with c.post(URL(f"http://127.0.0.1:{port}/v1/completions"), b"{}", {}):
                pass
        await asyncio.wait_for(ended.wait(), 60)
        assert written < 32 * MIB, written
    finally:
        await c.close()
        server.close()
        await server.wait_closed()


async def test_an_https_url_is_never_sent_in_clear() -> None:
    c = client()
    try:
        with pytest.raises(EngineDisconnected, match="plain http"):
            async with c.post(URL("https://127.0.0.1:9/v1/completions"), b"{}", {"Authorization": "k"}):
                pass
    finally:
        await c.close()
