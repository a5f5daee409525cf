"""Changing an instance's role at runtime: ``POST /admin/v1/instances/{id}/role`` (and ``vllm-disagg
role``). The agent checks its engine can serve the role; then the instance serves so at once, in the
same session (its requests go on), and the change is an event and a metric."""

from __future__ import annotations

import asyncio
import contextlib
import io

import aiohttp

from tests.helpers import ADMIN, eventually, metric_sum, parse_prometheus
from tests.integration.conftest import AgentFactory
from tests.integration.orchestrator_support import MODEL
from vllm_disagg.cli import commands as cli
from vllm_disagg.orchestrator.app import OrchestratorServer


async def post_role(
    http: aiohttp.ClientSession, server: OrchestratorServer, agent_id: str, body: object
) -> tuple[int, dict]:  # type: ignore[type-arg]
    url = f"{server.admin_url}/admin/v1/instances/{agent_id}/role"
    async with http.post(url, json=body, headers=ADMIN) as resp:
        return resp.status, await resp.json()


async def test_a_role_change_is_checked_by_the_agent_then_served_in_the_same_session(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    d0 = await fake_agent("d0", "http://127.0.0.1:9", "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode.get(MODEL), what="d0 ready")
    session = orch.registry.get("d0").session  # type: ignore[union-attr]

    d0.role_refusal = "the engine was launched with kv_role kv_consumer"
    status, body = await post_role(http, orch, "d0", {"role": "prefill"})
    assert status == 409 and "kv_consumer" in body["error"]["message"], body
    assert orch.registry.get("d0").info.role == "decode"  # type: ignore[union-attr]

    d0.role_refusal = ""
    status, body = await post_role(http, orch, "d0", {"role": "prefill"})
    assert status == 200 and (body["from"], body["role"]) == ("decode", "prefill"), body
    view = orch.registry.get("d0")
    assert view is not None and view.info.role == "prefill" and view.session == session
    snap = orch.registry.snapshot()
    assert [v.agent_id for v in snap.ready_prefill.get(MODEL, ())] == ["d0"] and not snap.ready_decode.get(
        MODEL
    )
    assert d0.commands[-1].kind == "set_role" and d0.commands[-1].args == {"role": "prefill"}

    async with http.get(f"{orch.url}/metrics") as resp:
        samples = parse_prometheus(await resp.text())
    changes = {"instance": "d0", "from_role": "decode", "to_role": "prefill"}
    assert metric_sum(samples, "vllm_disagg_role_changes_total", **changes) == 1
    async with http.get(f"{orch.admin_url}/admin/v1/events?follow=false", headers=ADMIN) as resp:
        events = await resp.text()
    assert "event: role" in events and '"from":"decode","to":"prefill"' in events.replace(" ", ""), events

    # The CLI, back to decode.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await asyncio.to_thread(cli.main, ["role", "d0", "decode", "--url", orch.admin_url]) == 0
    assert out.getvalue().strip() == "role d0: prefill -> decode (pinned)"
    view = orch.registry.get("d0")
    assert view is not None and view.info.role == "decode" and view.role_pinned, "the planner leaves it"

    # auto: the same role, handed back to the planner.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert await asyncio.to_thread(cli.main, ["role", "d0", "auto", "--url", orch.admin_url]) == 0
    assert out.getvalue().strip() == "role d0: decode -> decode (the planner may move it)"
    view = orch.registry.get("d0")
    assert view is not None and view.info.role == "decode" and not view.role_pinned


async def test_a_bad_role_request_is_refused_and_nothing_changes(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    await fake_agent("d0", "http://127.0.0.1:9", "decode")
    for body in ({"role": "chef"}, {}, ["decode"]):
        status, answer = await post_role(http, orch, "d0", body)
        assert status == 400 and "'role' must be one of" in answer["error"]["message"], answer
    status, answer = await post_role(http, orch, "nobody", {"role": "decode"})
    assert status == 404, answer
    assert orch.registry.get("d0").info.role == "decode"  # type: ignore[union-attr]
