"""The OpenAI-compatible routes: handlers only, each a call into the gateway service.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are ``service.Gateway.serve``;
``GET /v1/models`` lists what the registry says is served. The POST routes reach their handlers three
ways, all here: the port's own HTTP server (``fast``: ``server.GatewayServer``), aiohttp's server past
its router (``route_directly``), and aiohttp's router (``add_to``, which also serves ``/v1/models``).
"""

from __future__ import annotations

import functools
from typing import cast

from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.gateway.parsing import PATHS
from vllm_disagg.orchestrator.gateway.server import Handler
from vllm_disagg.orchestrator.gateway.service import Gateway


class OpenAIRoutes:
    """The OpenAI routes of one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._serve = gateway.serve

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` (through aiohttp)."""
        return cast(web.StreamResponse, await self._serve(request, "completions"))  # not a FastStream

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` (through aiohttp)."""
        return cast(web.StreamResponse, await self._serve(request, "chat_completions"))

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: models served by at least one ready instance."""
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "vllm-disagg"}
            for m in self._gateway.registry.snapshot().ready_models()
        ]
        return web.Response(
            body=jsonutil.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    def fast(self) -> dict[str, Handler]:
        """The routes the gateway's own server (``server.GatewayServer``) serves: POST path -> handler.
        Each is ``serve`` itself, its route bound: no coroutine of ours in between."""
        return {path: functools.partial(self._serve, route=route) for route, path in PATHS.items()}

    def add_to(self, app: web.Application) -> None:
        """Register the OpenAI routes on ``app``."""
        app.router.add_post(PATHS["completions"], self.completions)
        app.router.add_post(PATHS["chat_completions"], self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    def route_directly(self, server: web.Server, app: web.Application) -> None:
        """Hand ``POST /v1/completions`` and ``/v1/chat/completions`` from ``server`` (serving ``app``)
        straight to their handlers, past the application's router: its resolve, match info and
        handler lookup are about a tenth of a plain request's CPU in the gateway. The handlers read
        neither ``request.app`` nor ``match_info``. Anything else (a query string, ``Expect``, another
        method or path) goes through ``app`` as before, and so does everything when ``app`` has
        middlewares (they must see every request)."""
        if app.middlewares:
            return
        through_app = server.request_handler
        direct = {PATHS["completions"]: self.completions, PATHS["chat_completions"]: self.chat_completions}

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            if request.method == "POST" and "Expect" not in request.headers:
                handler = direct.get(request.raw_path)  # a query string makes it another key
                if handler is not None:
                    return await handler(cast(web.Request, request))
            return await through_app(request)

        server.request_handler = handle
