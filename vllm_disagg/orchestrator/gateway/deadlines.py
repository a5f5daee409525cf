"""Slow clients on the gateway's port: the deadlines of a request's head and body, the write timeout,
the connection cap, and the periodic sweep that enforces them (docs/operations.md, "Slow clients").

One byte per socket at a time would otherwise hold a connection for ever (slowloris), and a client that
never reads its stream would hold its engine legs. A timer per request would cost CPU on every request
(the gateway's CPU per request is benchmarked), so a connection only notes the loop time when it enters
a state (head awaited, body awaited, writing stalled, idle), and one sweep per process looks at every
connection a few times per shortest deadline: a deadline is kept to within a quarter of itself.

The head deadline runs from a new connection's accept, or from the first byte of a later request; the
body's from the end of its head, and grows by a second per ``body_min_rate`` bytes received (as
Apache's ``mod_reqtimeout``): a large body sent at any steady pace above the rate goes through, one
dribbled slower is cut. Both are answered 408 where nothing is being answered on the connection, then
closed. A write is stalled from the transport's ``pause_writing`` (its buffer over the high-water mark:
the client reads slower than the gateway writes) to its ``resume_writing``, and a connection closing
while its answer is still buffered counts as stalled too; stalled past ``write_timeout_s``, the
connection is dropped, which cancels the request's handler and so its engine legs.

Connections handed to aiohttp (any other path: admin API, dashboard, ``/metrics``) count toward the cap.
The head that made the hand-over was read here, under the head deadline; aiohttp has no head deadline
of its own, but its ``keepalive_timeout`` (set to ``keepalive_s`` by ``aiohttp_options``; aiohttp's
own default is an hour) closes a connection on which no whole request arrived within it of the previous
answer, which bounds a later request's head. Not shorter: the gateway workers' pooled connections to the
orchestrator's listener (15 s idle in aiohttp's client) would race the server's close. aiohttp has no
body deadline or write timeout: bodies there are bounded by ``client_max_size``, and the number of such
connections by the cap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import RequestTimeout

if TYPE_CHECKING:
    from vllm_disagg.orchestrator.gateway.server import GatewayProtocol

log = logging.getLogger(__name__)

# Why a connection was closed on a limit: the ``reason`` label of vllm_disagg_client_connections_closed.
HEAD_TIMEOUT: Final = "head_timeout"
BODY_TIMEOUT: Final = "body_timeout"
WRITE_TIMEOUT: Final = "write_timeout"
CAP: Final = "cap"
_IDLE: Final = "idle"  # keep-alive expiry: ordinary, not counted

_SWEEP_S = 5.0  # the longest gap between sweeps (idle connections need no finer look)


@dataclass(frozen=True)
class ClientLimits:
    """What the gateway's server allows a client connection (``OrchestratorConfig``'s ``client_*``)."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 20.0
    body_min_rate: float = 500.0  # bytes/s
    write_timeout_s: float = 30.0
    max_connections: int = 4096
    keepalive_s: float = 75.0  # an idle connection is closed after this (aiohttp's default for run_app)

    @classmethod
    def of(cls, config: OrchestratorConfig) -> ClientLimits:
        """The limits ``config`` sets."""
        return cls(
            head_timeout_s=config.client_head_timeout_s,
            body_timeout_s=config.client_body_timeout_s,
            body_min_rate=config.client_body_min_rate,
            write_timeout_s=config.client_write_timeout_s,
            max_connections=config.max_client_connections,
        )

    def sweep_s(self) -> float:
        """How often connections are looked at: a quarter of the shortest deadline, at most ``_SWEEP_S``."""
        shortest = min(self.head_timeout_s, self.body_timeout_s, self.write_timeout_s, self.keepalive_s)
        return min(_SWEEP_S, shortest / 4)

    def aiohttp_options(self) -> dict[str, Any]:
        """``web.AppRunner`` options for the connections aiohttp serves on the gateway's port (see the
        module's docstring: its keep-alive timeout also bounds a later request's head)."""
        return {"keepalive_timeout": self.keepalive_s}


def overdue(conn: GatewayProtocol, now: float, limits: ClientLimits) -> str | None:
    """The limit ``conn`` is past at loop time ``now``, if any."""
    stalled = conn.stalled_since
    if stalled is not None and now - stalled > limits.write_timeout_s:
        return WRITE_TIMEOUT
    if conn.reading_paused:  # the server stopped reading, not the client: no read deadline runs
        return None
    head = conn.head_since
    if head is not None and now - head > limits.head_timeout_s:
        return HEAD_TIMEOUT
    body = conn.body_since
    if body is not None and now - body > limits.body_timeout_s + conn.body_received / limits.body_min_rate:
        return BODY_TIMEOUT
    idle = conn.idle_since
    if idle is not None and now - idle > limits.keepalive_s:
        return _IDLE
    return None


def enforce(conn: GatewayProtocol, reason: str) -> None:
    """Act on ``reason``: drop a stalled writer, answer 408 to a slow head or body, close an idle one."""
    if reason == WRITE_TIMEOUT:
        conn.abort()  # its handler is cancelled, and with it the engine legs
    elif reason == _IDLE or conn.idle_since is not None:  # a new connection that never sent a byte
        conn.close()
    elif reason == HEAD_TIMEOUT:
        conn.refuse(RequestTimeout("the request's line and headers did not arrive in time"))
    else:
        conn.refuse(RequestTimeout("the request body arrived too slowly"))


async def sweep(
    connections: Callable[[], Iterable[GatewayProtocol]], limits: ClientLimits, closed: Callable[[str], None]
) -> None:
    """Every ``limits.sweep_s()``: enforce the limits on ``connections()``; ``closed(reason)`` counts
    each connection closed on one (keep-alive expiry aside)."""
    loop = asyncio.get_running_loop()
    interval = limits.sweep_s()
    while True:
        await asyncio.sleep(interval)
        now = loop.time()
        late = [(c, reason) for c in connections() if (reason := overdue(c, now, limits)) is not None]
        for conn, reason in late:
            try:
                enforce(conn, reason)
            except Exception:  # one connection's trouble must not end the sweep of all the others
                log.exception("closing a client connection (%s) failed", reason)
            if reason != _IDLE:
                closed(reason)
