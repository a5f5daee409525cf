"""The KV-link warm-up against engines on loopback: a fresh NIXL pair is routed to only after one
disaggregated request went through it; a failed warm-up is retried, its engine's words logged; an
instance with nobody to pair with is ready at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.helpers import eventually
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.kv_warmup import KvLinkWarmup
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, Role

pytestmark = pytest.mark.asyncio

HANDLE = {"do_remote_prefill": True, "remote_engine_id": "p-engine", "remote_block_ids": [3, 4]}


@dataclass
class Engine:
    """A vLLM-shaped ``/v1/completions`` that records each body; the first ``fail`` calls get a 500."""

    fail: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if len(self.bodies) <= self.fail:
            return web.json_response({"error": {"message": "NIXL handshake timed out"}}, status=500)
        answer: dict[str, Any] = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = HANDLE
        return web.json_response(answer)


Start = Callable[[Engine], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Start]:
    servers: list[TestServer] = []

    async def start(engine: Engine) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", engine.completions)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def warmup() -> AsyncIterator[tuple[Registry, OrchestratorMetrics]]:
    registry = Registry(heartbeat_timeout_s=60.0, prove_kv_links=True)
    metrics = OrchestratorMetrics(registry.snapshot)
    config = OrchestratorConfig(engine_api_key="engine-key-0123456789")
    task = asyncio.create_task(KvLinkWarmup(registry, config, metrics).run())
    yield registry, metrics
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def join(registry: Registry, agent_id: str, role: Role, url: str) -> None:
    info = InstanceInfo(
        url=url, role=role, model="m", engine="vllm", kv_connector="NixlConnector", block_size=16
    )
    registry.hello(agent_id, info, 0.0)
    registry.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready"), 0.0)


def state(registry: Registry, agent_id: str) -> str:
    view = registry.get(agent_id)
    assert view is not None
    return view.state


def warmups(metrics: OrchestratorMetrics, outcome: str) -> float:
    for family in metrics.families():
        for sample in family.samples:
            if sample.name == "vllm_disagg_kv_link_warmups_total" and sample.labels["outcome"] == outcome:
                return sample.value
    return 0.0


async def test_a_fresh_pair_is_ready_once_one_request_moved_kv_between_them(
    serve: Start, warmup: tuple[Registry, OrchestratorMetrics]
) -> None:
    registry, metrics = warmup
    p, d = Engine(), Engine()
    join(registry, "p0", "prefill", await serve(p))
    join(registry, "d0", "decode", await serve(d))
    await eventually(lambda: state(registry, "d0") == state(registry, "p0") == "ready", what="both ready")
    (prefill,), (decode,) = p.bodies, d.bodies
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["kv_transfer_params"] == HANDLE  # the prefill's handle, as the gateway passes it
    assert prefill["prompt"] == decode["prompt"] and len(prefill["prompt"]) > 16  # a whole block moves
    assert prefill["max_tokens"] == decode["max_tokens"] == 1
    assert p.headers[0]["x-request-id"] == d.headers[0]["x-request-id"]
    assert d.headers[0]["authorization"] == "Bearer engine-key-0123456789"
    assert warmups(metrics, "ok") == 1


async def test_a_failed_warm_up_keeps_the_instance_joining_and_is_tried_again(
    serve: Start, warmup: tuple[Registry, OrchestratorMetrics], caplog: pytest.LogCaptureFixture
) -> None:
    registry, metrics = warmup
    p, d = Engine(), Engine(fail=1)
    join(registry, "p0", "prefill", await serve(p))
    join(registry, "d0", "decode", await serve(d))
    await eventually(lambda: warmups(metrics, "failed") == 1, what="the first warm-up failing")
    assert state(registry, "d0") == "joining"  # not routed to while its link is unproven
    await eventually(lambda: state(registry, "d0") == "ready", what="d0 ready after a retry")
    assert warmups(metrics, "ok") == 1 and len(d.bodies) == 2
    assert "NIXL handshake timed out" in caplog.text  # the engine's own words, in the log


async def test_an_instance_with_nobody_to_pair_with_is_ready_at_once_and_proves_the_next_one(
    serve: Start, warmup: tuple[Registry, OrchestratorMetrics]
) -> None:
    registry, metrics = warmup
    p, d = Engine(), Engine()
    join(registry, "p0", "prefill", await serve(p))
    await eventually(lambda: state(registry, "p0") == "ready", what="p0 ready without a partner")
    assert p.bodies == []
    join(registry, "d0", "decode", await serve(d))
    await eventually(lambda: state(registry, "d0") == "ready", what="d0 ready")
    assert len(p.bodies) == len(d.bodies) == 1  # d0's link proven with p0
    assert warmups(metrics, "ok") == 1
