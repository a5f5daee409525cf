"""OpenTelemetry traces through the real gateway, exported over OTLP/HTTP to a receiver the test runs:
one trace per request, the client's continued, each engine leg a child span whose id the engine gets in
its ``traceparent`` (docs/observability.md, Traces)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator.gateway.test_resume import CHECKER, cutting_proxy, spec, stream
from tests.integration.orchestrator_support import MODEL, FakeEngine, fake_engine
from tests.integration.recovery_support import Cluster, start_cluster
from tests.otlp_receiver import OtlpReceiver, Span
from vllm_disagg import jsonutil, logs
from vllm_disagg.config import TracingConfig

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT = 2, 3  # span kinds
ERROR = 2  # status code
KV = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1]}


async def _prefill(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": ""}], "kv_transfer_params": KV})


async def _decode(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": " answered", "finish_reason": "length"}]})


async def _status_500(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "boom in the engine"}}, status=500)


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    r = await OtlpReceiver().start()
    yield r
    await r.close()


@contextlib.asynccontextmanager
async def traced_cluster(receiver: OtlpReceiver, **tracing: str) -> AsyncIterator[Cluster]:
    """An orchestrator exporting its spans to ``receiver``; they are all there once it has closed."""
    config = TracingConfig(endpoint=receiver.url, service_name="gateway-under-test", **tracing)
    async with start_cluster(tracing=config) as cluster:
        yield cluster


async def _complete(
    http: aiohttp.ClientSession, cluster: Cluster, request_id: str, traceparent: str = ""
) -> tuple[int, str]:
    """The status, and the gateway's own id of the request (its spans', engines' and log lines')."""
    headers = {"X-Request-Id": request_id, **({"traceparent": traceparent} if traceparent else {})}
    body = {"model": MODEL, "prompt": "a prompt to trace", "max_tokens": 2}
    async with http.post(
        f"{cluster.server.url}/v1/completions", data=jsonutil.dumps(body), headers=headers
    ) as r:
        await r.read()
        return r.status, r.headers["X-Disagg-Request-Id"]


def _request_span(spans: list[Span], own_id: str) -> Span:
    [span] = [s for s in spans if s.kind == SERVER and s.attributes.get("vllm_disagg.request_id") == own_id]
    return span


def _children(spans: list[Span], parent: Span) -> list[tuple[str, str, str]]:
    """(name, instance, outcome) of a span's children, in start order."""
    kids = sorted((s for s in spans if s.parent_id == parent.span_id), key=lambda s: s.start_ns)
    return [
        (
            s.name,
            str(s.attributes.get("vllm_disagg.instance", "")),
            str(s.attributes.get("vllm_disagg.outcome", "")),
        )
        for s in kids
    ]


def _traceparent_of(engine: FakeEngine, i: int) -> tuple[str, str]:
    """(trace id, parent span id) of the ``traceparent`` the engine got with its ``i``-th request."""
    found = re.fullmatch(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}", engine.headers[i]["traceparent"])
    assert found, engine.headers[i]
    return found.group(1), found.group(2)


async def test_a_disaggregated_request_is_one_trace_continuing_the_clients_with_a_span_per_leg(
    receiver: OtlpReceiver, http: aiohttp.ClientSession
) -> None:
    async with fake_engine(_prefill) as p, fake_engine(_decode) as d, traced_cluster(receiver) as cluster:
        await cluster.add("p0", p.url, "prefill")
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(1, 1)
        status, own = await _complete(http, cluster, "traced-1", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
        assert status == 200
    spans = receiver.trace(CLIENT_TRACE)
    root = _request_span(spans, own)
    assert (root.name, root.parent_id, root.service) == (
        "POST /v1/completions",
        CLIENT_SPAN,
        "gateway-under-test",
    )
    assert root.attributes["http.response.status_code"] == 200
    assert _children(spans, root) == [("schedule", "", ""), ("prefill", "p0", "ok"), ("decode", "d0", "ok")]
    by_name = {s.name: s for s in spans}
    schedule = by_name["schedule"]
    assert (schedule.attributes["vllm_disagg.prefill"], schedule.attributes["vllm_disagg.decode"]) == (
        "p0",
        "d0",
    )
    decided = {k.removeprefix("vllm_disagg.decision."): v for k, v in schedule.attributes.items()}
    assert (decided["decode.pick"], decided["prefill.pick"]) == ("d0", "p0"), decided
    assert decided["decode.total"] > 0 and decided["prefill.candidates"] == 1, decided
    assert by_name["prefill"].kind == CLIENT and by_name["decode"].kind == CLIENT
    # Each engine got its own leg's span as parent: vLLM's spans hang under the gateway's.
    assert _traceparent_of(p, 0) == (CLIENT_TRACE, by_name["prefill"].span_id)
    assert _traceparent_of(d, 0) == (CLIENT_TRACE, by_name["decode"].span_id)
    for child in spans:
        if child is not root:
            assert root.start_ns <= child.start_ns <= child.end_ns <= root.end_ns, child


async def test_a_retried_prefill_is_two_prefill_spans_the_failed_one_an_error(
    receiver: OtlpReceiver, http: aiohttp.ClientSession
) -> None:
    async with (
        fake_engine(_status_500) as bad,
        fake_engine(_prefill) as good,
        fake_engine(_decode) as d,
        traced_cluster(receiver) as cluster,
    ):
        await cluster.add("p-bad", bad.url, "prefill")  # idle: the first pick
        await cluster.add("p-good", good.url, "prefill", busy=True)
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(2, 1)
        status, own = await _complete(http, cluster, "traced-retry", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
        assert status == 200
    spans = receiver.trace(CLIENT_TRACE)
    root = _request_span(spans, own)
    assert _children(spans, root) == [
        ("schedule", "", ""),
        ("prefill", "p-bad", "status"),
        ("prefill", "p-good", "ok"),
        ("decode", "d0", "ok"),
    ]
    failed = next(s for s in spans if s.attributes.get("vllm_disagg.instance") == "p-bad")
    assert failed.status == ERROR
    assert _traceparent_of(bad, 0)[1] == failed.span_id and _traceparent_of(good, 0)[1] != failed.span_id


@pytest.mark.parametrize(
    "traceparent", ["", "00-not-a-trace-context", "00-" + "0" * 32 + f"-{CLIENT_SPAN}-01"]
)
async def test_without_a_valid_traceparent_a_request_starts_a_new_trace_and_its_log_lines_carry_it(
    receiver: OtlpReceiver, http: aiohttp.ClientSession, traceparent: str
) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    root_logger = logging.getLogger()
    level = root_logger.level
    root_logger.addHandler(handler)
    root_logger.setLevel(logging.INFO)
    try:
        async with (
            fake_engine(_status_500) as bad,
            fake_engine(_prefill) as p,
            fake_engine(_decode) as d,
            traced_cluster(receiver) as cluster,
        ):
            await cluster.add("p-bad", bad.url, "prefill")  # a failed leg: an INFO line about it
            await cluster.add("p0", p.url, "prefill", busy=True)
            await cluster.add("d0", d.url, "decode")
            await cluster.ready(2, 1)
            status, own = await _complete(http, cluster, "traced-new", traceparent)
            assert status == 200
    finally:
        root_logger.removeHandler(handler)
        root_logger.setLevel(level)
    root = _request_span(receiver.spans, own)
    assert root.parent_id == "" and root.trace_id not in (CLIENT_TRACE, "0" * 32)
    assert len(receiver.trace(root.trace_id)) == 5, "schedule, two prefill legs, decode, and the request"
    lines = [jsonutil.loads(line) for line in stream.getvalue().splitlines()]
    about = [line for line in lines if line.get("request_id") == own]
    assert about and {line["trace_id"] for line in about} == {root.trace_id}, "logs and traces agree"


async def test_a_sampler_that_drops_exports_nothing_and_the_engines_are_told_not_to_record(
    receiver: OtlpReceiver, http: aiohttp.ClientSession
) -> None:
    async with (
        fake_engine(_prefill) as p,
        fake_engine(_decode) as d,
        traced_cluster(receiver, sampler="always_off") as cluster,
    ):
        await cluster.add("p0", p.url, "prefill")
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(1, 1)
        assert (await _complete(http, cluster, "untraced"))[0] == 200
    assert receiver.spans == []
    flags = int(d.headers[0]["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0, "not sampled: the engine records nothing either"


async def test_a_resumed_stream_shows_the_cut_decode_leg_the_resume_leg_and_a_resume_event(
    receiver: OtlpReceiver, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    backend = await sim_engine()
    async with (
        fake_engine(cutting_proxy(backend, 3, "api-server-died")) as cut,
        traced_cluster(receiver) as cluster,
    ):
        await cluster.add("p0", (await sim_engine()).url, "prefill")
        await cluster.add("d-cut", cut.url, "decode")
        await cluster.add("d-good", (await sim_engine()).url, "decode", busy=True)
        await cluster.ready(1, 2)
        s = spec("traced-resume", "completion")
        status, raw = await stream(http, cluster, s)
        assert CHECKER.check(s, status, raw).outcome == "completed"
    own = jsonutil.loads(raw.split(b"\n\n", 1)[0].removeprefix(b"data: "))["id"].removeprefix("cmpl-")
    root = _request_span(receiver.spans, own)  # the gateway's own id: the engine's cmpl-<id>
    spans = receiver.trace(root.trace_id)
    assert _children(spans, root) == [
        ("schedule", "", ""),
        ("prefill", "p0", "ok"),
        ("decode", "d-cut", "disconnect"),
        ("resume", "d-good", "ok"),
    ]
    assert "resume" in root.events and root.attributes["http.response.status_code"] == 200
