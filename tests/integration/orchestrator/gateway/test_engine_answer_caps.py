"""An engine that answers more than the gateway reads fails its leg as the engine's error (retried or
run colocated where the legs are), the gateway stops reading at the cap, and it goes on serving. A real
orchestrator, agents on real ZeroMQ sockets, engines as real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import eventually
from tests.integration.orchestrator.gateway.test_engine_client_caps import MIB, Flood
from tests.integration.orchestrator_support import MODEL, FakeAgent, fake_engine, orch_config, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import Role

CAP = MIB


def flood(piece: bytes = b"x" * (64 << 10), content_type: str = "application/json") -> Flood:
    """An engine streaming 256 MiB: far past the cap, so what got out says where the gateway stopped."""
    return Flood(256 * MIB, piece, content_type)


async def cut_off(answer: Flood) -> int:
    """Bytes written once the handler ended: well under the 256 MiB when the gateway stopped reading."""
    await asyncio.wait_for(answer.ended.wait(), 60)
    return answer.written


@pytest.fixture
async def orch() -> AsyncIterator[OrchestratorServer]:
    config = orch_config(max_engine_body_bytes=CAP, max_engine_event_bytes=CAP)
    server = await start_orchestrator(config, shutdown_timeout_s=2.0)
    try:
        yield server
    finally:
        await server.close()


async def join(
    orch: OrchestratorServer, agents: list[FakeAgent], agent_id: str, url: str, role: Role
) -> None:
    agent = FakeAgent(orch.zmq_endpoint, agent_id, url, role)
    agents.append(agent)
    await agent.join()
    # Routed to only once a heartbeat says its engine is ready: a request sent before would not try it.
    await eventually(
        lambda: (v := orch.registry.get(agent_id)) is not None and v.state == "ready",
        what=f"{agent_id} ready",
    )


async def complete(http: aiohttp.ClientSession, orch: OrchestratorServer, prompt: str, stream: bool) -> bytes:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
    async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(body)) as resp:
        data = await resp.read()
        return b"%d " % resp.status + data


def decode_engine(flooding: Flood) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A decode engine that floods the prompt "flood" and answers others."""

    async def decode(request: web.Request) -> web.StreamResponse:
        if (await request.json())["prompt"] == "flood":
            return await flooding(request)
        return web.json_response({"choices": [{"text": " ok"}]})

    return decode


async def test_an_oversized_prefill_answer_fails_its_leg_and_the_request_falls_back_to_colocated(
    orch: OrchestratorServer, http: aiohttp.ClientSession
) -> None:
    flooding, agents = flood(), list[FakeAgent]()
    try:
        async with fake_engine(flooding) as p, fake_engine(decode_engine(flood())) as d:
            await join(orch, agents, "p0", p.url, "prefill")
            await join(orch, agents, "d0", d.url, "decode")
            long_prompt = "tokens " * 400  # long enough that a separate prefill pays off
            assert (await complete(http, orch, long_prompt, stream=False)).startswith(b"200 ")
            assert await cut_off(flooding) < 32 * MIB, "the gateway read on past its cap"
            samples = await scrape(http, orch.url)
            assert sample(samples, "vllm_disagg_upstream_errors_total", leg="prefill", kind="disconnect") == 1
            assert sample(samples, "vllm_disagg_requests_total", mode="fallback", status="200") == 1
    finally:
        for agent in agents:
            await agent.close()


@pytest.mark.parametrize(
    ("stream", "piece", "content_type"),
    [
        (False, b"x" * (64 << 10), "application/json"),
        (True, b"data: " + b"t" * (64 << 10), "text/event-stream"),
    ],
    ids=["a-whole-body", "one-endless-event"],
)
async def test_an_oversized_decode_answer_is_the_engines_error_and_the_gateway_serves_on(
    orch: OrchestratorServer, http: aiohttp.ClientSession, stream: bool, piece: bytes, content_type: str
) -> None:
    flooding, agents = flood(piece, content_type), list[FakeAgent]()
    try:
        async with fake_engine(decode_engine(flooding)) as d:
            await join(orch, agents, "d0", d.url, "decode")
            answer = await complete(http, orch, "flood", stream=stream)
            assert b"decode instance 'd0'" in answer and b"too large" in answer, answer[:300]
            if not stream:
                assert answer.startswith(b"502 "), answer[:300]
            assert await cut_off(flooding) < 32 * MIB, "the gateway read on past its cap"
            assert (await complete(http, orch, "x", stream=False)).startswith(b'200 {"choices"')
    finally:
        for agent in agents:
            await agent.close()
