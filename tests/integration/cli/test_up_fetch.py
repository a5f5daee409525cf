"""``up`` polls the orchestrator's admin API while engines start: an answer that comes late (the host is
busy starting vLLM) or not at all is "not ready yet", never the end of ``up``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from vllm_disagg.cli.up import fetch_instances


@pytest.fixture
async def slow_admin() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """An admin API that holds each answer until released; its URL and the release."""
    release = asyncio.Event()

    async def instances(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"instances": [{"agent_id": "p0", "state": "ready"}]})

    app = web.Application()
    app.router.add_get("/admin/v1/instances", instances)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", release
    finally:
        release.set()
        await runner.cleanup()


async def test_an_admin_answer_that_comes_too_late_is_not_ready_yet_and_the_next_one_counts(
    slow_admin: tuple[str, asyncio.Event],
) -> None:
    base, release = slow_admin
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
        assert await fetch_instances(session, base, "token") is None
        release.set()
        assert await fetch_instances(session, base, "token") == [{"agent_id": "p0", "state": "ready"}]


async def test_an_orchestrator_not_listening_yet_is_not_ready_yet() -> None:
    async with aiohttp.ClientSession() as session:
        assert await fetch_instances(session, "http://127.0.0.1:9", "token") is None
