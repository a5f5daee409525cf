"""JSON log lines through the real gateway: every line about a request carries its request id and trace
id (the client's ``traceparent``, or a new one), and no line holds a prompt or a key (docs/observability.md,
Logs)."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web

from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator_support import MODEL, fake_engine
from tests.integration.recovery_support import Cluster, record, start_cluster
from vllm_disagg import jsonutil, logs

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
PROMPT = "PROMPT-MARKER-qzx: the words of a user that no log line may hold. " * 3
CLIENT_KEY = "CLIENT-KEY-5e1f0c"
ENGINE_KEY = "ENGINE-KEY-9d2b7a"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """Every record of every logger, at DEBUG, as the orchestrator writes them with ``--log-format json``."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("orchestrator"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def _status_500(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "boom in the engine"}}, status=500)


async def _complete(http: aiohttp.ClientSession, cluster: Cluster, request_id: str, traceparent: str) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    headers = {
        "X-Request-Id": request_id,
        "traceparent": traceparent,
        "Authorization": f"Bearer {CLIENT_KEY}",
    }
    async with http.post(
        f"{cluster.server.url}/v1/completions", data=jsonutil.dumps(body), headers=headers
    ) as r:
        await r.read()
        return r.status


async def test_every_line_about_a_request_carries_its_ids_and_no_line_a_prompt_or_a_key(
    captured: io.StringIO, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    async with start_cluster(engine_api_key=ENGINE_KEY) as cluster, fake_engine(_status_500) as bad:
        await cluster.add("p-bad", bad.url, "prefill")  # idle: the first pick, then a retry
        await cluster.add("p-good", (await sim_engine()).url, "prefill", busy=True)
        await cluster.add("d0", (await sim_engine()).url, "decode")
        await cluster.ready(2, 1)
        assert await _complete(http, cluster, "logs-1", TRACEPARENT) == 200
        assert await _complete(http, cluster, "logs-2", "00-not-a-trace-context") == 200
        first_record = await record(http, cluster, "logs-1")  # found by the client's X-Request-Id
        assert [a["instance"] for a in first_record["attempts"]][:2] == [
            "p-bad",
            "p-good",
        ], "the first request was retried: a line says so"
        # Lines name a request by the gateway's own id (its engines' and its record's), never the client's.
        ids = [first_record["request_id"], (await record(http, cluster, "logs-2"))["request_id"]]
    raw = captured.getvalue()
    lines = [jsonutil.loads(line) for line in raw.splitlines()]
    assert all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)

    for request_id in ids:
        about = [line for line in lines if request_id in line["msg"]]
        assert about, f"lines about {request_id}"
        assert all(line.get("request_id") == request_id for line in about), about
    first = [line for line in lines if line.get("request_id") == ids[0]]
    assert {line["trace_id"] for line in first} == {TRACE_ID}, "the client's trace goes on"
    assert any("prefill on p-bad ended status" in line["msg"] for line in first), "the retry's cause"
    second = {line["trace_id"] for line in lines if line.get("request_id") == ids[1]}
    assert len(second) == 1 and re.fullmatch(r"[0-9a-f]{32}", next(iter(second))), (
        "a malformed one: a new trace"
    )
    assert second != {TRACE_ID}

    for secret in ("PROMPT-MARKER", CLIENT_KEY, ENGINE_KEY):
        assert secret not in raw, f"{secret} in the log"
