"""A role change that restarts the engine (what a vLLM launched ``kv_producer`` or ``kv_consumer``
needs): the instance is drained, its agent restarts the engine with the new role, and it is routed to
once the new engine is ready, in the same session. A stream in flight finishes where it is; one that
outlives the drain's timeout is resumed elsewhere. No request fails.

Real agents (``agent.main.serve``) launch real simulated engines here, with ``role_switch: restart``
(the simulator itself could switch by routing); tests/e2e/vllm/nixl/test_roles.py does it with real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.helpers import ADMIN, eventually, free_ports
from tests.integration.orchestrator_support import MODEL, orch_config, registered, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.agent.main import serve
from vllm_disagg.config import AgentConfig, SimTiming
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import Role
from vllm_disagg.sim_engine.textgen import expected_text

PROMPT = "a prompt for a role change that restarts the engine: "
TIMING = SimTiming(decode_step_s=0.02)  # a 100-token stream lasts about 2 s


@dataclass
class Cluster:
    """An orchestrator and real agents, each launching its simulated engine."""

    orch: OrchestratorServer
    urls: dict[str, str] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def cluster(roles: dict[str, Role], **overrides: Any) -> AsyncIterator[Cluster]:
    orch = await start_orchestrator(orch_config(**overrides), shutdown_timeout_s=2.0)
    stop = asyncio.Event()
    agents = []
    c = Cluster(orch)
    try:
        for agent_id, role in roles.items():
            port = free_ports(1, offsets=(0, 2000))  # the engine's and its KV events'
            cfg = AgentConfig(
                agent_id=agent_id, role=role, orchestrator=orch.zmq_endpoint, model=MODEL,
                engine_port=port, scrape_interval_s=0.05, sim=TIMING, role_switch="restart",
                stop_grace_s=2.0,
            )  # fmt: skip
            agents.append(asyncio.create_task(serve(cfg, stop)))
            c.urls[agent_id] = cfg.engine_url
        yield c
    finally:
        stop.set()
        await asyncio.gather(*agents, return_exceptions=True)
        await orch.close()


async def ready(orch: OrchestratorServer, prefill: int, decode: int) -> None:
    def check() -> bool:
        snap = orch.registry.snapshot()
        return (
            len(snap.ready_prefill.get(MODEL, ())) == prefill
            and len(snap.ready_decode.get(MODEL, ())) == decode
        )

    await eventually(check, timeout=60, what=f"{prefill}P{decode}D ready")


async def post_role(
    http: aiohttp.ClientSession, orch: OrchestratorServer, agent_id: str, role: str
) -> tuple[int, Any]:
    url = f"{orch.admin_url}/admin/v1/instances/{agent_id}/role"
    async with http.post(url, json={"role": role}, headers=ADMIN) as resp:
        return resp.status, await resp.json()


@contextlib.asynccontextmanager
async def stream(
    http: aiohttp.ClientSession, orch: OrchestratorServer, max_tokens: int
) -> AsyncIterator[aiohttp.ClientResponse]:
    """A streamed completion whose first event has arrived (it is on a decode instance)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(body)) as resp:
        assert resp.status == 200
        yield resp


async def rest_of(resp: aiohttp.ClientResponse, first: bytes) -> str:
    """The whole text of a stream whose first line was ``first``, checked to end with [DONE]."""
    raw = first + await resp.content.read()
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-300:]
    return "".join(c["text"] for e in events[:-1] for c in jsonutil.loads(e)["choices"])


def decoding(orch: OrchestratorServer) -> str | None:
    """The decode instance a request is on now."""
    snap = orch.registry.snapshot()
    return next((v.agent_id for v in snap.ready_decode.get(MODEL, ()) if snap.in_flight_of(v.agent_id)), None)


async def events_of(http: aiohttp.ClientSession, orch: OrchestratorServer, kind: str) -> list[dict[str, Any]]:
    async with http.get(f"{orch.admin_url}/admin/v1/events?follow=false", headers=ADMIN) as resp:
        text = await resp.text()
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if lines.get("event") == kind:
            out.append(jsonutil.loads(lines["data"]))
    return out


async def engine_requests(http: aiohttp.ClientSession, url: str) -> float:
    """Requests the engine at ``url`` finished in its life (``vllm:request_success_total``)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


@dataclass
class Streaming:
    """A 1P2D cluster with a stream under way on one decode instance, ``mover``."""

    c: Cluster
    http: aiohttp.ClientSession
    resp: aiohttp.ClientResponse
    first: bytes  # the stream's first line, read
    mover: str

    async def rest(self) -> str:
        """The stream's whole text, once it ends."""
        return await rest_of(self.resp, self.first)


@contextlib.asynccontextmanager
async def a_stream_on_a_decode_instance(max_tokens: int, **overrides: Any) -> AsyncIterator[Streaming]:
    async with (
        cluster({"p0": "prefill", "d0": "decode", "d1": "decode"}, **overrides) as c,
        aiohttp.ClientSession() as http,
    ):
        await ready(c.orch, 1, 2)
        async with stream(http, c.orch, max_tokens) as resp:
            first = await resp.content.readline()
            mover = await eventually(lambda: decoding(c.orch), what="the stream on a decode instance")
            yield Streaming(c, http, resp, first, mover)


async def test_a_restart_drains_the_instance_restarts_its_engine_as_the_new_role_and_no_stream_fails() -> (
    None
):
    async with a_stream_on_a_decode_instance(100) as s:
        c, http, orch, mover = s.c, s.http, s.c.orch, s.mover
        session = orch.registry.get(mover).session  # type: ignore[union-attr]
        change = asyncio.create_task(post_role(http, orch, mover, "prefill"))
        await eventually(lambda: registered(orch, mover).state == "draining", what="drained")
        assert not change.done(), "the restart waits for the stream"
        assert await s.rest() == expected_text(PROMPT, 100), "the stream finished where it was"
        status, body = await change
        assert status == 200 and (body["from"], body["role"], body["how"]) == (
            "decode",
            "prefill",
            "restart",
        ), body
        steps = body["timeline"]
        assert 0 < steps["drained"] <= steps["restarting"] <= steps["ready"], steps

        view = orch.registry.get(mover)
        assert view is not None and (view.info.role, view.state, view.session) == (
            "prefill",
            "ready",
            session,
        )
        assert await engine_requests(http, c.urls[mover]) == 0, "a new engine: it has served nothing yet"
        restarts = await events_of(http, orch, "role_restart")
        assert [(e["instance"], e["step"]) for e in restarts] == [
            (mover, s) for s in ("draining", "restarting", "ready")
        ]
        assert restarts[-1]["timeline"] == steps and "left_in_flight" not in restarts[-1]

        await ready(orch, 2, 1)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(body)) as resp:
            assert resp.status == 200 and resp.headers["X-Disagg-Mode"] == "disaggregated"
            assert (await resp.json())["choices"][0]["text"] == expected_text(PROMPT, 4)
        samples = await scrape(http, orch.url)
        assert sample(samples, "vllm_disagg_role_change_seconds_count", how="restart") == 1
        assert (
            sample(
                samples,
                "vllm_disagg_role_changes_total",
                instance=mover,
                from_role="decode",
                to_role="prefill",
            )
            == 1
        )


async def test_a_stream_that_outlives_the_drain_is_resumed_elsewhere_and_finishes() -> None:
    async with a_stream_on_a_decode_instance(150, role_drain_timeout_s=0.3) as s:
        http, orch = s.http, s.c.orch
        status, body = await post_role(http, orch, s.mover, "prefill")
        assert status == 200 and body["how"] == "restart", body
        assert await s.rest() == expected_text(PROMPT, 150), "resumed, not failed"
        restarts = await events_of(http, orch, "role_restart")
        assert [e.get("left_in_flight", 0) for e in restarts if e["step"] == "restarting"] == [1]
        async with http.get(f"{orch.admin_url}/admin/v1/events?follow=false", headers=ADMIN) as resp:
            assert "event: resume" in await resp.text()


async def test_an_instance_mid_change_refuses_another_change() -> None:
    async with a_stream_on_a_decode_instance(100, role_drain_timeout_s=30.0) as s:
        http, orch, mover = s.http, s.c.orch, s.mover
        change = asyncio.create_task(post_role(http, orch, mover, "prefill"))
        await eventually(lambda: registered(orch, mover).state == "draining", what="drained")
        status, body = await post_role(http, orch, mover, "both")
        assert status == 409 and "under way" in body["error"]["message"], body
        await s.rest()
        status, body = await change
        assert status == 200 and body["role"] == "prefill"
