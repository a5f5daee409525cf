"""The admin API's live views: the event stream (SSE) and the requests in flight."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator_support import MODEL, FakeAgent, fake_engine, orch_config
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import start_orchestrator


async def sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The data of each server-sent event, as it arrives."""
    fields: dict[str, str] = {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if "data" in fields:
                yield {**json.loads(fields["data"]), "_id": fields.get("id"), "_event": fields.get("event")}
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value


async def next_of(events: AsyncIterator[dict[str, Any]], instance: str, kinds: set[str]) -> dict[str, Any]:
    async with asyncio.timeout(30):
        async for event in events:
            if event.get("instance") == instance and event["kind"] in kinds:
                return event
    raise AssertionError("the stream ended")


async def test_the_event_stream_tells_joins_state_changes_and_deaths_as_they_happen(
    http: aiohttp.ClientSession,
) -> None:
    server = await start_orchestrator(orch_config(heartbeat_timeout_s=1.0), shutdown_timeout_s=1.0)
    agent = FakeAgent(server.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode")
    try:
        async with http.get(f"{server.url}/admin/v1/events", headers=ADMIN) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
            events = sse(resp)
            await agent.join()
            joined = await next_of(events, "d0", {"joined"})
            assert (joined["role"], joined["model"], joined["session"]) == ("decode", MODEL, 1)
            assert (await next_of(events, "d0", {"state"}))["to"] in ("joining", "ready")
            await eventually(lambda: server.registry.snapshot().ready_decode, what="d0 ready")
            async with http.post(f"{server.url}/admin/v1/instances/d0/cordon", headers=ADMIN) as r:
                assert r.status == 200
            moved = await next_of(events, "d0", {"state"})
            while moved["to"] != "cordoned":
                moved = await next_of(events, "d0", {"state"})
            agent.stop_heartbeats()  # the agent goes silent
            dead = await next_of(events, "d0", {"state"})
            while dead["to"] != "dead":
                dead = await next_of(events, "d0", {"state"})
            assert "no heartbeat" in dead["reason"]
            last_id = int(dead["_id"])
        # A client that comes back with Last-Event-ID gets what it missed, and only that.
        headers = {**ADMIN, "Last-Event-ID": str(last_id - 1)}
        async with http.get(f"{server.url}/admin/v1/events?follow=false", headers=headers) as resp:
            replay = [e async for e in sse(resp)]
        assert [int(e["_id"]) for e in replay] == [last_id]
        async with http.get(f"{server.url}/admin/v1/events?since=x", headers=ADMIN) as resp:
            assert resp.status == 400
    finally:
        await agent.close()
        await server.close()


async def test_a_supervisor_notes_a_restart_in_the_event_log_and_bad_notes_are_refused(
    http: aiohttp.ClientSession,
) -> None:
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    url = f"{server.url}/admin/v1/events"
    note = {
        "process": "agent decode-0",
        "action": "restarted",
        "message": "exited (code -9)",
        "exit_code": -9,
    }
    try:
        async with http.post(url, json=note) as resp:
            assert resp.status == 401, "an unauthenticated peer writes nothing"
        async with http.post(url, json={**note, "restarts": 2}, headers=ADMIN) as resp:
            assert resp.status == 201
            posted = await resp.json()
        assert (posted["kind"], posted["process"], posted["restarts"]) == ("supervisor", "agent decode-0", 2)
        async with http.get(f"{url}?follow=false", headers=ADMIN) as resp:
            kept = [e async for e in sse(resp)]
        assert [(e["kind"], e["message"], e["exit_code"]) for e in kept] == [
            ("supervisor", "exited (code -9)", -9)
        ]
        bad = [
            ({**note, "action": "rebooted"}, "'action' must be one of"),
            ({**note, "message": ""}, "'message' must be a non-empty string"),
            ({**note, "exit_code": "9"}, "'exit_code' must be an integer"),
            ({**note, "colour": "red"}, "unknown field(s) ['colour']"),
            ([note], "must be a JSON object"),
        ]
        for body, reason in bad:
            async with http.post(url, json=body, headers=ADMIN) as resp:
                assert resp.status == 400 and reason in (await resp.json())["error"]["message"], body
    finally:
        await server.close()


async def test_live_requests_show_each_request_in_flight_with_its_stage_pair_and_age(
    http: aiohttp.ClientSession,
) -> None:
    release = asyncio.Event()

    async def decode(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"choices": [{"text": " ok"}]})

    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    agent = None
    try:
        async with fake_engine(decode) as d:
            agent = FakeAgent(server.zmq_endpoint, "d0", d.url, "decode")
            await agent.join()
            await eventually(lambda: server.registry.snapshot().ready_decode, what="d0 ready")
            body = jsonutil.dumps({"model": MODEL, "prompt": "wait for me", "max_tokens": 2})
            request = asyncio.ensure_future(
                http.post(f"{server.url}/v1/completions", data=body, headers={"X-Request-Id": "slow-1"})
            )

            async def live() -> list[dict[str, Any]] | None:
                async with http.get(f"{server.url}/admin/v1/live-requests", headers=ADMIN) as r:
                    found: list[dict[str, Any]] = (await r.json())["requests"]
                return found or None

            (item,) = await eventually(live, what="the request in flight")
            assert (item["client_request_id"], item["mode"], item["decode"], item["stage"]) == (
                "slow-1",
                "colocated",
                "d0",
                "decode_start",
            )
            assert item["age_s"] >= 0 and item["stream"] is False
            release.set()
            async with await request as resp:
                assert resp.status == 200
            async with http.get(f"{server.url}/admin/v1/live-requests", headers=ADMIN) as r:
                assert (await r.json())["requests"] == []
    finally:
        if agent is not None:
            await agent.close()
        await server.close()
