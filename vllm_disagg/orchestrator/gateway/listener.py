"""The gateway port's listener: a ``server.GatewayProtocol`` per connection, aiohttp's ``fallback``
server for the connections handed over, the connection cap and the deadlines' sweep (``deadlines``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate

from aiohttp import web

from vllm_disagg.orchestrator.gateway.deadlines import CAP, ClientLimits, sweep
from vllm_disagg.orchestrator.gateway.server import GatewayProtocol, Handler


class Clock:
    """The ``Date`` header, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def date(self) -> str:
        now = int(time.time())
        if now != self._second:
            self._second, self._text = now, formatdate(now, usegmt=True)
        return self._text


class GatewayServer:
    """The gateway's listener: ``GatewayProtocol`` per connection, aiohttp's ``fallback`` for the rest."""

    def __init__(
        self,
        routes: Mapping[str, Handler],
        fallback: web.Server,
        max_body_bytes: int,
        limits: ClientLimits | None = None,
        closed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        """``closed(reason)``: a connection was closed on one of ``limits`` (``deadlines``)."""
        self.routes = {path.encode(): handler for path, handler in routes.items()}  # POST path -> handler
        # The first bytes of a request served here; what follows the space is the HTTP version.
        self._lines = tuple(b"POST " + path + b" " for path in self.routes)
        self._longest = max((len(line) for line in self._lines), default=0)
        self.fallback = fallback
        self.max_body_bytes = max_body_bytes
        self.limits = limits or ClientLimits()
        self.closed = closed
        self.connections: set[GatewayProtocol] = set()
        self.clock = Clock()
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(
        self, host: str, port: int, *, reuse_port: bool = False, listen: bool = True
    ) -> tuple[str, int]:
        """Listen on ``host:port`` (0: any free port); the bound address. ``listen=False`` only binds
        (``listen()`` later): a socket bound but not listening holds the port and takes no connection,
        so the kernel hands every one to the gateway workers listening beside it on that port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: GatewayProtocol(self),
            host,
            port,
            reuse_address=True,
            reuse_port=reuse_port or None,
            backlog=1024,
            start_serving=listen,
        )
        self._sweeper = asyncio.create_task(
            sweep(lambda: self.connections, self.limits, self.closed), name="gateway-deadlines"
        )
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def listen(self) -> None:
        """Take connections on the port ``start(listen=False)`` bound."""
        assert self._server is not None, "start first"
        await self._server.start_serving()

    def kind(self, data: bytes) -> bool | None:
        """Is the request that ``data`` begins served here (True) or by aiohttp (False)? None: too
        few bytes to tell."""
        for line in self._lines:
            if data.startswith(line):
                return True
        if len(data) < self._longest and any(line.startswith(data) for line in self._lines):
            return None
        return False

    def admit(self) -> bool:
        """May a new connection be served: fewer than ``limits.max_connections`` open, those handed to
        aiohttp included? One refused is counted."""
        # aiohttp's list is copied on each call: it holds the few admin and metrics connections.
        if len(self.connections) + len(self.fallback.connections) < self.limits.max_connections:
            return True
        self.closed(CAP)
        return False

    def date(self) -> str:
        """The ``Date`` header's value now."""
        return self.clock.date()

    async def close(self, timeout_s: float) -> None:
        """Stop listening, close idle connections, wait up to ``timeout_s`` for requests in flight,
        then close the rest."""
        if self._server is None:
            return
        self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        busy = []
        for conn in list(self.connections):
            if conn.idle_since is not None:
                conn.close()
            else:
                conn.stopping = True  # no keep-alive after the answer in flight
                if conn.active is not None:
                    busy.append(conn.active)
        if busy:
            await asyncio.wait(busy, timeout=timeout_s)
        for conn in list(self.connections):
            conn.abort()
        self._server = None


def gateway_runner(app: web.Application, limits: ClientLimits, shutdown_timeout_s: float) -> web.AppRunner:
    """The aiohttp runner behind the gateway's port: it serves the connections handed over, under
    ``limits.aiohttp_options()``. ``handler_cancellation``: a client that disconnects cancels its
    handler, which closes the engine legs."""
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        **limits.aiohttp_options(),
    )
