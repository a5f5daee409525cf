"""Pinning the decode instance, or the pair, through the real gateway with simulated engines: the
response headers say where the request ran, an unusable pin is a 400 saying why, and a pinned decode
instance that fails is the client's error, never a silent move to another instance.

In each cluster the instances a pin names are busy (``busy=True``), so the scheduler left to itself
would pick others: a header naming them shows the pin was followed.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator.gateway.test_resume import cutting_proxy, spec
from tests.integration.orchestrator_support import MODEL, FakeAgent, fake_engine
from tests.integration.recovery_support import PROMPT, Cluster, attempts, record, text_of
from vllm_disagg import jsonutil
from vllm_disagg.protocol.messages import InstanceInfo, Role
from vllm_disagg.sim_engine.textgen import expected_text


async def _post(
    http: aiohttp.ClientSession,
    cluster: Cluster,
    request_id: str,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    *,
    stream: bool = False,
) -> tuple[int, bytes, dict[str, str]]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": stream, **(extra or {})}
    async with http.post(
        f"{cluster.server.url}/v1/completions",
        data=jsonutil.dumps(body),
        headers={"X-Request-Id": request_id, **(headers or {})},
    ) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


async def _two_by_two(cluster: Cluster, sim_engine: EngineFactory) -> None:
    """p-idle and d-idle, which the scheduler would pick; p-busy and d-busy, which a pin names."""
    instances: tuple[tuple[str, Role, bool], ...] = (
        ("p-idle", "prefill", False),
        ("p-busy", "prefill", True),
        ("d-idle", "decode", False),
        ("d-busy", "decode", True),
    )
    for agent_id, role, busy in instances:
        await cluster.add(agent_id, (await sim_engine()).url, role, busy=busy)
    await cluster.ready(2, 2)


@pytest.mark.parametrize(
    ("headers", "extra", "where"),
    [
        pytest.param({}, {}, ("p-idle", "d-idle"), id="no-pin-the-scheduler-picks-the-idle-pair"),
        pytest.param({"X-Disagg-Decode": "d-busy"}, {}, ("p-idle", "d-busy"), id="decode-by-header"),
        pytest.param({}, {"decode_endpoint": "d-busy"}, ("p-idle", "d-busy"), id="decode-by-body"),
        pytest.param(
            {"X-Disagg-Prefill": "p-busy", "X-Disagg-Decode": "d-busy"},
            {},
            ("p-busy", "d-busy"),
            id="pair-by-headers",
        ),
        pytest.param(
            {"X-Disagg-Decode": "d-busy"},
            {"prefill_endpoint": "p-busy"},
            ("p-busy", "d-busy"),
            id="pair-by-body-and-header",
        ),
    ],
)
async def test_a_client_pins_the_decode_instance_or_the_pair_and_the_headers_say_where_it_ran(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    headers: dict[str, str],
    extra: dict[str, Any],
    where: tuple[str, str],
) -> None:
    await _two_by_two(cluster, sim_engine)
    status, raw, out = await _post(http, cluster, "pin", headers, extra)
    assert status == 200, raw
    assert text_of(raw, False) == expected_text(PROMPT, 8)
    assert (out["X-Disagg-Mode"], out["X-Disagg-Prefill"], out["X-Disagg-Decode"]) == (
        "disaggregated",
        *where,
    )
    rec = await record(http, cluster, "pin")
    assert attempts(rec) == [("prefill", where[0], "ok"), ("decode", where[1], "ok")]
    pinned_d = "X-Disagg-Decode" in headers or "decode_endpoint" in extra
    assert rec["explanation"]["pinned_decode"] == (where[1] if pinned_d else None)


async def test_the_decode_pin_field_never_reaches_an_engine(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    async def engine(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": " ok"}]})

    async with fake_engine(engine) as d:
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(0, 1)
        status, raw, out = await _post(http, cluster, "field", extra={"decode_endpoint": d.url})
        assert status == 200, raw
    assert out["X-Disagg-Decode"] == "d0"
    assert d.requests and all("decode_endpoint" not in body for body in d.requests)


@pytest.mark.parametrize(
    ("headers", "extra", "reason"),
    [
        pytest.param(
            {"X-Disagg-Decode": "nope"},
            {},
            "the pinned decode instance 'nope' is not registered",
            id="unknown",
        ),
        pytest.param(
            {},
            {"decode_endpoint": "p-idle"},
            "the pinned decode instance 'p-idle' has role 'prefill' and cannot decode",
            id="a-prefill-instance-pinned-as-decode",
        ),
        pytest.param(
            {"X-Disagg-Prefill": "b0", "X-Disagg-Decode": "b0"},
            {},
            "the instance 'b0' is pinned as both the prefill and the decode instance",
            id="one-instance-as-both",
        ),
        pytest.param(
            {"X-Disagg-Prefill": "p-other", "X-Disagg-Decode": "d-idle"},
            {},
            "the pinned prefill instance 'p-other' and decode instance 'd-idle' cannot exchange KV: "
            "KV connector differs: prefill 'OtherConnector', decode ''",
            id="a-pair-whose-kv-cannot-move",
        ),
        pytest.param(
            {"X-Disagg-Decode": "d-idle"}, {"decode_endpoint": "d-busy"}, "disagree", id="header-and-body"
        ),
    ],
)
async def test_an_unusable_decode_or_pair_pin_is_a_400_with_the_reason(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    headers: dict[str, str],
    extra: dict[str, Any],
    reason: str,
) -> None:
    await _two_by_two(cluster, sim_engine)
    await cluster.add("b0", (await sim_engine()).url, "both")
    url = (await sim_engine()).url
    other = InstanceInfo(url=url, role="prefill", model=MODEL, engine="sim", kv_connector="OtherConnector")
    agent = FakeAgent(cluster.server.zmq_endpoint, "p-other", url, "prefill", interval_s=0.05, info=other)
    cluster.agents.append(agent)
    await agent.join()
    await cluster.ready(4, 3)
    status, raw, _ = await _post(http, cluster, "bad-pin", headers, extra)
    assert status == 400, raw
    error = jsonutil.loads(raw)["error"]
    assert reason in error["message"]
    assert error["param"] == "decode_endpoint"
    # The gateway keeps serving.
    status, raw, _ = await _post(http, cluster, "after")
    assert status == 200, raw


async def _status_500(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "boom in the engine"}}, status=500)


@pytest.mark.parametrize(
    ("pinned", "status", "legs"),
    [
        pytest.param(
            False,
            200,
            [
                ("prefill", "p0", "ok"),
                ("decode", "d-bad", "status"),
                ("prefill", "p0", "ok"),
                ("decode", "d-good", "ok"),
            ],
            id="unpinned-retried-on-another-decode-instance",
        ),
        pytest.param(
            True,
            502,
            [("prefill", "p0", "ok"), ("decode", "d-bad", "status")],
            id="pinned-the-client-gets-the-error",
        ),
    ],
)
async def test_a_pinned_decode_instance_that_fails_is_never_retried_elsewhere(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    pinned: bool,
    status: int,
    legs: list[tuple[str, str, str]],
) -> None:
    async with fake_engine(_status_500) as bad:
        await cluster.add("p0", (await sim_engine()).url, "prefill")
        await cluster.add("d-bad", bad.url, "decode")
        await cluster.add("d-good", (await sim_engine()).url, "decode", busy=True)
        await cluster.ready(1, 2)
        headers = {"X-Disagg-Decode": "d-bad"} if pinned else {}
        got, raw, out = await _post(http, cluster, "pinned-fails", headers)
    assert got == status, raw
    rec = await record(http, cluster, "pinned-fails")
    assert attempts(rec) == legs
    if pinned:
        assert "decode instance 'd-bad'" in jsonutil.loads(raw)["error"]["message"]
        assert out["X-Disagg-Decode"] == "d-bad"


@pytest.mark.parametrize(
    ("pinned", "status", "resumes"),
    [
        pytest.param(False, 200, 1, id="unpinned-resumed-on-another-instance"),
        pytest.param(True, 502, 0, id="pinned-the-stream-ends-with-the-error"),
    ],
)
async def test_a_pinned_decode_instance_that_cuts_its_stream_is_never_resumed_elsewhere(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    pinned: bool,
    status: int,
    resumes: int,
) -> None:
    backend = await sim_engine()
    s = spec("pinned-cut", "completion")
    async with fake_engine(cutting_proxy(backend, 2, "api-server-died")) as cut:
        await cluster.add("d-cut", cut.url, "decode")
        await cluster.add("d-good", (await sim_engine()).url, "decode", busy=True)
        await cluster.ready(0, 2)
        headers = {"X-Request-Id": s.request_id, "Content-Type": "application/json"}
        if pinned:
            headers["X-Disagg-Decode"] = "d-cut"
        async with http.post(
            f"{cluster.server.url}/v1/completions", data=s.body(MODEL), headers=headers
        ) as resp:
            assert resp.status == 200, "the headers were out before the engine failed"
            raw = await resp.read()
    rec = await record(http, cluster, s.request_id)
    assert (rec["status"], rec["resumes"]) == (status, resumes)
    legs = attempts(rec)
    assert legs[0] == ("decode", "d-cut", "disconnect")
    if pinned:
        assert legs == [("decode", "d-cut", "disconnect")], "never moved to d-good"
        events = [e for e in raw.split(b"\n\n") if e]
        assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
    else:
        assert legs[-1] == ("resume", "d-good", "ok")
