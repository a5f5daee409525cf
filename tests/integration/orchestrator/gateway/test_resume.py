"""Mid-stream resume on real sockets: a decode engine that breaks off mid-stream, and the client's
stream going on from another instance, byte for byte what an uninterrupted run sends.

The failing engine is a proxy in front of a real simulated engine: it relays the first events of the
real stream and then fails the way vLLM does (docs/vllm-resume-facts.md §4): the API server killed
(the connection closes between events, no ``[DONE]``), or the engine core killed (an error event, then
``[DONE]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator_support import MODEL, fake_engine, sample, scrape
from tests.integration.recovery_support import Cluster, attempts, record
from vllm_disagg import jsonutil
from vllm_disagg.chaos.check import Checker, RequestSpec
from vllm_disagg.sim_engine.engine import SimServer

CHECKER = Checker(MODEL)
ENGINE_CORE_DIED = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root '
    b'cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\ndata: [DONE]\n\n'
)


def cutting_proxy(
    backend: SimServer, events: int, how: str
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An engine that streams the first ``events`` events of ``backend``'s answer, then fails."""

    async def handler(request: web.Request) -> web.StreamResponse:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                backend.url + request.path, data=await request.read(), headers=request.headers
            ) as up,
        ):
            raw = await up.read()
            resp = web.StreamResponse(headers={"Content-Type": up.headers["Content-Type"]})
            await resp.prepare(request)
            for event in raw.split(b"\n\n")[:events]:
                await resp.write(event + b"\n\n")
            if how == "engine-core-died":
                await resp.write(ENGINE_CORE_DIED)
                await resp.write_eof()
            else:  # the API server died: the connection closes between events
                assert request.transport is not None
                request.transport.close()
            return resp

    return handler


def spec(request_id: str, kind: str, *, usage: bool = False, max_tokens: int = 12) -> RequestSpec:
    if kind == "completion":
        return RequestSpec(
            request_id,
            "completion",
            True,
            max_tokens,
            prompt="Resume me, byte for byte. " * 3,
            include_usage=usage,
        )
    return RequestSpec(
        request_id,
        "chat",
        True,
        max_tokens,
        messages=(("system", "Be brief."), ("user", "Resume me, byte for byte. " * 3)),
        include_usage=usage,
    )


async def stream(http: aiohttp.ClientSession, cluster: Cluster, s: RequestSpec) -> tuple[int, bytes]:
    async with http.post(
        cluster.server.url + ("/v1/completions" if s.kind == "completion" else "/v1/chat/completions"),
        data=s.body(MODEL),
        headers={"X-Request-Id": s.request_id, "Content-Type": "application/json"},
    ) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("how", ["api-server-died", "engine-core-died"])
@pytest.mark.parametrize(
    ("kind", "events", "usage"),
    [
        pytest.param("completion", 1, False, id="completion-cut-after-the-first-token"),
        pytest.param("completion", 5, True, id="completion-with-usage-cut-after-five"),
        pytest.param("chat", 1, False, id="chat-cut-after-the-role-chunk"),
        pytest.param("chat", 6, True, id="chat-with-usage-cut-after-five-tokens"),
    ],
)
async def test_a_stream_cut_mid_way_resumes_elsewhere_and_the_client_sees_an_uninterrupted_run(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    how: str,
    kind: str,
    events: int,
    usage: bool,
) -> None:
    backend = await sim_engine()
    async with fake_engine(cutting_proxy(backend, events, how)) as cut:
        await cluster.add("p0", (await sim_engine()).url, "prefill")
        await cluster.add("d-cut", cut.url, "decode")
        await cluster.add("d-good", (await sim_engine()).url, "decode", busy=True)
        await cluster.ready(1, 2)
        s = spec(f"resume-{kind}-{events}-{how}", kind, usage=usage)
        status, raw = await stream(http, cluster, s)
    verdict = CHECKER.check(s, status, raw)
    assert verdict.outcome == "completed", verdict.reason
    assert b'"token_ids":[' not in raw, "the ids the gateway asked for never reach a client that did not"
    rec = await record(http, cluster, s.request_id)
    assert rec["status"] == 200 and rec["resumes"] == 1
    assert attempts(rec)[-2:] == [
        ("decode", "d-cut", "disconnect" if how == "api-server-died" else "status"),
        ("resume", "d-good", "ok"),
    ]
    samples = await scrape(http, cluster.server.url)
    assert sum(v for (name, _), v in samples.items() if name == "vllm_disagg_resumes_total") == 1
    assert sample(samples, "vllm_disagg_instance_in_flight", instance="d-good") == 0


async def test_a_client_that_asked_for_token_ids_gets_them_once_across_a_resume(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    backend = await sim_engine()
    async with fake_engine(cutting_proxy(backend, 4, "api-server-died")) as cut:
        await cluster.add("d-cut", cut.url, "decode")
        await cluster.add("d-good", (await sim_engine()).url, "decode", busy=True)
        await cluster.ready(0, 2)
        body = {
            "model": MODEL,
            "prompt": "Ids, please. " * 4,
            "max_tokens": 10,
            "stream": True,
            "return_token_ids": True,
        }
        async with http.post(f"{cluster.server.url}/v1/completions", data=jsonutil.dumps(body)) as resp:
            raw = await resp.read()
        async with http.post(f"{backend.url}/v1/completions", data=jsonutil.dumps(body)) as resp:
            reference = await resp.read()
    events = [jsonutil.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    want = [jsonutil.loads(e[6:]) for e in reference.split(b"\n\n") if e.startswith(b"data: {")]
    got_ids = [c["choices"][0]["token_ids"] for c in events]
    assert got_ids == [c["choices"][0]["token_ids"] for c in want]
    prompts = [c["choices"][0]["prompt_token_ids"] for c in events]
    assert prompts[0] == want[0]["choices"][0]["prompt_token_ids"] and not any(prompts[1:])


async def test_resumes_stop_at_the_cap_and_the_stream_then_ends_with_an_error_event(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    # Every decode instance breaks off after one more event: 3 resumes (the cap), then an honest end.
    async with contextlib.AsyncExitStack() as stack:
        for n in range(5):
            engine = await stack.enter_async_context(
                fake_engine(cutting_proxy(await sim_engine(), 2, "api-server-died"))
            )
            await cluster.add(f"d{n}", engine.url, "decode")
        await cluster.ready(0, 5)
        s = spec("capped", "completion", max_tokens=30)
        status, raw = await stream(http, cluster, s)
    assert status == 200
    assert b'data: {"error"' in raw and raw.endswith(b"data: [DONE]\n\n")
    rec = await record(http, cluster, "capped")
    assert rec["resumes"] == 3 and rec["status"] == 502
    assert [leg for leg, _, _ in attempts(rec)] == ["decode", "resume", "resume", "resume"]
