"""``/dashboard`` is served where the admin API is, as static files a browser always revalidates."""

from __future__ import annotations

import aiohttp
import pytest

from tests.helpers import free_port
from tests.integration.orchestrator_support import orch_config
from vllm_disagg.orchestrator.app import start_orchestrator


@pytest.mark.parametrize(
    ("path", "content_type", "needle"),
    [
        ("/dashboard", "text/html", "dashboard.js"),
        ("/dashboard/dashboard.js", "text/javascript", "/admin/v1/instances"),
        ("/dashboard/dashboard.js", "text/javascript", "/admin/v1/admission"),
        ("/dashboard/dashboard.css", "text/css", "--ready"),
    ],
    ids=["page-is-html", "script-is-javascript", "script-reads-the-admission-queue", "style-sheet-is-css"],
)
async def test_the_dashboard_files_are_served_on_the_main_app_without_a_token(
    http: aiohttp.ClientSession, path: str, content_type: str, needle: str
) -> None:
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    try:
        async with http.get(server.url + path) as resp:  # no Authorization: the page holds no data
            assert resp.status == 200
            assert resp.content_type == content_type and resp.charset == "utf-8"
            assert resp.headers["Cache-Control"] == "no-cache"
            assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
            assert needle in await resp.text()
    finally:
        await server.close()


async def test_a_trailing_slash_redirects_to_the_page(http: aiohttp.ClientSession) -> None:
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    try:
        async with http.get(server.url + "/dashboard/", allow_redirects=False) as resp:
            assert resp.status == 308 and resp.headers["Location"] == "/dashboard"
    finally:
        await server.close()


async def test_with_an_admin_port_the_dashboard_is_on_the_admin_listener_and_404_on_the_public_one(
    http: aiohttp.ClientSession,
) -> None:
    server = await start_orchestrator(orch_config(admin_port=free_port()), shutdown_timeout_s=1.0)
    try:
        assert server.admin_url != server.url
        async with http.get(server.admin_url + "/dashboard") as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
        for path in ("/dashboard", "/dashboard/dashboard.js"):
            async with http.get(server.url + path) as resp:
                assert resp.status == 404, path
    finally:
        await server.close()
