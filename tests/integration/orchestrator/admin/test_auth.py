"""The admin API wants its bearer token on every route, on the gateway's port or its own."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ADMIN, ADMIN_TOKEN, free_port
from tests.integration.orchestrator_support import FakeAgent, orch_config
from vllm_disagg.orchestrator.app import ADMIN_APP_KEY, OrchestratorServer, start_orchestrator


def admin_routes(app: web.Application) -> list[tuple[str, str]]:
    """Every (method, path) under /admin/ the app serves, with a sample value for each variable."""
    out = []
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path.startswith("/admin/") and route.method not in ("HEAD", "*"):  # "*": the catch-all
            out.append((route.method, re.sub(r"\{[^}]+\}", "d0", path)))
    return sorted(out)


@pytest.fixture
async def orch_with_agent() -> AsyncIterator[tuple[OrchestratorServer, FakeAgent]]:
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    agent = FakeAgent(server.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode")
    await agent.join()
    try:
        yield server, agent
    finally:
        await agent.close()
        await server.close()


async def call(
    http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with http.request(method, url, headers=headers or {}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing 'Authorization: Bearer"),
        ({"Authorization": "Bearer not-the-token"}, "wrong admin token"),
        ({"Authorization": f"Basic {ADMIN_TOKEN}"}, "wrong admin token"),
        ({"Authorization": f"Bearer {ADMIN_TOKEN}x"}, "wrong admin token"),
    ],
    ids=["no-header", "wrong-token", "wrong-scheme", "token-with-a-suffix"],
)
async def test_every_admin_route_refuses_a_caller_without_the_token_and_changes_nothing(
    orch_with_agent: tuple[OrchestratorServer, FakeAgent],
    http: aiohttp.ClientSession,
    headers: dict[str, str],
    reason: str,
) -> None:
    server, agent = orch_with_agent
    routes = admin_routes(server.app)
    assert ("POST", "/admin/v1/instances/d0/drain") in routes and ("GET", "/admin/v1/instances") in routes
    for method, path in routes:
        status, body, response_headers = await call(http, method, server.url + path, headers)
        assert status == 401, (method, path, body)
        error = body["error"]
        assert isinstance(error, dict) and reason in str(error["message"]), (method, path, body)
        assert error["type"] == "AuthenticationError"
        assert response_headers["WWW-Authenticate"].startswith("Bearer")
    view = server.registry.get("d0")
    assert view is not None and view.state == "ready", "no drain, cordon or shutdown happened"
    assert agent.commands == [], "no command reached the agent"


async def test_with_the_token_the_admin_api_answers(
    orch_with_agent: tuple[OrchestratorServer, FakeAgent], http: aiohttp.ClientSession
) -> None:
    server, _ = orch_with_agent
    status, body, _ = await call(http, "GET", f"{server.url}/admin/v1/instances", ADMIN)
    assert status == 200 and [i["agent_id"] for i in body["instances"]] == ["d0"]
    status, body, _ = await call(http, "POST", f"{server.url}/admin/v1/instances/d0/cordon", ADMIN)
    assert status == 200 and body["instance"]["state"] == "cordoned"


async def test_without_a_configured_token_the_admin_api_is_closed_and_says_how_to_open_it(
    http: aiohttp.ClientSession,
) -> None:
    server = await start_orchestrator(orch_config(admin_token=""), shutdown_timeout_s=1.0)
    try:
        for headers in ({}, ADMIN, {"Authorization": "Bearer "}):
            status, body, _ = await call(http, "GET", f"{server.url}/admin/v1/instances", headers)
            assert status == 401
            assert "--admin-token-file" in str(body["error"]), body
        health = await http.get(f"{server.url}/health")
        assert health.status == 503, "health and metrics stay open"
        assert (await http.get(f"{server.url}/metrics")).status == 200
    finally:
        await server.close()


async def test_the_admin_api_can_listen_apart_from_the_gateway(http: aiohttp.ClientSession) -> None:
    server = await start_orchestrator(orch_config(admin_port=free_port()), shutdown_timeout_s=1.0)
    try:
        assert server.admin_url != server.url
        public, body, _ = await call(http, "GET", f"{server.url}/admin/v1/instances", ADMIN)
        assert public == 404 and "not served on this port" in str(body["error"])
        assert (await http.get(f"{server.url}/metrics")).status == 200
        routes = admin_routes(server.app[ADMIN_APP_KEY])
        assert ("GET", "/admin/v1/instances") in routes
        status, body, _ = await call(http, "GET", f"{server.admin_url}/admin/v1/instances", ADMIN)
        assert status == 200 and body == {"instances": []}
        status, _, _ = await call(http, "GET", f"{server.admin_url}/admin/v1/instances")
        assert status == 401
    finally:
        await server.close()


async def test_the_openapi_document_lists_every_admin_route_and_nothing_else(
    orch_with_agent: tuple[OrchestratorServer, FakeAgent], http: aiohttp.ClientSession
) -> None:
    server, _ = orch_with_agent
    status, doc, _ = await call(http, "GET", f"{server.url}/admin/v1/openapi.json", ADMIN)
    assert status == 200 and doc["openapi"] == "3.1.0"
    paths = doc["paths"]
    assert isinstance(paths, dict)
    documented = sorted(
        (method.upper(), re.sub(r"\{[^}]+\}", "d0", path)) for path, ops in paths.items() for method in ops
    )
    assert documented == admin_routes(server.app)
    drain = paths["/admin/v1/instances/{agent_id}/drain"]["post"]
    assert drain["parameters"] == [
        {"name": "agent_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    assert drain["security"] == [{"bearer": []}] and drain["summary"]
    assert [p["name"] for p in paths["/admin/v1/requests"]["get"]["parameters"]] == ["limit"]
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids)), "operation ids are unique"


async def test_unknown_admin_paths_and_methods_get_the_one_json_error_shape_after_the_token_check(
    orch_with_agent: tuple[OrchestratorServer, FakeAgent], http: aiohttp.ClientSession
) -> None:
    server, _ = orch_with_agent
    status, body, _ = await call(http, "GET", f"{server.url}/admin/v1/nothing-here")
    assert status == 401, "an unknown path tells a stranger nothing"
    status, body, _ = await call(http, "GET", f"{server.url}/admin/v1/nothing-here", ADMIN)
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    status, body, headers = await call(http, "GET", f"{server.url}/admin/v1/instances/d0/drain", ADMIN)
    assert status == 405 and headers["Allow"] == "POST" and "use POST" in body["error"]["message"]


async def test_scheduler_weights_are_read_and_changed_all_or_nothing(
    orch_with_agent: tuple[OrchestratorServer, FakeAgent], http: aiohttp.ClientSession
) -> None:
    server, _ = orch_with_agent
    url = f"{server.url}/admin/v1/scheduler/weights"
    status, body, _ = await call(http, "GET", url, ADMIN)
    before = body["weights"]
    assert status == 200 and before["decode"]["queue-scorer"] == 1.0

    async def put(weights: object) -> tuple[int, dict[str, Any]]:
        async with http.put(url, json={"weights": weights}, headers=ADMIN) as resp:
            return resp.status, await resp.json()

    for bad, reason in (
        ({"decode": {"queue-scorer": 2, "no-such-scorer": 1}}, "no scorer 'no-such-scorer'"),
        ({"decode": {"queue-scorer": -1}}, "a number >= 0"),
        ({"decode": {"queue-scorer": "heavy"}}, "a number >= 0"),
        ({"nowhere": {"queue-scorer": 1}}, "no profile 'nowhere'"),
        ({}, "at least one weight"),
    ):
        status, body = await put(bad)
        assert status == 400 and reason in str(body["error"]), (bad, body)
    assert (await call(http, "GET", url, ADMIN))[1]["weights"] == before, "nothing was applied"
    status, body = await put({"decode": {"queue-scorer": 2.5}, "prefill": {"queue-scorer": 0}})
    assert status == 200
    after = body["weights"]
    assert after["decode"]["queue-scorer"] == 2.5 and after["prefill"]["queue-scorer"] == 0.0
    assert (await call(http, "GET", url, ADMIN))[1]["weights"] == after
