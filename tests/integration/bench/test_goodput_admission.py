"""``bench goodput --scenario admission``'s client against a fake gateway on loopback: every request
carries its targets, priority and tenant, and each kind of answer (a stream, a refusal with its reason,
a 5xx, a stream cut short) becomes the outcome the report counts."""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.bench.goodput import TraceRequest
from vllm_disagg.bench.goodput_admission import Labelled, one
from vllm_disagg.bench.goodput_admission_report import Outcome, summarise

Seen = list[tuple[dict[str, str], dict[str, object]]]
SEEN = web.AppKey("seen", Seen)


async def answer(request: web.Request) -> web.StreamResponse:
    """Priority 1 is refused; tenant "broken" gets a 503; a prompt "cut" ends its stream early."""
    body = jsonutil.loads(await request.read())
    request.app[SEEN].append((dict(request.headers), body))
    if body["priority"] == 1:
        headers = {"X-Disagg-Shed-Reason": "sheddable", "Retry-After": "1"}
        return web.json_response({"error": {"code": 429}}, status=429, headers=headers)
    if request.headers["x-tenant-id"] == "broken":
        return web.json_response({"error": {"code": 503}}, status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    tokens = body["max_tokens"] - (1 if body["prompt"] == "cut" else 0)
    for i in range(tokens):
        await resp.write(b'data: {"choices":[{"text":" w%d"}]}\n\n' % i)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, Seen]]:
    """A fake gateway's base URL, and what each request to it carried (headers, body)."""
    app = web.Application()
    seen: Seen = []
    app[SEEN] = seen
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


async def test_each_request_carries_its_targets_class_and_tenant_and_each_answer_is_told_apart(
    gateway: tuple[str, Seen],
) -> None:
    url, seen = gateway
    items = [
        Labelled(TraceRequest(0.0, 0, "served", 3), -1, "a"),
        Labelled(TraceRequest(0.01, 0, "refused", 3), 1, "a"),
        Labelled(TraceRequest(0.02, 0, "failed", 3), 0, "broken"),
        Labelled(TraceRequest(0.03, 0, "cut", 3), 0, "b"),
    ]
    args = argparse.Namespace(ttft_ms=1000.0, tpot_ms=50.0, request_timeout_s=10.0)
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        outcomes = [await one(session, url, item, args, start) for item in items]

    for (headers, body), item in zip(seen, items, strict=True):
        assert (headers["x-slo-ttft-ms"], headers["x-slo-tpot-ms"]) == ("1000", "50")
        assert headers["x-tenant-id"] == item.tenant
        assert (body["priority"], body["prompt"], body["stream"]) == (
            item.priority,
            item.request.prompt,
            True,
        )
    served, refused, failed, cut = outcomes
    assert (served.status, served.ok, served.shed_reason) == (200, True, "")
    assert served.ttft_s > 0 and served.meets(ttft_ms=60_000, tpot_ms=60_000)
    assert refused == Outcome(0.01, 1, "a", 429, False, shed_reason="sheddable")
    assert (failed.status, failed.ok) == (503, False)
    assert (cut.status, cut.ok) == (200, False)  # two tokens of three: not met, whatever its timing

    p = summarise("on", 1.0, 1.0, outcomes, ttft_ms=60_000, tpot_ms=60_000, warmup_s=0.0, window_s=1.0)
    assert (p.total.requests, p.total.met, p.total.refused) == (4, 1, 1)
    assert (p.shed, p.server_errors, p.failed) == ({"sheddable": 1}, 1, 1)
    assert sorted(p.classes) == [-1, 0, 1] and sorted(p.tenants) == ["a", "b", "broken"]
