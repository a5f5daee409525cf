"""Adding an instance by URL: ``POST /admin/v1/instances`` (and ``vllm-disagg add``) makes the orchestrator
run ``vllm-disagg connect`` for a running engine, which then serves.

Real parts: an orchestrator, simulated engines (vLLM's API and metric names) on loopback, and the
spawned ``connect`` agents as real processes, which the orchestrator stops when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator_support import MODEL, orch_config
from vllm_disagg.cli import commands as cli
from vllm_disagg.orchestrator.app import SPAWNER_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.curve import make_keypair
from vllm_disagg.sim_engine.engine import ENGINE_KEY

pytestmark = pytest.mark.timeout(300)


async def add(http: aiohttp.ClientSession, server: OrchestratorServer, body: Any) -> tuple[int, Any]:
    async with http.post(f"{server.admin_url}/admin/v1/instances", json=body, headers=ADMIN) as resp:
        return resp.status, await resp.json()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


async def test_an_engine_added_by_url_registers_as_it_is_serves_and_stops_with_the_orchestrator(
    sim_engine: EngineFactory, http: aiohttp.ClientSession
) -> None:
    prefill, decode = await sim_engine(), await sim_engine()
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=2.0)
    try:
        status, body = await add(http, server, {"url": decode.url, "role": "decode", "agent_id": "d-added"})
        assert status == 201, body
        assert body["outcome"] == "registered" and body["agent_id"] == "d-added"
        instance = body["instance"]
        assert (instance["role"], instance["model"], instance["url"]) == ("decode", MODEL, decode.url)
        engine = decode.app[ENGINE_KEY].config  # what the engine runs with, which the agent discovered
        assert (instance["block_size"], instance["max_model_len"]) == (
            engine.timing.block_size,
            engine.max_model_len,
        )

        # The CLI does the same, with the default id ROLE-HOST-PORT.
        out = io.StringIO()
        argv = ["add", prefill.url, "--role", "prefill", "--url", server.admin_url]
        with contextlib.redirect_stdout(out):
            assert await asyncio.to_thread(cli.main, argv) == 0
        p_id = f"prefill-127.0.0.1-{prefill.port}"
        assert out.getvalue().startswith(f"add {p_id}: registered as prefill {MODEL}"), out.getvalue()

        await eventually(
            lambda: (
                len(server.registry.snapshot().ready_prefill.get(MODEL, ())) == 1
                and len(server.registry.snapshot().ready_decode.get(MODEL, ())) == 1
            ),
            what="both added instances ready",
        )
        request = {"model": MODEL, "prompt": "added by url", "max_tokens": 4}
        async with http.post(f"{server.url}/v1/completions", json=request) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-Disagg-Mode"] == "disaggregated"
            assert resp.headers["X-Disagg-Prefill"] == p_id and resp.headers["X-Disagg-Decode"] == "d-added"

        status, body = await add(http, server, {"url": decode.url, "role": "decode", "agent_id": "d-added"})
        assert status == 409 and "is live" in body["error"]["message"], body
        pids = server.app[SPAWNER_KEY].pids()
        assert sorted(pids) == sorted(["d-added", p_id])
    finally:
        await server.close()
    await eventually(
        lambda: all(gone(pid) for pid in pids.values()), what="spawned agents stopped with the orchestrator"
    )


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        ({}, 400, "'url' must be the engine's base URL"),
        ({"url": "ftp://x"}, 400, "'url' must be the engine's base URL"),
        ({"url": "http://127.0.0.1:9", "role": "chef"}, 400, "'role' must be one of"),
        ({"url": "http://127.0.0.1:9", "agent_id": "a b"}, 400, "'agent_id' must be"),
        ({"url": "http://127.0.0.1:9", "colour": "red"}, 400, "unknown fields ['colour']"),
        ({"url": "http://127.0.0.1:9", "role": "decode"}, 422, "unreachable"),
        (
            {"url": "http://203.0.113.5:8000", "role": "decode"},
            422,
            "allow its network with --engine-networks",
        ),
    ],
    ids=[
        "no url",
        "not http",
        "unknown role",
        "bad id",
        "unknown field",
        "nothing listens there",
        "an engine on a network not allowed",
    ],
)
async def test_an_add_that_cannot_work_is_refused_with_the_reason_and_nothing_registers(
    orch: OrchestratorServer, http: aiohttp.ClientSession, body: dict[str, str], status: int, reason: str
) -> None:
    got, answer = await add(http, orch, body)
    assert got == status and reason in answer["error"]["message"], answer
    assert orch.registry.snapshot().instances == ()


async def test_an_engine_whose_role_cannot_be_told_needs_one(
    orch: OrchestratorServer, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    engine = await sim_engine()  # shows NIXL series, says no kv_role (no dev mode)
    status, body = await add(http, orch, {"url": engine.url})
    assert status == 422 and "does not say its kv_role" in body["error"]["message"], body


async def test_with_agent_keys_the_added_agent_gets_a_key_the_orchestrator_admits(
    tmp_path: Path, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    make_keypair(tmp_path, "orchestrator")
    make_keypair(tmp_path / "agents", "someone-else")
    config = orch_config(
        curve_secret_key_file=str(tmp_path / "orchestrator.key_secret"),
        agent_keys_dir=str(tmp_path / "agents"),
    )
    engine = await sim_engine()
    server = await start_orchestrator(config, shutdown_timeout_s=2.0)
    try:
        status, body = await add(http, server, {"url": engine.url, "role": "decode", "agent_id": "keyed-d"})
        assert status == 201 and body["instance"]["state"] in ("joining", "ready"), body
    finally:
        await server.close()
