"""Graceful shutdown behind a load balancer (``--shutdown-delay-s``).

On SIGTERM the orchestrator first fails ``/health`` and ``/health/ready`` ("shutting down") and goes on
serving for the delay, so that a load balancer's health check takes it out of the rotation before the
listener closes: a connection still in the kernel's accept queue when the listener closes is reset, a
request the client sees fail. A second SIGTERM (or Ctrl-C) cuts the delay short.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.helpers import eventually, free_port
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config, spawn_orchestrator
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import start_orchestrator
from vllm_disagg.sim_engine.textgen import expected_text

LONG_DELAY_S = 600.0  # longer than any test: the delay ends because the test says so
STOPPING = (503, {"status": "unavailable", "reason": "shutting down"})


async def health(http: aiohttp.ClientSession, url: str, path: str = "/health") -> tuple[int, Any]:
    async with http.get(url + path) as resp:
        return resp.status, jsonutil.loads(await resp.read())


async def refused(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/health/live"):
            return False
    except aiohttp.ClientConnectorError:
        return True


@pytest.fixture
async def spawned() -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """``vllm-disagg orchestrator --shutdown-delay-s 600`` in its own process, once it listens."""
    port = free_port()
    proc, _ = await spawn_orchestrator(
        "--port", str(port), "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}",
        "--heartbeat-interval-s", "0.1", "--heartbeat-timeout-s", "1",
        "--shutdown-delay-s", str(LONG_DELAY_S),
    )  # fmt: skip
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_fails_the_health_checks_and_serves_on_until_a_second_sigterm(
    spawned: tuple[asyncio.subprocess.Process, str], http: aiohttp.ClientSession
) -> None:
    proc, url = spawned
    status, body = await health(http, url)
    assert (status, body["reason"][:9]) == (503, "no ready ")  # no instance yet: not the reason below
    proc.send_signal(signal.SIGTERM)

    async def shutting_down() -> bool:
        return await health(http, url) == STOPPING

    await eventually(shutting_down, timeout=30, what="/health says it is shutting down")
    assert await health(http, url, "/health/ready") == STOPPING
    assert (await health(http, url, "/health/live"))[0] == 200, "it still serves"
    assert proc.returncode is None

    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert await refused(url)


async def test_requests_are_served_during_the_delay_and_the_listener_closes_after_it(
    http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    orch = await start_orchestrator(orch_config(), shutdown_timeout_s=2.0, shutdown_delay_s=LONG_DELAY_S)
    engine = await sim_engine()
    agent = FakeAgent(orch.zmq_endpoint, "d0", engine.url, "decode")
    hurry = asyncio.Event()
    closing: asyncio.Task[None] | None = None
    try:
        await agent.join()
        await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
        assert (await health(http, orch.url))[0] == 200

        closing = asyncio.ensure_future(orch.close(hurry=hurry))

        async def failing() -> bool:
            return await health(http, orch.url) == STOPPING

        await eventually(failing, timeout=30, what="/health fails")
        body = {"model": MODEL, "prompt": "still here", "max_tokens": 4, "ignore_eos": True}
        async with http.post(f"{orch.url}/v1/completions", json=body) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
        assert answer["choices"][0]["text"] == expected_text("still here", 4)
        assert not closing.done()

        hurry.set()
        async with asyncio.timeout(30):
            await closing
        assert await refused(orch.url)
    finally:
        await agent.close()
        if closing is None:
            await orch.close()
        elif not closing.done():
            hurry.set()
            await closing
