"""Discovery over real HTTP: silence is never read as an answer.

A fake vLLM on loopback (a real aiohttp server) answers what vLLM 0.32 answers, except where a test
makes it slow, silent or rude. An engine that is only slow must not be registered as one that does
not say its ``kv_role`` (vLLM answers its first ``/server_info`` after running ``collect_env``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from vllm_disagg.agent.discover import DiscoveryError, discover

MODELS = {"object": "list", "data": [{"id": "tiny", "root": "/models/tiny", "max_model_len": 512}]}
SERVER_INFO = {
    "vllm_config": {
        "model_config": {"revision": "r1", "max_model_len": 512},
        "cache_config": {"block_size": 16},
        "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
    }
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def answer(request: web.Request) -> web.StreamResponse:
    """What a vLLM in dev mode answers (``/server_info`` included)."""
    if request.path == "/v1/models":
        return web.json_response(MODELS)
    if request.path == "/server_info":
        return web.json_response(SERVER_INFO)
    if request.path == "/version":
        return web.json_response({"version": "0.32.0"})
    if request.path == "/metrics":
        return web.Response(text="")
    return web.json_response({}, status=404)


@pytest.fixture
async def engine() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """Start a fake engine whose ``/server_info`` is served by the given handler; its base URL."""
    runners: list[web.AppRunner] = []

    async def start(server_info: Handler) -> str:
        async def route(request: web.Request) -> web.StreamResponse:
            return await (server_info if request.path == "/server_info" else answer)(request)

        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", route)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_slow_first_server_info_is_waited_for_on_its_own_budget(
    engine: Callable[[Handler], Awaitable[str]],
) -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.6)  # longer than every other question's budget below
        return await answer(request)

    url = await engine(slow)
    async with aiohttp.ClientSession() as http:
        facts = await discover(http, url, timeout_s=0.3, server_info_timeout_s=30.0)
    assert facts.dev_mode and facts.kv_role == "kv_consumer" and facts.role == "decode"
    assert (facts.block_size, facts.revision, facts.version) == (16, "r1", "0.32.0")


async def test_a_server_info_that_never_answers_fails_discovery_and_names_the_question(
    engine: Callable[[Handler], Awaitable[str]],
) -> None:
    never = asyncio.Event()

    async def silent(request: web.Request) -> web.StreamResponse:
        await never.wait()
        raise AssertionError("unreachable")

    url = await engine(silent)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(DiscoveryError, match=r"/server_info\?config_format=json: unreachable: no answer"):
            await discover(http, url, timeout_s=0.3, server_info_timeout_s=0.3)


async def test_a_dropped_connection_fails_discovery_and_a_404_means_no_dev_mode(
    engine: Callable[[Handler], Awaitable[str]],
) -> None:
    async def rude(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()  # no status line at all
        return web.Response()

    async def not_found(request: web.Request) -> web.StreamResponse:
        return web.json_response({"detail": "Not Found"}, status=404)

    rude_url, plain_url = await engine(rude), await engine(not_found)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(DiscoveryError, match=r"/server_info\?config_format=json: unreachable"):
            await discover(http, rude_url, timeout_s=5.0)
        facts = await discover(http, plain_url, timeout_s=5.0)
    assert not facts.dev_mode and facts.kv_role == "" and facts.role is None
    assert any("VLLM_SERVER_DEV_MODE" in note for note in facts.notes)


async def test_a_second_look_at_the_same_engine_version_sends_no_probes_and_a_new_version_is_probed() -> None:
    posts: list[str] = []

    async def route(request: web.Request) -> web.StreamResponse:
        if request.method == "POST":  # a capability probe: a real request the engine must serve
            posts.append(request.path)
            return web.json_response({"error": "no probes here"}, status=400)
        return await answer(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", route)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            first = await discover(http, url, timeout_s=5.0)
            probed = len(posts)
            again = await discover(http, url, timeout_s=5.0, known=first)
            assert probed > 0 and len(posts) == probed, "the same version serving the same models"
            assert again.capabilities == first.capabilities and again.version == "0.32.0"
            older = dataclasses.replace(first, version="0.10.1")
            await discover(http, url, timeout_s=5.0, known=older)
            assert len(posts) == 2 * probed, "another version than the last look's is probed"
    finally:
        await runner.cleanup()
