"""Rolling model upgrades on real sockets: a new revision joins only once an operator starts a rollout,
the old revision drains out as the new one is ready while requests keep flowing (none fails), and a
rollout pauses and rolls back."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import wait_ready
from tests.integration.orchestrator_support import MODEL, FakeAgent, registered
from vllm_disagg import jsonutil
from vllm_disagg.cli import commands as cli
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.protocol.messages import InstanceInfo, Refuse, Role
from vllm_disagg.sim_engine.textgen import expected_text


async def agent(
    orch: OrchestratorServer, engines: EngineFactory, agent_id: str, role: Role, revision: str
) -> FakeAgent:
    url = (await engines()).url
    info = InstanceInfo(url=url, role=role, model=MODEL, engine="sim", revision=revision)
    return FakeAgent(orch.zmq_endpoint, agent_id, url, role, info=info)


@pytest.fixture
async def revisions(
    orch: OrchestratorServer, sim_engine: EngineFactory
) -> AsyncIterator[tuple[list[FakeAgent], list[FakeAgent]]]:
    """A prefill and a decode instance of revision r1, and of r2; none has said Hello yet."""
    old = [
        await agent(orch, sim_engine, "p-r1", "prefill", "r1"),
        await agent(orch, sim_engine, "d-r1", "decode", "r1"),
    ]
    new = [
        await agent(orch, sim_engine, "p-r2", "prefill", "r2"),
        await agent(orch, sim_engine, "d-r2", "decode", "r2"),
    ]
    yield old, new
    for a in old + new:
        await a.close()


async def load(url: str, stop: asyncio.Event, served: list[tuple[str, str]]) -> None:
    """Completions one after another: (decode instance, "ok" or what went wrong) for each."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        while not stop.is_set():
            prompt = f"request {len(served)} of a rollout"
            body = jsonutil.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 3})
            async with http.post(f"{url}/v1/completions", data=body) as resp:
                raw = await resp.read()
                where = resp.headers.get("X-Disagg-Decode", "")
            ok = resp.status == 200 and jsonutil.loads(raw)["choices"][0]["text"] == expected_text(prompt, 3)
            served.append((where, "ok" if ok else f"{resp.status}: {raw[:200]!r}"))


async def admin(http: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with http.request(method, url, headers=ADMIN, data=jsonutil.dumps(body) if body else None) as resp:
        return resp.status, await resp.json()


def rollout_cli(orch: OrchestratorServer, *args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["rollout", *args, "--url", orch.admin_url]) == 0
    return out.getvalue().strip()


async def test_the_old_revision_drains_out_as_the_new_one_is_ready_and_no_request_fails(
    orch: OrchestratorServer, http: aiohttp.ClientSession, revisions: tuple[list[FakeAgent], list[FakeAgent]]
) -> None:
    old, new = revisions
    stop = asyncio.Event()
    served: list[tuple[str, str]] = []
    try:
        for a in old:
            await a.join()
        await wait_ready(orch, 1, 1)
        refused = await new[0].hello()
        assert isinstance(refused, Refuse) and refused.code == "model_mismatch"
        assert "a new revision joins during a rollout (vllm-disagg rollout --to r2)" in refused.reason

        running = asyncio.ensure_future(load(orch.url, stop, served))
        await eventually(lambda: len(served) > 5 or None, what="load flowing")
        said = await asyncio.to_thread(rollout_cli, orch, "--to", "r2")
        assert said == "rollout sim-model: 'r1' -> 'r2' rolling; drained none; new: none yet"
        await new[1].join()  # a new decode instance: the old decode instance drains
        await eventually(lambda: registered(orch, "d-r1").admin_draining or None, what="d-r1 drained")
        assert not orch.registry.get("p-r1").admin_draining, "one old instance per new one, role by role"  # type: ignore[union-attr]
        while not new[0].inbox.empty():  # what its refused Hellos got back
            new[0].inbox.get_nowait()
        await new[0].join()

        async def complete() -> dict[str, Any] | None:
            _, body = await admin(http, "GET", f"{orch.admin_url}/admin/v1/rollouts")
            (rollout,) = body["rollouts"]
            return rollout if rollout["phase"] == "complete" else None

        rollout = await eventually(complete, what="the rollout complete")
        mark = len(served)
        await eventually(lambda: len(served) > mark + 5 or None, what="load after the rollout")
        stop.set()
        await running
        assert sorted(rollout["drained"]) == ["d-r1", "p-r1"]
        assert all(outcome == "ok" for _, outcome in served), [o for o in served if o[1] != "ok"][:3]
        assert {where for where, _ in served[mark + 1 :]} == {"d-r2"}, "the new revision takes all the load"
        assert [c.kind for c in old[1].commands] == ["drain"], "the drained agent was told"
        async with http.get(f"{orch.admin_url}/admin/v1/events?follow=false", headers=ADMIN) as resp:
            events = (await resp.text()).replace(" ", "")
        for what in ("started", "drained", "complete"):
            assert f'"what":"{what}"' in events
    finally:
        stop.set()


async def test_a_paused_rollout_waits_and_a_rollback_brings_the_old_revision_back(
    orch: OrchestratorServer, http: aiohttp.ClientSession, revisions: tuple[list[FakeAgent], list[FakeAgent]]
) -> None:
    old, new = revisions
    stop = asyncio.Event()
    served: list[tuple[str, str]] = []
    try:
        for a in old:
            await a.join()
        await wait_ready(orch, 1, 1)
        running = asyncio.ensure_future(load(orch.url, stop, served))
        status, started = await admin(http, "POST", f"{orch.admin_url}/admin/v1/rollouts", {"to": "r2"})
        assert (status, started["phase"]) == (201, "rolling")
        assert (await admin(http, "POST", f"{orch.admin_url}/admin/v1/rollouts", {"to": "r3"}))[0] == 409
        assert await asyncio.to_thread(rollout_cli, orch, "--pause") == (
            "rollout sim-model: 'r1' -> 'r2' paused; drained none; new: none yet"
        )
        for a in new:
            await a.join()
        await wait_ready(orch, 2, 2)
        seen = len(served)
        await eventually(lambda: len(served) > seen + 10 or None, what="requests while paused")
        assert not any(orch.registry.get(i).admin_draining for i in ("p-r1", "d-r1"))  # type: ignore[union-attr]
        await asyncio.to_thread(rollout_cli, orch, "--resume")
        await eventually(lambda: registered(orch, "d-r1").admin_draining or None, what="draining resumed")

        said = await asyncio.to_thread(rollout_cli, orch, "--rollback")
        assert said.startswith("rollout sim-model: 'r1' -> 'r2' rolling_back; drained none")

        async def rolled_back() -> dict[str, Any] | None:
            _, body = await admin(http, "GET", f"{orch.admin_url}/admin/v1/rollouts")
            (rollout,) = body["rollouts"]
            return rollout if rollout["phase"] == "rolled_back" else None

        rollout = await eventually(rolled_back, what="rolled back")
        assert sorted(rollout["held"]) == ["d-r2", "p-r2"]
        assert not any(orch.registry.get(i).admin_draining for i in ("p-r1", "d-r1"))  # type: ignore[union-attr]
        mark = len(served)
        await eventually(lambda: len(served) > mark + 5 or None, what="load after the rollback")
        stop.set()
        await running
        assert all(outcome == "ok" for _, outcome in served), [o for o in served if o[1] != "ok"][:3]
        assert {where for where, _ in served[mark + 1 :]} == {"d-r1"}, "back on the old revision"
    finally:
        stop.set()
