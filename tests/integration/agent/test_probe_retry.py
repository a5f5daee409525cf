"""The capability probe (``agent.probe``) against a real HTTP server on loopback: a connection the
server drops as it is reused is tried once more on a new one; a server that drops every time is a
probe unanswered, named as such."""

from __future__ import annotations

from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from vllm_disagg.agent.probe import ProbeUnanswered, probe_capabilities


async def serve(drops: int) -> tuple[web.AppRunner, str, Counter[str]]:
    """Every path answers 404 (nothing to learn), after dropping the connection of its first
    ``drops`` requests unanswered."""
    seen: Counter[str] = Counter()

    async def handler(request: web.Request) -> web.Response:
        seen[request.path] += 1
        if seen[request.path] <= drops:
            assert request.transport is not None
            request.transport.close()
        return web.Response(status=404, text="no")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", seen


async def test_a_dropped_connection_is_tried_once_more() -> None:
    runner, base, seen = await serve(drops=1)
    try:
        async with aiohttp.ClientSession() as http:
            capabilities, notes = await probe_capabilities(http, base, "m", timeout_s=10)
        assert not capabilities.completions_token_ids and not capabilities.chat_token_ids
        assert seen == {"/v1/completions": 2, "/v1/chat/completions": 2}
        assert any("completions" in n for n in notes)
    finally:
        await runner.cleanup()


async def test_a_server_that_drops_every_time_leaves_the_probe_unanswered() -> None:
    runner, base, seen = await serve(drops=2)
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(ProbeUnanswered, match="/v1/completions: Server disconnected"):
                await probe_capabilities(http, base, "m", timeout_s=10)
        assert seen == {"/v1/completions": 2}
    finally:
        await runner.cleanup()
