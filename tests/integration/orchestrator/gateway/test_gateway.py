"""The gateway on real sockets: P -> D handoff, colocated fallback, validation, engine failures, streams."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ADMIN, eventually, free_port
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator_support import MODEL, FakeAgent, fake_engine, orch_config, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.sim_engine.engine import SimServer
from vllm_disagg.sim_engine.textgen import expected_chat_text, expected_text

# Several full KV blocks (16 tokens each in the sim), so the handoff moves real blocks.
PROMPT = "The quick brown fox jumps over the lazy dog while the gateway relays every byte. " * 2
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
KV_FROM_PREFILL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 1, 4],
    "remote_engine_id": "engine-p",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
    "extra": {"nested": [None, 1.5]},
}


async def wait_ready(orch: OrchestratorServer, prefill: int, decode: int) -> None:
    def ready() -> bool:
        snap = orch.registry.snapshot()
        return (
            len(snap.ready_prefill.get(MODEL, ())) == prefill
            and len(snap.ready_decode.get(MODEL, ())) == decode
        )

    await eventually(ready, what=f"{prefill}P{decode}D ready")


@pytest.fixture
async def pd(
    orch: OrchestratorServer, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> AsyncIterator[tuple[SimServer, SimServer]]:
    """One simulated prefill and one simulated decode engine, registered and ready."""
    p, d = await sim_engine(), await sim_engine()
    await fake_agent("p0", p.url, "prefill")
    await fake_agent("d0", d.url, "decode")
    await wait_ready(orch, 1, 1)
    yield p, d


def request_body(route: str, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "temperature": 0}
    if route == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def expected(route: str, max_tokens: int = 8) -> str:
    if route == "/v1/completions":
        return expected_text(PROMPT, max_tokens)
    return expected_chat_text(MESSAGES, max_tokens)


def text_of(route: str, raw: bytes, stream: bool) -> str:
    """The generated text of a response, streamed (SSE) or not."""
    if not stream:
        choice = jsonutil.loads(raw)["choices"][0]
        return str(choice["text"] if route == "/v1/completions" else choice["message"]["content"])
    events = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", "a complete stream ends with [DONE]"
    out = []
    for event in events[:-1]:
        for choice in jsonutil.loads(event).get("choices", []):
            out.append(choice.get("text") if route == "/v1/completions" else choice["delta"].get("content"))
    return "".join(t for t in out if t)


ROUTES = [pytest.param("/v1/completions", id="completions"), pytest.param("/v1/chat/completions", id="chat")]
STREAMS = [pytest.param(False, id="non-stream"), pytest.param(True, id="stream")]
_CREATED = re.compile(rb'"created":\s*\d+')


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("route", ROUTES)
async def test_1p1d_output_equals_the_model_and_kv_moves_from_p_to_d(
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    pd: tuple[SimServer, SimServer],
    route: str,
    stream: bool,
) -> None:
    p, d = pd
    async with http.post(
        orch.url + route,
        data=jsonutil.dumps(request_body(route, stream)),
        headers={"X-Request-Id": "req-123"},
    ) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        headers = resp.headers
    assert text_of(route, raw, stream) == expected(route)
    assert headers["X-Request-Id"] == "req-123"
    assert (headers["X-Disagg-Mode"], headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"]) == (
        "disaggregated",
        "p0",
        "d0",
    )
    if stream:
        assert headers["Content-Type"].startswith("text/event-stream")

    p_metrics, d_metrics = await scrape(http, p.url), await scrape(http, d.url)
    assert sample(p_metrics, "vllm:request_params_max_tokens_count") == 1
    assert sample(p_metrics, "vllm:request_params_max_tokens_bucket", le="1.0") == 1, (
        "P ran a max_tokens=1 leg"
    )
    assert sample(d_metrics, "vllm:request_params_max_tokens_sum") == 8, "D ran the client's max_tokens"
    assert sample(d_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert sample(p_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


@pytest.mark.parametrize("stream", STREAMS)
@pytest.mark.parametrize("route", ROUTES)
async def test_the_openai_routes_answer_alike_past_the_router_and_through_it(
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    pd: tuple[SimServer, SimServer],
    route: str,
    stream: bool,
) -> None:
    """A plain POST, with or without ``Expect: 100-continue``, is served by the gateway's own HTTP
    server; a query string hands the connection to aiohttp's application. All give the same bytes and
    headers; other methods are still a 405."""
    answers = []
    for n, (suffix, extra) in enumerate([("", {}), ("?via=router", {}), ("", {"Expect": "100-continue"})]):
        headers = {"X-Request-Id": f"alike-{n}", "Content-Type": "application/json", **extra}
        async with http.post(
            orch.url + route + suffix, data=jsonutil.dumps(request_body(route, stream)), headers=headers
        ) as resp:
            raw = await resp.read()
            assert resp.status == 200, raw
            ids = ("date", "x-request-id", "x-disagg-request-id")
            got = {k.lower(): v for k, v in resp.headers.items() if k.lower() not in ids}
            assert resp.headers["X-Request-Id"] == f"alike-{n}"
            own = resp.headers["X-Disagg-Request-Id"]  # the engine's request id: the gateway's own
        # The engine stamps each answer with its second: three answers may straddle one.
        same = _CREATED.sub(b'"created":0', raw.replace(own.encode(), b"ID"))
        answers.append((same, got))
    assert answers[0] == answers[1] == answers[2]
    assert text_of(route, answers[0][0], stream) == expected(route)
    async with http.get(orch.url + route) as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"


async def test_both_legs_carry_the_request_id_and_kv_params_pass_unchanged(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    decode_answer = b'{"id":"from-d",  "choices": [{"text": " ok"}]}'  # odd spacing: proves no re-serialising

    async def prefill(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": KV_FROM_PREFILL})

    async def decode(request: web.Request) -> web.Response:
        return web.Response(body=decode_answer, content_type="application/json")

    async with fake_engine(prefill) as p, fake_engine(decode) as d:
        await fake_agent("p0", p.url, "prefill")
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 1, 1)
        client_body = request_body("/v1/completions", stream=True) | {
            "max_completion_tokens": 8,
            "stream": False,
        }
        async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(client_body)) as resp:
            assert resp.status == 200
            assert await resp.read() == decode_answer
            request_id = resp.headers["X-Request-Id"]

    assert len(request_id) == 32 and int(request_id, 16) >= 0, "a generated id is uuid4 hex"
    assert p.headers[0]["X-Request-Id"] == d.headers[0]["X-Request-Id"] == request_id
    sent_to_p = p.requests[0]
    assert (sent_to_p["max_tokens"], sent_to_p["max_completion_tokens"], sent_to_p["stream"]) == (1, 1, False)
    assert "stream_options" not in sent_to_p
    assert sent_to_p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert d.requests[0] == client_body | {"kv_transfer_params": KV_FROM_PREFILL}


@pytest.mark.parametrize(
    ("config", "engines_see"),
    [
        ({}, None),
        ({"engine_api_key": "engine-key-0123456789"}, "Bearer engine-key-0123456789"),
        ({"forward_client_authorization": True}, "Bearer the-clients-own-key"),
        (
            {"forward_client_authorization": True, "engine_api_key": "engine-key-0123456789"},
            "Bearer engine-key-0123456789",
        ),
    ],
    ids=["stripped-by-default", "the-gateways-engine-key", "the-client-header-when-asked", "the-key-wins"],
)
async def test_a_clients_authorization_reaches_engines_only_when_configured(
    http: aiohttp.ClientSession, config: dict[str, Any], engines_see: str | None
) -> None:
    async def prefill(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": KV_FROM_PREFILL})

    async def decode(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": " ok"}]})

    orch = await start_orchestrator(orch_config(**config), shutdown_timeout_s=1.0)
    agents = []
    try:
        async with fake_engine(prefill) as p, fake_engine(decode) as d:
            for agent_id, engine, role in (("p0", p, "prefill"), ("d0", d, "decode")):
                agent = FakeAgent(orch.zmq_endpoint, agent_id, engine.url, role)  # type: ignore[arg-type]
                agents.append(agent)
                await agent.join()
            await wait_ready(orch, 1, 1)
            headers = {"Authorization": "Bearer the-clients-own-key"}
            body = jsonutil.dumps(request_body("/v1/completions", stream=False))
            async with http.post(f"{orch.url}/v1/completions", data=body, headers=headers) as resp:
                assert resp.status == 200
        assert [h.get("Authorization") for h in (*p.headers, *d.headers)] == [engines_see, engines_see]
    finally:
        for agent in agents:
            await agent.close()
        await orch.close()


@pytest.mark.parametrize("stream", STREAMS)
async def test_colocated_on_decode_when_no_prefill_instance_is_ready(
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    stream: bool,
) -> None:
    d = await sim_engine()
    await fake_agent("d0", d.url, "decode")
    await wait_ready(orch, 0, 1)
    route = "/v1/completions"
    async with http.post(orch.url + route, data=jsonutil.dumps(request_body(route, stream))) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        assert (resp.headers["X-Disagg-Mode"], resp.headers["X-Disagg-Prefill"]) == ("colocated", "")
        assert resp.headers["X-Disagg-Decode"] == "d0"
    assert text_of(route, raw, stream) == expected(route)
    d_metrics = await scrape(http, d.url)
    assert sample(d_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert sample(d_metrics, "vllm:prompt_tokens_by_source_total", source="local_compute") > 0


async def test_colocated_body_reaches_decode_unchanged_but_for_control_fields(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    async def decode(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    async with fake_engine(decode) as d:
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 0, 1)
        body = {"model": MODEL, "prompt": "p", "max_tokens": 3, "user": "u", "extra": {"a": [1]}}
        for sent in (body, body | {"kv_transfer_params": None}):  # even a null one is the gateway's
            async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(sent)) as resp:
                assert resp.status == 200
    assert d.requests == [body, body]


BIG = b'{"model": "sim-model", "prompt": "' + b"x" * 5000 + b'"}'


@pytest.mark.parametrize(
    ("route", "raw", "status", "fragment"),
    [
        pytest.param("/v1/completions", b"{nope", 400, "not valid JSON", id="malformed-json-is-400"),
        pytest.param("/v1/completions", b"[]", 400, "must be a JSON object", id="non-object-is-400"),
        pytest.param("/v1/completions", b'{"prompt": "x"}', 400, "'model'", id="missing-model-is-400"),
        pytest.param(
            "/v1/completions",
            b'{"model": "nope", "prompt": "x"}',
            404,
            "'nope' does not exist",
            id="unknown-model-404",
        ),
        pytest.param(
            "/v1/completions", b'{"model": "sim-model"}', 400, "'prompt'", id="missing-prompt-is-400"
        ),
        pytest.param(
            "/v1/chat/completions", b'{"model": "sim-model"}', 400, "'messages'", id="missing-messages-is-400"
        ),
        pytest.param(
            "/v1/completions",
            b'{"model": "sim-model", "prompt": "x", "max_tokens": -3}',
            400,
            "'max_tokens'",
            id="negative-max-tokens-is-400",
        ),
        pytest.param(
            "/v1/completions",
            b'{"model": "sim-model", "prompt": "x", "stream": 1}',
            400,
            "'stream'",
            id="non-bool-stream-is-400",
        ),
        pytest.param("/v1/completions", BIG, 413, "over the limit of 4096 bytes", id="oversized-body-is-413"),
    ],
)
async def test_bad_input_gets_an_openai_error_and_the_service_keeps_serving(
    http: aiohttp.ClientSession, sim_engine: EngineFactory, route: str, raw: bytes, status: int, fragment: str
) -> None:
    server = await start_orchestrator(orch_config(max_body_bytes=4096), shutdown_timeout_s=1.0)
    d0 = FakeAgent(server.zmq_endpoint, "d0", (await sim_engine()).url, "decode")
    try:
        await d0.join()
        await wait_ready(server, 0, 1)
        async with http.post(
            server.url + route, data=raw, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == status
            assert resp.headers["Content-Type"].startswith("application/json")
            error = jsonutil.loads(await resp.read())["error"]
            assert resp.headers["X-Request-Id"]
        assert fragment in error["message"]
        assert error["code"] == status
        assert error["type"].endswith("Error")

        good = {"model": MODEL, "prompt": "still here", "max_tokens": 2}
        async with http.post(f"{server.url}/v1/completions", data=jsonutil.dumps(good)) as resp:
            assert resp.status == 200
            assert jsonutil.loads(await resp.read())["choices"][0]["text"] == expected_text("still here", 2)
        samples = await scrape(http, server.url)
        assert sample(samples, "vllm_disagg_requests_total", mode="none", status=str(status)) == 1
    finally:
        await d0.close()
        await server.close()


async def test_known_model_without_a_ready_decode_instance_is_503(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    d0 = await fake_agent("d0", (await sim_engine()).url, "decode")
    await wait_ready(orch, 0, 1)
    d0.engine_state = "unhealthy"
    await eventually(lambda: not orch.registry.snapshot().ready_decode, what="d0 not ready")
    async with http.post(
        f"{orch.url}/v1/completions", data=jsonutil.dumps({"model": MODEL, "prompt": "x"})
    ) as resp:
        assert resp.status == 503
        assert "no ready instance can decode" in (await resp.json())["error"]["message"]


async def test_a_decode_instance_that_is_down_is_a_clear_502_naming_it_when_no_other_instance_is_left(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    await fake_agent("d0", dead_url, "decode")
    await wait_ready(orch, 0, 1)
    async with asyncio.timeout(30):  # never hangs
        async with http.post(
            f"{orch.url}/v1/completions", data=jsonutil.dumps(request_body("/v1/completions", False))
        ) as resp:
            assert resp.status == 502
            message = (await resp.json())["error"]["message"]
    assert "decode instance 'd0'" in message
    assert "unreachable" in message
    samples = await scrape(http, orch.url)
    assert sample(samples, "vllm_disagg_upstream_errors_total", leg="decode", kind="connect") == 1
    assert sample(samples, "vllm_disagg_instance_in_flight", instance="d0") == 0


async def test_decode_error_status_is_relayed_as_is(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    refusal = b'{"error": {"message": "max_tokens too large", "code": 400}}'

    async def decode(request: web.Request) -> web.Response:
        return web.Response(status=400, body=refusal, content_type="application/json")

    async with fake_engine(decode) as d:
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 0, 1)
        for stream in (False, True):
            body = jsonutil.dumps({"model": MODEL, "prompt": "x", "stream": stream})
            async with http.post(f"{orch.url}/v1/completions", data=body) as resp:
                assert resp.status == 400
                assert await resp.read() == refusal


async def _drop_before_first_byte(request: web.Request) -> web.Response:
    assert request.transport is not None
    request.transport.close()
    return web.Response()


async def test_decode_failing_before_the_first_byte_is_a_502_for_a_stream(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    async with fake_engine(_drop_before_first_byte) as d:
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 0, 1)
        body = jsonutil.dumps({"model": MODEL, "prompt": "x", "stream": True})
        async with http.post(f"{orch.url}/v1/completions", data=body) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["message"].startswith("decode instance 'd0'")


async def test_client_disconnect_cancels_the_engine_request_and_releases_in_flight(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": " one"}]}\n\n')
        await asyncio.Event().wait()  # a long generation; only a disconnect ends it
        return resp

    async with fake_engine(decode) as d:
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 0, 1)
        body = jsonutil.dumps({"model": MODEL, "prompt": "x", "stream": True})
        resp = await http.post(f"{orch.url}/v1/completions", data=body, headers={"X-Request-Id": "leaver"})
        try:
            assert resp.status == 200
            assert b" one" in await resp.content.readany()
            assert orch.registry.snapshot().in_flight_of("d0") == 1
        finally:
            resp.close()  # the client goes away mid-stream
        await asyncio.wait_for(d.disconnected.wait(), timeout=15)
        await eventually(lambda: orch.registry.snapshot().in_flight_of("d0") == 0, what="in-flight released")

    async def recorded() -> dict[str, Any] | None:
        async with http.get(f"{orch.url}/admin/v1/requests/leaver", headers=ADMIN) as r:
            return dict(await r.json()) if r.status == 200 else None

    record: dict[str, Any] = await eventually(recorded, what="request record")
    assert record["status"] == 499


async def test_request_records_explain_where_a_request_went(
    orch: OrchestratorServer, http: aiohttp.ClientSession, pd: tuple[SimServer, SimServer]
) -> None:
    body = jsonutil.dumps(request_body("/v1/completions", False))
    async with http.post(
        f"{orch.url}/v1/completions", data=body, headers={"X-Request-Id": "explain-me"}
    ) as resp:
        assert resp.status == 200
        own = resp.headers["X-Disagg-Request-Id"]
    async with http.get(f"{orch.url}/admin/v1/requests/explain-me", headers=ADMIN) as resp:
        record = await resp.json()  # found by the client's id; kept under the gateway's own
    assert (record["request_id"], record["client_request_id"]) == (own, "explain-me")
    assert (record["mode"], record["prefill"], record["decode"], record["status"]) == (
        "disaggregated",
        "p0",
        "d0",
        200,
    )
    explanation = record["explanation"]
    assert explanation["scheduler"] == "plugins"
    assert (explanation["decode"]["pick"], explanation["prefill"]["pick"]) == ("d0", "p0")
    assert explanation["decider"]["mode"] == "disaggregated"
    assert 0 <= record["schedule_s"] <= record["total_s"]
    assert 0 <= record["prefill_s"] <= record["ttfb_s"] <= record["total_s"]
    timeline = record["timeline"]
    order = ["scheduled", "prefill_start", "prefill_end", "decode_start", "last_token"]
    assert list(timeline) == order, "a non-streaming answer has no separate first token"
    assert [timeline[k] for k in order] == sorted(timeline[k] for k in order)
    assert timeline["last_token"] <= record["total_s"]
    assert record["stages"]["prefill_s"] == pytest.approx(record["prefill_s"], abs=1e-5)
    assert record["stages"]["handoff_s"] >= 0
    async with http.get(f"{orch.url}/admin/v1/requests?limit=5", headers=ADMIN) as resp:
        assert [r["client_request_id"] for r in (await resp.json())["requests"]] == ["explain-me"]
    async with http.get(f"{orch.url}/admin/v1/requests/never-seen", headers=ADMIN) as resp:
        assert resp.status == 404


async def test_models_lists_models_of_ready_instances_only(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await fake_agent("d0", (await sim_engine()).url, "decode")
    other = await fake_agent("d1", (await sim_engine(model="other-model")).url, "decode", model="other-model")
    await eventually(lambda: len(orch.registry.snapshot().ready_models()) == 2, what="both models")
    async with http.get(f"{orch.url}/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["other-model", MODEL]
    other.draining = True
    await eventually(lambda: orch.registry.snapshot().ready_models() == [MODEL], what="other drained")
    async with http.get(f"{orch.url}/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
