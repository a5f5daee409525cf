"""A 200 carries the engine's whole answer, whatever its JSON spelling: the stream relay reads events
by their JSON, not by vLLM 0.32's exact bytes.

The engines here are real simulated engines behind a proxy that writes every event again as Python's
``json.dumps`` does (a space after each colon and comma), and may leave the token ids out, as older
vLLM and other OpenAI-compatible servers do. Before the relay read JSON, each of these streams reached
the client as a 200 holding only the usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.engines.reading import Answer, read_answer
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator_support import MODEL, fake_engine, sample, scrape
from tests.integration.recovery_support import Cluster, record
from vllm_disagg import jsonutil
from vllm_disagg.protocol.messages import EngineCapabilities
from vllm_disagg.sim_engine.engine import SimServer

PROMPT = "Spell it any way you like, the answer is the same. " * 3
NO_IDS = EngineCapabilities(known=True)  # an engine whose agent found that it says no token ids


def respell(data: bytes, *, ids: bool) -> bytes:
    """One event's data as ``json.dumps`` writes it; without the token ids when ``ids`` is False."""
    obj = json.loads(data)
    if not ids:
        obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices", ()):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
    return json.dumps(obj).encode()


def respelling_proxy(
    backend: SimServer, *, ids: bool, cut_after: int | None = None, wrote: list[bytes] | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An engine that answers as ``backend`` does, each event respelled (``respell``), one write per
    event; ``cut_after``: the connection closes after that many events, as when the server dies;
    ``wrote``: gets each streamed body as written."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not ids:
            body.pop("return_token_ids", None)  # an engine without ids ignores the field
        async with (
            aiohttp.ClientSession() as session,
            session.post(backend.url + request.path, json=body, headers={"X-Request-Id": "r"}) as up,
        ):
            raw = await up.read()
        if not body.get("stream"):
            return web.Response(body=respell(raw, ids=ids), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": up.headers["Content-Type"]})
        await resp.prepare(request)
        written = b""
        for n, event in enumerate(e for e in raw.split(b"\n\n") if e):
            if n == cut_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            data = event.removeprefix(b"data: ")
            out = b"data: " + (data if data == b"[DONE]" else respell(data, ids=ids)) + b"\n\n"
            written += out
            await resp.write(out)
        await resp.write_eof()
        if wrote is not None:
            wrote.append(written)
        return resp

    return handler


def client_body(route: str, *, usage: bool, max_tokens: int = 12) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": True}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def ask(http: aiohttp.ClientSession, url: str, route: str, body: dict[str, Any]) -> tuple[int, bytes]:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    async with http.post(url + path, data=jsonutil.dumps(body), headers={"X-Request-Id": "r"}) as resp:
        return resp.status, await resp.read()


def same_answer(got: Answer, want: Answer) -> None:
    """What a client reads: the text, finish reasons, usage and token ids (the response's id is the
    gateway's request id in one and the test's in the other)."""
    assert got.text and got.text == want.text, "the whole text, never an empty 200"
    assert (got.finish_reasons, got.usage, got.token_ids) == (want.finish_reasons, want.usage, want.token_ids)
    assert got.done and not got.errors


ROUTES = [pytest.param("completions", id="completions"), pytest.param("chat", id="chat")]
USAGE = [pytest.param(False, id="no-usage"), pytest.param(True, id="with-usage")]


@pytest.mark.parametrize("usage", USAGE)
@pytest.mark.parametrize("route", ROUTES)
async def test_an_engine_that_spaces_its_json_and_says_no_ids_streams_its_whole_answer_through_pd(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory, route: str, usage: bool
) -> None:
    # The case: the agents say nothing of their engines, so the gateway asks for ids as it
    # would of vLLM 0.32, and finds out from the stream that there are none. The prefill's handle does
    # not carry its cache hits (not vLLM 0.32's), so D's usage tells what it loaded: the gateway asks
    # for usage too and keeps the finish event back until the usage chunk comes.
    p, d = await sim_engine(prefill_cache_in_handle=False), await sim_engine(prefill_cache_in_handle=False)
    async with (
        fake_engine(respelling_proxy(p, ids=False)) as p_proxy,
        fake_engine(respelling_proxy(d, ids=False)) as d_proxy,
    ):
        await cluster.add("p0", p_proxy.url, "prefill")
        await cluster.add("d0", d_proxy.url, "decode")
        await cluster.ready(1, 1)
        body = client_body(route, usage=usage)
        status, raw = await ask(http, cluster.server.url, route, body)
        _, direct = await ask(http, d_proxy.url, route, body)
    assert status == 200
    same_answer(
        read_answer(raw, stream=True, chat=route == "chat"),
        read_answer(direct, stream=True, chat=route == "chat"),
    )
    assert b'": ' in raw, (
        "events the gateway had no reason to change reach the client as the engine wrote them"
    )
    rec = await record(http, cluster, "r")
    assert rec["mode"] == "disaggregated" and rec["status"] == 200
    assert rec["relay"] == "not resumable: decode instance 'd0' left out its prompt's ids"
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_streams_not_resumable_total", reason="ids_missing") == 1


@pytest.mark.parametrize("route", ROUTES)
async def test_an_engine_known_to_say_no_ids_is_not_asked_for_them_and_its_stream_is_relayed_as_it_comes(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory, route: str
) -> None:
    wrote: list[bytes] = []
    async with fake_engine(respelling_proxy(await sim_engine(), ids=False, wrote=wrote)) as d_proxy:
        await cluster.add("d0", d_proxy.url, "decode", capabilities=NO_IDS)
        await cluster.ready(0, 1)
        status, raw = await ask(http, cluster.server.url, route, client_body(route, usage=False))
        sent = d_proxy.requests[0]
    assert status == 200
    assert "return_token_ids" not in sent and "stream_options" not in sent, "nothing asked of it"
    assert raw == wrote[0] and b"data: [DONE]" in raw, "the engine's bytes, as they came"
    rec = await record(http, cluster, "r")
    assert (
        rec["relay"]
        == f"not resumable: decode instance 'd0' says no token ids in a streamed {route.rstrip('s')}"
    )
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_streams_not_resumable_total", reason="no_token_ids") == 1


async def test_a_stream_without_ids_cut_mid_way_ends_with_an_error_event_not_a_resume(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    async with fake_engine(respelling_proxy(await sim_engine(), ids=False, cut_after=4)) as cut:
        await cluster.add("d-cut", cut.url, "decode", capabilities=NO_IDS)
        await cluster.add("d-good", (await sim_engine()).url, "decode", busy=True)
        await cluster.ready(0, 2)
        status, raw = await ask(
            http, cluster.server.url, "completions", client_body("completions", usage=False)
        )
    answer = read_answer(raw, stream=True, chat=False)
    assert status == 200 and answer.text, "what the engine sent before it died reached the client"
    assert answer.errors and answer.done and not answer.finish_reasons
    rec = await record(http, cluster, "r")
    assert rec["status"] == 502 and rec["resumes"] == 0


@pytest.mark.parametrize("route", ROUTES)
async def test_a_respelled_stream_with_ids_resumes_elsewhere_as_an_uninterrupted_run(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory, route: str
) -> None:
    backend = await sim_engine()
    async with (
        fake_engine(respelling_proxy(backend, ids=True, cut_after=5)) as cut,
        fake_engine(respelling_proxy(await sim_engine(), ids=True)) as good,
    ):
        await cluster.add("d-cut", cut.url, "decode")
        await cluster.add("d-good", good.url, "decode", busy=True)
        await cluster.ready(0, 2)
        body = client_body(route, usage=True)
        status, raw = await ask(http, cluster.server.url, route, body)
        _, whole = await ask(http, backend.url, route, body)
    chat = route == "chat"
    assert status == 200
    same_answer(read_answer(raw, stream=True, chat=chat), read_answer(whole, stream=True, chat=chat))
    rec = await record(http, cluster, "r")
    assert rec["resumes"] == 1 and rec["status"] == 200 and rec["relay"] == ""
