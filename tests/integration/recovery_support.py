"""A real orchestrator with fake agents, and helpers to call it: for the recovery tests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import EngineCapabilities, InstanceInfo, MetricsSnapshot, Role

PROMPT = "Recovery is the product: every request gets its answer, whatever fails. " * 2
BUSY = MetricsSnapshot(num_waiting=50)  # makes a healthy instance the scheduler's second choice
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Cluster:
    """A real orchestrator and the fake agents of one test."""

    def __init__(self, server: OrchestratorServer) -> None:
        self.server = server
        self.agents: list[FakeAgent] = []

    async def add(
        self,
        agent_id: str,
        url: str,
        role: Role,
        *,
        busy: bool = False,
        scrape: str = "",
        capabilities: EngineCapabilities | None = None,
    ) -> FakeAgent:
        """An agent for the engine at ``url``; ``scrape``: report that engine's real metrics;
        ``capabilities``: what its Hello says the engine's answers carry (default: not said)."""
        info = InstanceInfo(url=url, role=role, model=MODEL, engine="sim")
        if capabilities is not None:
            info = dataclasses.replace(info, capabilities=capabilities)
        agent = FakeAgent(self.server.zmq_endpoint, agent_id, url, role, interval_s=0.05, info=info)
        if busy:
            agent.metrics = BUSY
        if scrape:
            agent.follow_metrics(scrape)
        self.agents.append(agent)
        await agent.join()
        return agent

    async def ready(self, prefill: int, decode: int) -> None:
        def check() -> bool:
            snap = self.server.registry.snapshot()
            return (
                len(snap.ready_prefill.get(MODEL, ())) == prefill
                and len(snap.ready_decode.get(MODEL, ())) == decode
            )

        await eventually(check, what=f"{prefill}P{decode}D ready")


@contextlib.asynccontextmanager
async def start_cluster(**overrides: Any) -> AsyncIterator[Cluster]:
    server = await start_orchestrator(orch_config(**overrides), shutdown_timeout_s=1.0)
    c = Cluster(server)
    try:
        yield c
    finally:
        for agent in c.agents:
            await agent.close()
        await server.close()


async def complete(
    http: aiohttp.ClientSession,
    cluster: Cluster,
    request_id: str,
    *,
    stream: bool = False,
    max_tokens: int = 8,
    prompt: str = PROMPT,
    extra: dict[str, Any] | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, **(extra or {})}
    async with asyncio.timeout(30):  # a recovery never hangs
        async with http.post(
            f"{cluster.server.url}/v1/completions",
            data=jsonutil.dumps(body),
            headers={"X-Request-Id": request_id},
        ) as resp:
            return resp.status, await resp.read(), dict(resp.headers)


def text_of(raw: bytes, stream: bool) -> str:
    if not stream:
        return str(jsonutil.loads(raw)["choices"][0]["text"])
    parts: list[str] = []
    for line in raw.split(b"\n\n"):
        if line.startswith(b"data: {"):
            chunk = jsonutil.loads(line[6:])
            parts.extend(c["text"] for c in chunk.get("choices", ()))
    return "".join(parts)


async def record(http: aiohttp.ClientSession, cluster: Cluster, request_id: str) -> dict[str, Any]:
    async with http.get(f"{cluster.server.url}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
        assert resp.status == 200
        return dict(await resp.json())


def attempts(rec: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(a["leg"], a["instance"], a["outcome"]) for a in rec["attempts"]]
