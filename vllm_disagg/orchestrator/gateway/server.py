"""The gateway port's HTTP/1.1 server: the two OpenAI POST routes parsed here, the rest by aiohttp.

aiohttp's server spends about 100 µs of CPU on a request on this machine (its request and response
objects, header multidicts, payload streams, handler loop); an asyncio Protocol on httptools (llhttp)
spends about 35 (docs/benchmarks.md, "The gateway's own HTTP server"). The gateway's port is therefore
served by ``GatewayProtocol``:

- a request that begins ``POST /v1/completions `` or ``POST /v1/chat/completions `` is parsed here
  and handed to the gateway as a ``FastRequest``; its answer (an aiohttp ``web.Response``, or a
  ``FastStream`` for an event stream) is written here, keep-alive, ``Expect: 100-continue``, chunked
  request bodies, pipelining and the body limit included;
- any other request (another method or path, a query string) hands the connection, from that request
  on, to aiohttp's server for the same application, exactly as if aiohttp had accepted it: the admin
  API, the dashboard, ``/metrics``, 404 and 405 answer as they always did, and so do the OpenAI routes
  on that connection afterwards (through ``routes.OpenAIRoutes.route_directly``).

The choice is made on a request's first bytes, where a connection is between requests. Requests
pipelined behind a fast one in the same packets are parsed here too; a pipelined request for another
path is refused with 400 and the connection closed after the answers before it, since its bytes are no
longer at hand to give aiohttp (clients do not pipeline; none that we know of does this).

A client that disconnects cancels its handler, as aiohttp's ``handler_cancellation`` does, which closes
the engine legs. Slow clients (a head or body dribbled, an answer never read) and the connection cap:
``deadlines``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import httptools
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE  # what aiohttp says on the same port
from multidict import CIMultiDict, CIMultiDictProxy

from vllm_disagg.errors import BadRequest, HeadersTooLarge, PayloadTooLarge, RequestError, TooManyConnections
from vllm_disagg.http_errors import error_response

log = logging.getLogger(__name__)

_MAX_HEAD = 64 * 1024  # request line and headers; aiohttp allows 8 KiB a line
_MAX_PIPELINED = 8  # parsed requests waiting behind the one served before reading stops
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {s: web.Response(status=s).reason for s in (200, 400, 404, 408, 413, 429, 431, 500, 502, 503)}

Handler = Callable[["FastRequest"], Awaitable["Answer"]]


class ClientStream(Protocol):
    """What the decode leg writes a streamed answer to: aiohttp's ``StreamResponse`` or ``FastStream``."""

    async def write(self, data: bytes) -> None:
        """Send ``data``; waits while the client reads slower than the engine writes."""

    async def write_eof(self, data: bytes = b"") -> None:
        """Send ``data`` and end the answer."""


class Listener(Protocol):
    """What a connection reads of its listener (``listener.GatewayServer``)."""

    routes: dict[bytes, Handler]  # POST path -> handler
    fallback: web.Server  # aiohttp's server, for the connections handed over
    max_body_bytes: int
    connections: set[GatewayProtocol]

    def kind(self, data: bytes) -> bool | None:
        """Is the request that ``data`` begins served here (True), by aiohttp (False), or unknown yet?"""

    def admit(self) -> bool:
        """May a new connection be served (False, and counted, past the cap)?"""

    def date(self) -> str:
        """The ``Date`` header's value now."""


class FastRequest:
    """A request parsed by ``GatewayProtocol``: what the gateway's handlers read of aiohttp's request
    (``headers``, ``content_length``, ``read()``, ``method``, ``raw_path``)."""

    __slots__ = (
        "_chunks",
        "_limit",
        "_protocol",
        "_size",
        "_waiter",
        "complete",
        "content_length",
        "error",
        "expect_continue",
        "handler",
        "headers",
        "http_10",
        "keep_alive",
        "method",
        "raw_path",
    )

    def __init__(
        self,
        protocol: GatewayProtocol,
        method: str,
        raw_path: str,
        handler: Handler | None,
        headers: CIMultiDictProxy[str],
        keep_alive: bool,
        http_10: bool,
        limit: int,
    ) -> None:
        self._protocol = protocol
        self.method = method
        self.raw_path = raw_path
        self.handler = handler  # None: a pipelined request for a path served by aiohttp
        self.headers = headers
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.keep_alive = keep_alive
        self.http_10 = http_10
        self.expect_continue = headers.get("Expect", "").lower() == "100-continue"
        self.complete = False  # the whole body is in
        self.error: RequestError | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._waiter: asyncio.Future[None] | None = None
        if self.content_length is not None and self.content_length > limit:
            self.error = PayloadTooLarge(
                f"the request body of {self.content_length} bytes is over the limit of {limit} bytes"
            )

    async def read(self) -> bytes:
        """The whole body; ``PayloadTooLarge`` over the limit."""
        if not self.complete and self.error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self.error is not None:
            raise self.error
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def stream(self, status: int, headers: dict[str, str]) -> FastStream:
        """Start a streamed answer; its headers go out with its first bytes."""
        return FastStream(self._protocol, status, headers, self)

    def _body(self, data: bytes) -> None:
        if self.error is not None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._chunks.clear()
            self.error = PayloadTooLarge(f"the request body is over the limit of {self._limit} bytes")
            self._wake()
            return
        self._chunks.append(data)

    def _complete(self) -> None:
        self.complete = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class FastStream:
    """A streamed answer to a ``FastRequest``: chunked (HTTP/1.0: to the end of the connection)."""

    __slots__ = ("_chunked", "_head", "_protocol", "ended", "status")

    def __init__(
        self, protocol: GatewayProtocol, status: int, headers: dict[str, str], request: FastRequest
    ) -> None:
        self.status = status
        self.ended = False
        self._protocol = protocol
        self._chunked = not request.http_10
        extra = {"Transfer-Encoding": "chunked"} if self._chunked else {"Connection": "close"}
        self._head = protocol.head(status, {**headers, **extra})

    async def write(self, data: bytes) -> None:
        """Send ``data`` (the headers go with the first); waits while the client's buffer is full."""
        if not data:
            return
        frame = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        if self._head:
            frame, self._head = self._head + frame, b""
        await self._protocol.send(frame)

    async def write_eof(self, data: bytes = b"") -> None:
        """Send ``data`` and the end of the answer."""
        if self.ended:
            return
        frame = b"%x\r\n%b\r\n" % (len(data), data) if data and self._chunked else data
        if self._chunked:
            frame += b"0\r\n\r\n"
        if self._head:
            frame, self._head = self._head + frame, b""
        self.ended = True
        await self._protocol.send(frame)


class GatewayProtocol(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    def __init__(self, server: Listener) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.active: asyncio.Task[None] | None = None  # the request being answered
        self._answering: FastRequest | None = None  # ... and which request that is
        self._final: web.Response | None = None  # a refusal to write after it, then close
        self.stopping = False  # the server is closing: no keep-alive
        self.closed = False
        self.idle_since: float | None = None  # loop time since nothing is in flight or half-read
        # Loop times for the deadlines (``deadlines.overdue``): since a request's head is awaited, since
        # its body is, since writing is stalled (the client reads slower than we write).
        self.head_since: float | None = None
        self.body_since: float | None = None
        self.stalled_since: float | None = None
        self._loop = asyncio.get_running_loop()
        self._queue: deque[FastRequest] = deque()  # parsed, waiting for the answer before them
        self._parsing: FastRequest | None = None  # the request whose body is coming
        self._last: FastRequest | None = None  # the request parsed last
        self._between = True  # the next byte starts a request
        self._pending = b""  # a request's first bytes, too few to tell its kind
        self._handoff: bytes | None = None  # bytes for aiohttp once the answers before them are out
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._head_size = 0
        self._refusal: RequestError | None = None  # what a parser error is answered with
        self._paused_reading = False
        self._upgraded = False  # an Upgrade request was parsed: nothing after it is
        self._paused_writing = False
        self._drain: asyncio.Future[None] | None = None

    # --- connection ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if not self.server.admit():
            refusal = error_response(TooManyConnections("too many connections to this gateway process"), {})
            self._write(refusal, keep=False)
            self.transport.close()
            return
        self.server.connections.add(self)
        self.idle_since = self.head_since = self._loop.time()  # its first head is due from now

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.active is not None:
            self.active.cancel()  # the client left: its engine legs close
        for request in self._queue:
            request.error = request.error or BadRequest("the client disconnected")
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionResetError("the client disconnected"))

    def pause_writing(self) -> None:
        self._paused_writing = True
        self.stalled_since = self._loop.time()

    def resume_writing(self) -> None:
        self._paused_writing = False
        self.stalled_since = None
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def close(self) -> None:
        """Close after what is written (keep-alive timeout, shutdown)."""
        self.head_since = self.body_since = None
        if self.transport is not None and not self.closed:
            if self.stalled_since is None and self.transport.get_write_buffer_size():
                # What is left must go out within the write timeout too, or the connection is dropped.
                self.stalled_since = self._loop.time()
            self.transport.close()

    @property
    def reading_paused(self) -> bool:
        """Reading is paused by the server (pipelined requests waiting, a hand-over due)."""
        return self._paused_reading or self._handoff is not None

    @property
    def body_received(self) -> int:
        """Bytes of the body being read so far."""
        parsing = self._parsing
        return parsing._size if parsing is not None else 0

    def abort(self) -> None:
        """Drop the connection now."""
        if self.transport is not None and not self.closed:
            self.transport.abort()

    async def send(self, data: bytes) -> None:
        """Write ``data``; waits while the transport's buffer is over its high-water mark."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self.transport.write(data)
        if self._paused_writing:
            self._drain = self._loop.create_future()
            await self._drain

    # --- reading ------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._handoff is not None:  # reading is paused; what was already on its way
            self._handoff += data
            return
        if self._upgraded:
            return
        self.idle_since = None
        if self._between:
            if self.head_since is None:  # a request's first bytes: its head is due from now
                self.head_since = self._loop.time()
            if self._pending:
                data, self._pending = self._pending + data, b""
            kind = self.server.kind(data)
            if kind is None:
                self._pending = data
                return
            if not kind:
                self._hand_over(data)
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # httptools reads no body after ``Upgrade``: refuse the request (its handler reads the
            # error) and close after the answer; what follows is not read as HTTP.
            if self._last is not None:
                self._last.error = BadRequest("a protocol upgrade is not served on the OpenAI routes")
            self.stopping, self._upgraded = True, True
        except httptools.HttpParserError as exc:
            self.refuse(self._refusal or BadRequest(f"malformed HTTP request: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # as aiohttp: the transport closes, a handler in flight is cancelled

    def on_message_begin(self) -> None:
        self._between = False
        if self.head_since is None:  # pipelined behind a request in the same packet
            self.head_since = self._loop.time()
        self._url, self._headers, self._head_size = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._grow(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))
        self._grow(len(name) + len(value) + 4)

    def _grow(self, size: int) -> None:
        self._head_size += size
        if self._head_size > _MAX_HEAD:
            self._refusal = HeadersTooLarge(f"the request line and headers are over {_MAX_HEAD} bytes")
            raise ValueError("head too large")  # stops the parser: data_received refuses with 431

    def on_headers_complete(self) -> None:
        parser = self.parser
        url = self._url
        method = parser.get_method().decode("latin-1")
        handler = self.server.routes.get(url) if method == "POST" else None
        request = FastRequest(
            self,
            method,
            url.decode("latin-1"),
            handler,
            CIMultiDictProxy(CIMultiDict(self._headers)),
            parser.should_keep_alive(),
            parser.get_http_version() == "1.0",
            self.server.max_body_bytes,
        )
        self._parsing = self._last = request
        self.head_since, self.body_since = None, self._loop.time()
        self._queue.append(request)
        if len(self._queue) > _MAX_PIPELINED and self.transport is not None and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()
        self._next()

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing._body(body)

    def on_message_complete(self) -> None:
        self.body_since = None
        if self._parsing is not None:
            self._parsing._complete()
            self._parsing = None
        self._between = True

    # --- answering ----------------------------------------------------------------------------------

    def _next(self) -> None:
        """Start answering the oldest parsed request, unless one is being answered."""
        if self.active is not None or not self._queue or self.closed:
            return
        request = self._queue.popleft()
        if self._paused_reading and len(self._queue) <= _MAX_PIPELINED // 2 and self._handoff is None:
            self._paused_reading = False
            assert self.transport is not None
            self.transport.resume_reading()
        if request.expect_continue and request.error is None and request.handler is not None:
            assert self.transport is not None
            self.transport.write(_CONTINUE)
        self._answering = request
        self.active = self._loop.create_task(self._answer(request))

    async def _answer(self, request: FastRequest) -> None:
        try:
            if request.handler is None:
                response: Answer = error_response(
                    BadRequest(
                        f"a pipelined {request.method} {request.raw_path[:100]!r} behind an OpenAI request: "
                        "send it on its own connection or after the previous answer"
                    ),
                    {},
                )
            else:
                response = await request.handler(request)
        except asyncio.CancelledError:
            self.active = None
            raise
        except Exception as exc:  # a bug: the client gets a 500, the connection lives on
            log.exception("the gateway failed on %s %s", request.method, request.raw_path)
            response = error_response(RequestError(f"internal error: {type(exc).__name__}"), {})
        keep = (
            request.keep_alive
            and request.complete
            and request.handler is not None
            and not self.stopping
            and not self.closed
        )
        if isinstance(response, FastStream):
            keep = keep and response.ended and not request.http_10
        elif isinstance(response, web.Response):
            self._write(response, keep)
        else:  # an aiohttp stream cannot be written here: never made for a FastRequest
            log.error("the gateway answered %s with a %s", request.raw_path, type(response).__name__)
            keep = False
        self.active = self._answering = None
        if not keep:
            final, self._final = self._final, None
            if final is not None:  # a request after this one could not be parsed: say so, in order
                self._write(final, keep=False)
            self.close()
            return
        if self._handoff is not None and not self._queue:
            self._hand_over(self._handoff)
            return
        if not self._queue and self._between and not self._pending:
            self.idle_since = self._loop.time()
        self._next()

    def head(self, status: int, headers: dict[str, str] | CIMultiDictProxy[str] | Any) -> bytes:
        """The status line and headers of an answer, ``Date`` and ``Server`` added."""
        reason = _REASONS.get(status) or web.Response(status=status).reason
        lines = [f"HTTP/1.1 {status} {reason}\r\n"]
        for name, value in headers.items():
            if "\n" in value or "\r" in value:  # never split a header (no client value gets here raw)
                continue
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"Date: {self.server.date()}\r\nServer: {SERVER_SOFTWARE}\r\n\r\n")
        return "".join(lines).encode("latin-1")

    def _write(self, response: web.Response, keep: bool) -> None:
        if self.closed or self.transport is None:
            return
        body = response.body
        data = body if isinstance(body, bytes) else b""
        headers = CIMultiDict(response.headers)
        headers["Content-Length"] = str(len(data))
        if not keep:
            headers["Connection"] = "close"
        self.transport.write(self.head(response.status, headers) + data)

    def refuse(self, error: RequestError) -> None:
        """A request that cannot be parsed (or came too slowly): answer (after the answers before it)
        and close."""
        self._pending = b""
        self.head_since = self.body_since = None
        self._between = False  # nothing more is read as requests
        parsing, self._parsing = self._parsing, None
        if parsing is not None:  # its handler (if it runs) reads the error instead of the body
            parsing.error = error
            parsing._wake()
        if self.transport is None or self.closed:
            return
        if not self.transport.is_closing():
            self.transport.pause_reading()
        self.stopping = True  # the connection closes after the answer in flight
        if self.active is None:
            self._write(error_response(error, {}), keep=False)
            self.close()
        elif parsing is not self._answering:  # not the request in flight's own body: answered after it
            self._queue.clear()
            self._final = error_response(error, {})

    def _hand_over(self, data: bytes) -> None:
        """From this request on, aiohttp serves the connection (after any answer in flight here)."""
        if self.active is not None or self._queue:
            self._handoff = data
            if not self._paused_reading and self.transport is not None:
                self._paused_reading = True
                self.transport.pause_reading()
            return
        transport = self.transport
        assert transport is not None
        self.server.connections.discard(self)
        self._handoff = None
        handler = self.server.fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._paused_reading:
            self._paused_reading = False
            transport.resume_reading()
        if data:
            handler.data_received(data)


# What the gateway's handlers take and give, on either server.
ClientRequest = web.BaseRequest | FastRequest
Answer = web.StreamResponse | FastStream
