"""Fixtures for the orchestrator's integration tests: a real orchestrator, sim engines, fake agents."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config
from tests.integration.recovery_support import Cluster, start_cluster
from tests.integration.sim_support import ZERO, StartEngine
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import Role
from vllm_disagg.sim_engine.engine import SimServer, start_engine

AgentFactory = Callable[..., Awaitable[FakeAgent]]
EngineFactory = Callable[..., Awaitable[SimServer]]


@pytest.fixture
async def orch() -> AsyncIterator[OrchestratorServer]:
    """An orchestrator on free ports with fast heartbeats."""
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=2.0)
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for the test's own HTTP calls."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
async def sim_engine() -> AsyncIterator[EngineFactory]:
    """Start simulated engines; all are closed after the test."""
    started: list[SimServer] = []

    async def start(**overrides: Any) -> SimServer:
        settings: dict[str, Any] = {"port": 0, "model": MODEL, **overrides}
        server = await start_engine(SimEngineConfig(**settings))
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            await server.close()


@pytest.fixture
async def fake_agent(orch: OrchestratorServer) -> AsyncIterator[AgentFactory]:
    """Create fake agents against ``orch``; ``join=True`` (default) says Hello and heartbeats."""
    created: list[FakeAgent] = []

    async def make(agent_id: str, url: str, role: Role, *, join: bool = True, **kwargs: Any) -> FakeAgent:
        fake = FakeAgent(orch.zmq_endpoint, agent_id, url, role, **kwargs)
        created.append(fake)
        if join:
            await fake.join()
        return fake

    try:
        yield make
    finally:
        for fake in created:
            await fake.close()


@pytest.fixture
async def engines() -> AsyncIterator[StartEngine]:
    """Start engines on free ports (``start(timing=..., **config)``); all are closed at the end."""
    started: list[SimServer] = []

    async def start(timing: SimTiming = ZERO, **kwargs: Any) -> SimServer:
        server = await start_engine(SimEngineConfig(port=0, model=MODEL, timing=timing, **kwargs))
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """A real orchestrator (its fake agents added by the test) with a 1 s idle timeout."""
    async with start_cluster(idle_timeout_s=1.0) as c:  # a hung engine fails its leg after 1 s
        yield c
