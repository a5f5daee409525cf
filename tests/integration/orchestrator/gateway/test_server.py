"""The gateway port's own HTTP/1.1 server, spoken to byte by byte over real sockets: keep-alive,
pipelining, ``Expect: 100-continue``, chunked bodies, HTTP/1.0, limits, malformed requests, and the
hand-over of every other path to aiohttp on the same connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import expected, request_body, text_of, wait_ready
from tests.integration.orchestrator_support import MODEL
from vllm_disagg import jsonutil
from vllm_disagg.config import SimTiming
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.sim_engine.engine import SimServer

ROUTE = "/v1/completions"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """One HTTP/1.1 answer: informational ones skipped, body by Content-Length, chunks, or to EOF."""
    while True:
        status_line = await reader.readline()
        assert status_line, "the connection closed before an answer"
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status >= 200:
            break
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while size := int((await reader.readline()).strip(), 16):
            parts.append(await reader.readexactly(size))
            assert await reader.readexactly(2) == b"\r\n"
        assert await reader.readexactly(2) == b"\r\n"
        body = b"".join(parts)
    else:
        body = await reader.read()
    return Answer(status, headers, body)


class _Replay(asyncio.StreamReader):
    """A reader whose first line was already read."""

    def __init__(self, line: bytes, reader: asyncio.StreamReader) -> None:
        super().__init__()
        self._line: bytes | None = line
        self._reader = reader

    async def readline(self) -> bytes:
        if self._line is not None:
            line, self._line = self._line, None
            return line
        return await self._reader.readline()

    async def readexactly(self, n: int) -> bytes:
        return await self._reader.readexactly(n)

    async def read(self, n: int = -1) -> bytes:
        return await self._reader.read(n)


def post(body: bytes, request_id: str, *, path: str = ROUTE, extra: str = "", version: str = "1.1") -> bytes:
    head = (
        f"POST {path} HTTP/{version}\r\nHost: gw\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def completion(stream: bool = False) -> bytes:
    return jsonutil.dumps(request_body(ROUTE, stream))


@pytest.fixture
async def pd(
    orch: OrchestratorServer, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> tuple[SimServer, SimServer]:
    """One simulated prefill and one simulated decode engine, registered and ready."""
    p, d = await sim_engine(), await sim_engine()
    await fake_agent("p0", p.url, "prefill")
    await fake_agent("d0", d.url, "decode")
    await wait_ready(orch, 1, 1)
    return p, d


@pytest.fixture
async def conn(
    orch: OrchestratorServer, pd: tuple[SimServer, SimServer]
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw connection to the gateway's port, with 1P1D registered."""
    host, port = orch.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    yield reader, writer
    writer.close()


async def closed(reader: asyncio.StreamReader) -> bool:
    """The server closed the connection (EOF within the deadline)."""
    return await asyncio.wait_for(reader.read(), timeout=15) == b""


async def test_keep_alive_serves_requests_one_after_another_on_one_connection(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    for n, stream in enumerate([False, True, False]):
        writer.write(post(completion(stream), f"ka-{n}"))
        answer = await read_answer(reader)
        assert answer.status == 200, answer.body
        assert answer.headers["x-request-id"] == f"ka-{n}"
        assert answer.headers["x-disagg-mode"] == "disaggregated"
        assert text_of(ROUTE, answer.body, stream) == expected(ROUTE)
        assert ("transfer-encoding" in answer.headers) == stream
        assert "date" in answer.headers and "connection" not in answer.headers


async def test_pipelined_requests_are_answered_in_order(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(b"".join(post(completion(n == 1), f"pipe-{n}") for n in range(3)))  # one write
    for n in range(3):
        answer = await read_answer(reader)
        assert (answer.status, answer.headers["x-request-id"]) == (200, f"pipe-{n}")
        assert text_of(ROUTE, answer.body, n == 1) == expected(ROUTE)


async def test_other_paths_on_the_same_connection_are_served_by_the_application(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """After an OpenAI request, the connection is handed to aiohttp: /v1/models, a 404, a 405 and
    then another completion all answer as the application does."""
    reader, writer = conn
    writer.write(post(completion(), "first"))
    assert (await read_answer(reader)).status == 200
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
    models = await read_answer(reader)
    assert models.status == 200
    assert [m["id"] for m in jsonutil.loads(models.body)["data"]] == [MODEL]
    writer.write(b"GET /nowhere HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert (await read_answer(reader)).status == 404
    writer.write(b"GET /v1/completions HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert (await read_answer(reader)).status == 405
    writer.write(post(completion(), "after"))
    again = await read_answer(reader)
    assert (again.status, again.headers["x-request-id"]) == (200, "after")
    assert text_of(ROUTE, again.body, False) == expected(ROUTE)


async def test_a_connection_that_begins_with_another_path_is_the_applications(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(b"GET /v1/mod")  # a request line in two pieces
    await asyncio.sleep(0)
    writer.write(b"els HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert (await read_answer(reader)).status == 200
    writer.write(post(completion(), "then"))
    assert (await read_answer(reader)).headers["x-request-id"] == "then"


async def test_a_request_split_into_tiny_pieces_is_parsed(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    data = post(completion(), "pieces")
    for i in range(0, len(data), 7):
        writer.write(data[i : i + 7])
        await writer.drain()
    answer = await read_answer(reader)
    assert (answer.status, answer.headers["x-request-id"]) == (200, "pieces")


async def test_a_pipelined_request_for_another_path_is_refused_after_the_answer_before_it(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(post(completion(), "ok") + b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
    first = await read_answer(reader)
    assert (first.status, first.headers["x-request-id"]) == (200, "ok")
    refused = await read_answer(reader)
    assert refused.status == 400
    assert "pipelined GET '/v1/models'" in jsonutil.loads(refused.body)["error"]["message"]
    assert refused.headers["connection"] == "close"
    assert await closed(reader)


async def test_expect_100_continue_is_answered_before_the_body_is_sent(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    body = completion()
    writer.write(
        post(b"", "expect", extra="Expect: 100-continue\r\n").replace(b"Length: 0", b"Length: %d" % len(body))
    )
    assert await asyncio.wait_for(reader.readline(), timeout=15) == b"HTTP/1.1 100 Continue\r\n"
    assert await reader.readline() == b"\r\n"
    writer.write(body)
    answer = await read_answer(reader)
    assert (answer.status, answer.headers["x-request-id"]) == (200, "expect")


async def test_a_chunked_request_body_is_read_whole(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    body = completion()
    half = len(body) // 2
    chunks = (
        b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:])) + b"0\r\n\r\n"
    )
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n"
        b"X-Request-Id: chunked\r\n\r\n" + chunks
    )
    answer = await read_answer(reader)
    assert (answer.status, answer.headers["x-request-id"]) == (200, "chunked")
    assert text_of(ROUTE, answer.body, False) == expected(ROUTE)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_http_10_gets_its_answer_and_the_connection_closes(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], stream: bool
) -> None:
    reader, writer = conn
    writer.write(post(completion(stream), "old", version="1.0"))
    answer = await read_answer(reader)
    assert answer.status == 200
    assert "transfer-encoding" not in answer.headers  # no chunks for HTTP/1.0
    assert text_of(ROUTE, answer.body, stream) == expected(ROUTE)
    assert await closed(reader)


async def test_a_body_over_the_limit_is_413_without_reading_it_and_the_connection_closes(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], orch: OrchestratorServer
) -> None:
    reader, writer = conn
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\n"
        b"Content-Length: 999999999999\r\n\r\n"
    )
    first_line = await asyncio.wait_for(reader.readline(), timeout=15)
    assert first_line.startswith(b"HTTP/1.1 413 "), "refused at once, without a 100 Continue"
    answer = await read_answer(_Replay(first_line, reader))
    assert jsonutil.loads(answer.body)["error"]["type"] == "PayloadTooLargeError"
    assert answer.headers["x-request-id"]
    assert await closed(reader)


async def test_a_chunked_body_growing_over_the_limit_is_413(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], orch: OrchestratorServer
) -> None:
    reader, writer = conn
    piece = b"x" * 65536
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n")
    answer_task = asyncio.ensure_future(read_answer(reader))
    try:
        while not answer_task.done():  # the limit (orch_config: 1 MiB by default) is crossed at some point
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await asyncio.wait([answer_task], timeout=0.01)
    except ConnectionError:
        pass  # the server closed while we were still sending: the answer is in the socket
    answer = await answer_task
    assert answer.status == 413


@pytest.mark.parametrize(
    ("raw", "status", "fragment"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400, "malformed HTTP request"),
        (b"POST /v1/completions HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 70000 + b"\r\n\r\n", 431, "headers"),
    ],
    ids=["bad-content-length", "huge-header"],
)
async def test_a_malformed_request_is_refused_with_a_reason_and_the_server_keeps_serving(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    raw: bytes,
    status: int,
    fragment: str,
) -> None:
    reader, writer = conn
    writer.write(raw)
    answer = await read_answer(reader)
    assert answer.status == status
    assert fragment in jsonutil.loads(answer.body)["error"]["message"]
    assert answer.headers["connection"] == "close"
    assert await closed(reader)
    async with http.post(orch.url + ROUTE, data=completion()) as resp:
        assert resp.status == 200


async def test_shutdown_lets_the_stream_in_flight_finish_and_refuses_new_connections(
    orch: OrchestratorServer, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    d = await sim_engine(timing=SimTiming(decode_step_s=0.02))  # 50 tokens: about a second
    await fake_agent("d0", d.url, "decode")
    await wait_ready(orch, 0, 1)
    host, port = orch.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(post(jsonutil.dumps({**request_body(ROUTE, True), "max_tokens": 50}), "last"))
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")  # the stream is under way
    closing = asyncio.ensure_future(orch.close())
    rest = await asyncio.wait_for(reader.read(), timeout=30)  # to the end: the answer, then EOF
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # whole, and properly ended
    assert rest.count(b'"text":') >= 50
    await closing
    writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection(host, int(port))


async def test_an_upgrade_request_is_refused_and_the_connection_closes(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    """No protocol switch on the OpenAI routes; what follows the request is not read as HTTP."""
    reader, writer = conn
    upgrade = "Connection: Upgrade\r\nUpgrade: websocket\r\n"
    writer.write(post(completion(), "up", extra=upgrade) + b"\x81\x05hello")
    answer = await read_answer(reader)
    assert (answer.status, answer.headers["x-request-id"]) == (400, "up")
    assert "protocol upgrade" in jsonutil.loads(answer.body)["error"]["message"]
    assert await closed(reader)


async def test_a_malformed_request_pipelined_behind_one_in_flight_is_refused_after_its_answer(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(post(completion(), "fine") + b"NOT HTTP AT ALL\r\n\r\n")
    first = await read_answer(reader)
    assert (first.status, first.headers["x-request-id"]) == (200, "fine")
    refused = await read_answer(reader)
    assert (
        refused.status == 400 and "malformed HTTP request" in jsonutil.loads(refused.body)["error"]["message"]
    )
    assert await closed(reader)


async def test_a_request_whose_own_body_is_malformed_gets_one_answer_and_the_connection_closes(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    reader, writer = conn
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n"
        b"X-Request-Id: bad\r\n\r\nzz\r\nnot a chunk\r\n"
    )
    answer = await read_answer(reader)
    assert (answer.status, answer.headers["x-request-id"]) == (400, "bad")
    assert "malformed HTTP request" in jsonutil.loads(answer.body)["error"]["message"]
    assert await closed(reader), "one answer, then the end: nothing else is written"
