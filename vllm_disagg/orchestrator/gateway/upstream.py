"""A lean HTTP/1.1 client for engine legs: pooled keep-alive connections and llhttp (``httptools``).

aiohttp's ``ClientSession`` spent about 85 µs of CPU per request here (cookies, tracing, redirects,
URL and header normalisation, timers) around what an engine leg needs; this client spends about 20.
It does exactly that: POST a bytes body; a status and headers; the body read whole or as it arrives
(sized or chunked); closing the connection to make the engine abort a request it should not finish.

Errors (``EngineHTTPError``): ``EngineConnectError`` when the engine cannot be reached,
``EngineDisconnected`` when the connection ends before the response does or carries something that
is not HTTP; ``TimeoutError`` when connecting, or waiting for the next bytes of a response, takes
longer than its limit (never a total limit: a healthy stream may run for hours);
``EngineAnswerTooLarge`` when an answer is bigger than the gateway reads: a whole body over
``max_body_bytes``, one event of a stream over ``max_event_bytes``, or headers over 64 KiB. Nothing is
buffered past them (about 1 MiB more sits in the connection before it stops reading), so an engine, or
whatever an engine URL names, cannot make the gateway hold more.

A pooled connection idle for ``keepalive_s`` is not reused: vLLM (uvicorn) closes idle ones at 5 s,
and one it is closing just then would fail the request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import NoReturn, cast

import httptools
from yarl import URL

_PAUSE_AT = 1 << 20  # buffered body bytes at which the engine's socket stops being read
_MAX_IDLE_PER_ENGINE = 256
_MAX_HEAD = 64 << 10  # status line and headers: llhttp itself sets no bound
MAX_BODY_BYTES = 64 << 20  # defaults of ``OrchestratorConfig.max_engine_body_bytes`` and ``_event_``
MAX_EVENT_BYTES = 16 << 20
_EVENT_ENDS = (b"\n\n", b"\n\r", b"\r\r")  # two line ends in a row, however spelled (CR LF is one)


class EngineHTTPError(Exception):
    """An engine call failed below HTTP. Not an ``OSError``: the relay reads a ``ConnectionError``
    as the *client's* connection gone, and this is the engine's."""


class EngineConnectError(EngineHTTPError):
    """The engine could not be reached (refused, unreachable)."""

    def __init__(self, origin: str, os_error: OSError) -> None:
        super().__init__(f"cannot connect to {origin}: {os_error.strerror or os_error}")
        self.origin = origin
        self.os_error = os_error


class EngineDisconnected(EngineHTTPError):
    """The engine's connection ended before its response did, or carried something that is not HTTP."""


class EngineAnswerTooLarge(EngineHTTPError):
    """The engine's answer is bigger than the gateway reads; the connection is dropped."""


def _expire(waiter: asyncio.Future[None], idle_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError(f"no response bytes from the engine for {idle_s:g} s"))


class _Connection(asyncio.Protocol):
    """One TCP connection to an engine, carrying one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on this connection."""
        self.status = 0
        self.head = 0  # bytes fed before the headers were complete
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.headers_done = False
        self.complete = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(EngineDisconnected(f"sent a response that is not valid HTTP: {exc}"))
            self.abort()
            return
        if not self.headers_done:
            self.head += len(data)
            if self.head > _MAX_HEAD:  # headers without end would grow ``headers`` for ever
                self.fail(EngineAnswerTooLarge(f"sent over {_MAX_HEAD} bytes of headers"))
                self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            reason = f": {exc}" if exc is not None else ""
            self.fail(EngineDisconnected(f"closed the connection before the response ended{reason}"))

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self.wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self.wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.wake()

    # --- for the client ---

    def fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, idle_s: float) -> None:
        """Until the response moves on (headers, body, its end, an error): at most ``idle_s``."""
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(idle_s, _expire, waiter, idle_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes:
        """The body bytes received so far (and reading resumes if it had paused)."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def abort(self) -> None:
        """Drop the connection now (an engine aborts the request it was serving on it)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class EngineResponse:
    """The engine's answer: status and headers now, the body on demand, bounded."""

    def __init__(self, conn: _Connection, idle_s: float, max_body: int, max_event: int) -> None:
        self._conn = conn
        self._idle_s = idle_s
        self._max_body = max_body
        self._max_event = max_event
        self.status = conn.status
        self.headers = _Headers(conn.headers)

    @property
    def content(self) -> EngineResponse:
        """aiohttp's spelling: ``resp.content.iter_any()``."""
        return self

    async def read(self) -> bytes:
        """The whole body; ``EngineAnswerTooLarge`` (and the connection dropped) past ``max_body``."""
        conn, parts, size, cap = self._conn, [], 0, self._max_body
        declared = conn.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
            self._too_large(f"its body is {declared[:24]} bytes, over the {cap} the gateway reads")
        while True:
            if conn.chunks:
                chunk = conn.take()
                size += len(chunk)
                if size > cap:
                    self._too_large(f"its body passed the {cap} bytes the gateway reads")
                parts.append(chunk)
            if conn.complete:
                return b"".join(parts)
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._idle_s)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives: everything received so far, each time; ``EngineAnswerTooLarge``
        (and the connection dropped) when one event passes ``max_event`` (a relay that cuts the stream
        into events would hold all of it)."""
        conn, open_bytes, last = self._conn, 0, b""
        while True:
            if conn.chunks:
                chunk = conn.take()
                open_bytes = open_event_bytes(open_bytes, last, chunk)
                if open_bytes > self._max_event:
                    self._too_large(f"one event of its stream passed the {self._max_event} bytes allowed")
                last = chunk[-1:]
                yield chunk
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._idle_s)

    def close(self) -> None:
        """Drop the connection: the engine aborts the request."""
        self._conn.abort()

    def _too_large(self, what: str) -> NoReturn:
        self._conn.abort()  # stop reading: what it sends on is never buffered
        raise EngineAnswerTooLarge(f"its answer is too large: {what}")


def open_event_bytes(before: int, last: bytes, chunk: bytes) -> int:
    """Bytes of the stream's last event still open after ``chunk``: ``before`` were open before it, and
    ``last`` is the byte before it (a blank line may be split between chunks)."""
    if chunk.endswith(b"\n\n"):  # vLLM's every chunk
        return 0
    end = max(chunk.rfind(sep) for sep in _EVENT_ENDS)
    if end >= 0:
        return len(chunk) - end - 2
    if last + chunk[:1] in _EVENT_ENDS:
        return len(chunk) - 1
    return before + len(chunk)


class _Headers:
    """Response headers, looked up case-insensitively."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[str, str]) -> None:
        self._items = items

    def get(self, name: str, default: str = "") -> str:
        return self._items.get(name.lower(), default)


class _Post:
    """``async with client.post(url, data=..., headers=...) as resp``."""

    __slots__ = ("_client", "_data", "_headers", "_resp", "_url")

    def __init__(self, client: EngineClient, url: URL, data: bytes, headers: dict[str, str]) -> None:
        self._client, self._url, self._data, self._headers = client, url, data, headers
        self._resp: EngineResponse | None = None

    async def __aenter__(self) -> EngineResponse:
        client = self._client
        conn = await client.acquire(self._url)
        try:
            assert conn.transport is not None
            conn.transport.write(_request(self._url, self._data, self._headers))
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(client.idle_s)
        except BaseException:
            conn.abort()
            raise
        self._resp = EngineResponse(conn, client.idle_s, client.max_body_bytes, client.max_event_bytes)
        return self._resp

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._resp is not None
        conn = self._resp._conn
        if kind is None and conn.complete and conn.keep_alive and not conn.closed and not conn.chunks:
            self._client.release(self._url, conn)
        else:
            conn.abort()


def _request(url: URL, data: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {url.raw_host}:{url.port}\r\n"]
    for name, value in headers.items():
        if "\n" in value or "\r" in value:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    lines.append(f"Content-Length: {len(data)}\r\n\r\n")
    return "".join(lines).encode() + data


class EngineClient:
    """Keep-alive connections to engines, by host and port; one request per connection at a time."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        idle_timeout_s: float,
        keepalive_s: float,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.connect_s = connect_timeout_s
        self.idle_s = idle_timeout_s
        self.keepalive_s = keepalive_s
        self.max_body_bytes = max_body_bytes
        self.max_event_bytes = max_event_bytes
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    def post(self, url: URL, data: bytes, headers: dict[str, str]) -> _Post:
        """POST ``data`` to ``url``: an async context manager giving the ``EngineResponse``."""
        return _Post(self, url, data, headers)

    async def acquire(self, url: URL) -> _Connection:
        """A pooled connection to ``url``'s engine idle for less than ``keepalive_s``, else a new one."""
        if self._closed:
            raise EngineDisconnected("the engine client is closed")
        if url.scheme != "http":  # it would send the prompt and the engine key in clear to a TLS port
            raise EngineDisconnected(f"the gateway speaks plain http to engines, not {url.scheme}")
        host, port = url.raw_host or "", url.port or 80
        loop = asyncio.get_running_loop()
        idle = self._idle.get((host, port))
        now = loop.time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                conn.reset()
                return conn
            conn.abort()
        origin = f"{host}:{port}"
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop), host, port)
        except TimeoutError:
            raise TimeoutError(f"connecting to {origin} took over {self.connect_s:g} s") from None
        except OSError as exc:
            raise EngineConnectError(origin, exc) from None
        return conn

    def release(self, url: URL, conn: _Connection) -> None:
        """Back into the pool, for the next request to the same engine."""
        if self._closed:
            conn.abort()
            return
        conn.idle_since = conn.loop.time()
        idle = self._idle.setdefault((url.raw_host or "", url.port or 80), [])
        idle.append(conn)
        if len(idle) > _MAX_IDLE_PER_ENGINE:
            idle.pop(0).abort()

    def idle_connections(self) -> int:
        """Pooled connections now (for tests and the admin view)."""
        return sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        """Drop every pooled connection; later posts fail."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
