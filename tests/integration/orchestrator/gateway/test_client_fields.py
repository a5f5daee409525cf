"""What a client may not send an engine, on real sockets: control fields and request ids (issue 31).

Every engine here is a recording proxy in front of a real simulated engine (``FakeEngine`` keeps each
body it was sent), so a leg that carried a client's ``kv_transfer_params``, ``ec_transfer_params``,
``request_id`` or pin field would be seen — in the prefill, decode, colocated and resumed legs alike.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ADMIN
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator.gateway.test_resume import cutting_proxy
from tests.integration.orchestrator_support import MODEL, FakeEngine, fake_engine
from tests.integration.recovery_support import Cluster, attempts, record
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.gateway.request_ids import MAX_CLIENT_ID, OWN_HEADER
from vllm_disagg.sim_engine.engine import SimServer
from vllm_disagg.wire.kv_transfer import PREFILL_LEG

PROMPT = "Only the gateway gives engines orders; clients give them prompts. " * 3
# What a hostile client adds: a NIXL handle naming a host, engine and blocks of its choosing (and a
# chat prompt of its own ids), the encoder cache's the same, and an engine request id to collide with.
HOSTILE: dict[str, Any] = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "remote_host": "203.0.113.9",
        "remote_port": 5600,
        "remote_engine_id": "evil-engine",
        "remote_block_ids": [7, 8, 9],
        "prompt_token_ids": [1, 2, 3],
    },
    "ec_transfer_params": {"do_remote_encode": True, "remote_host": "203.0.113.9"},
    "request_id": "someone-elses-request",
}
OWN = OWN_HEADER.lower()  # response headers as read here: lower case
GATEWAY_ONLY = ("ec_transfer_params", "request_id", "prefill_endpoint", "decode_endpoint")


def relay(backend: SimServer) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An engine that is ``backend``, its answers passed on whole (``FakeEngine`` keeps the bodies)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                backend.url + request.path, data=await request.read(), headers=request.headers
            ) as up,
        ):
            return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)

    return handler


def body(chat: bool, stream: bool, **extra: Any) -> bytes:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": stream, "temperature": 0}
    if chat:
        out["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        out["prompt"] = PROMPT
    return jsonutil.dumps(out | HOSTILE | extra)


async def post(
    http: aiohttp.ClientSession, cluster: Cluster, data: bytes, *, chat: bool = False, request_id: str = ""
) -> tuple[int, bytes, dict[str, str]]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    async with http.post(cluster.server.url + path, data=data, headers=headers) as resp:
        return resp.status, await resp.read(), {k.lower(): v for k, v in resp.headers.items()}


def assert_no_client_control(sent: dict[str, Any], leg: str) -> None:
    leaked = [name for name in GATEWAY_ONLY if name in sent]
    assert not leaked, f"the {leg} leg carried the client's {leaked}"
    kv = sent.get("kv_transfer_params")
    assert kv != HOSTILE["kv_transfer_params"], f"the {leg} leg carried the client's kv_transfer_params"
    if kv is not None:
        assert "203.0.113.9" not in jsonutil.dumps(kv).decode() and kv.get("prompt_token_ids") != [1, 2, 3]


async def disaggregated(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> tuple[FakeEngine, FakeEngine]:
    """One request pinned to a P/D pair by body fields, with the hostile fields: the two engines."""
    async with fake_engine(relay(await sim_engine())) as p, fake_engine(relay(await sim_engine())) as d:
        await cluster.add("p0", p.url, "prefill")
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(1, 1)
        pins = {"prefill_endpoint": "p0", "decode_endpoint": "d0"}
        status, raw, headers = await post(http, cluster, body(False, False, **pins))
    assert status == 200, raw
    assert (headers["x-disagg-mode"], headers["x-disagg-prefill"], headers["x-disagg-decode"]) == (
        "disaggregated",
        "p0",
        "d0",
    ), "the pins were read, then removed"
    assert len(p.requests) == len(d.requests) == 1
    return p, d


async def test_the_prefill_leg_carries_the_gateways_kv_transfer_params_and_none_of_the_clients(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    p, _ = await disaggregated(cluster, http, sim_engine)
    assert_no_client_control(p.requests[0], "prefill")
    assert p.requests[0]["kv_transfer_params"] == dict(PREFILL_LEG)


async def test_the_decode_leg_carries_the_prefill_engines_handle_and_none_of_the_clients(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    _, d = await disaggregated(cluster, http, sim_engine)
    assert_no_client_control(d.requests[0], "decode")
    kv = d.requests[0]["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] != "evil-engine", "P's handle"


@pytest.mark.parametrize(
    ("chat", "stream"),
    [
        pytest.param(False, False, id="completion-the-clients-bytes-rebuilt"),
        pytest.param(True, True, id="chat-stream-the-resumable-body"),
    ],
)
async def test_a_colocated_leg_carries_no_kv_transfer_params_at_all(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory, chat: bool, stream: bool
) -> None:
    async with fake_engine(relay(await sim_engine())) as d:
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(0, 1)
        status, raw, headers = await post(http, cluster, body(chat, stream, decode_endpoint="d0"), chat=chat)
    assert status == 200, raw
    assert headers["x-disagg-mode"] == "colocated"
    assert_no_client_control(d.requests[0], "colocated")
    assert "kv_transfer_params" not in d.requests[0]
    assert d.requests[0].get("return_token_ids") is (True if stream else None), "a resumable stream's body"


async def test_a_resumed_leg_carries_only_the_prompt_ids_the_gateway_kept(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    async with (
        fake_engine(relay(await sim_engine())) as p,
        fake_engine(cutting_proxy(await sim_engine(), 4, "api-server-died")) as cut,
        fake_engine(relay(await sim_engine())) as good,
    ):
        await cluster.add("p0", p.url, "prefill")
        await cluster.add("d-cut", cut.url, "decode")
        await cluster.add("d-good", good.url, "decode", busy=True)
        await cluster.ready(1, 2)
        status, raw, _ = await post(
            http, cluster, body(True, True, prefill_endpoint="p0"), chat=True, request_id="resumed"
        )
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
    assert attempts(await record(http, cluster, "resumed"))[-1] == ("resume", "d-good", "ok")
    for leg, engine in (("prefill", p), ("decode", cut), ("resumed", good)):
        assert_no_client_control(engine.requests[0], leg)
    kv = good.requests[0]["kv_transfer_params"]
    assert kv.keys() == {"prompt_token_ids"} and len(kv["prompt_token_ids"]) > 3, "the gateway's ids"


async def test_two_clients_with_one_request_id_get_two_records_and_two_engine_ids(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    async with fake_engine(relay(await sim_engine())) as d:
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(0, 1)
        answers = [await post(http, cluster, body(False, False), request_id="shared") for _ in range(2)]
    assert [status for status, _, _ in answers] == [200, 200]
    assert [h["x-request-id"] for _, _, h in answers] == ["shared", "shared"], "the client's id, echoed"
    own = [h[OWN] for _, _, h in answers]
    assert len(set(own)) == 2 and "shared" not in own
    assert [h["X-Request-Id"] for h in d.headers] == own, "each engine leg has the gateway's own id"
    assert [jsonutil.loads(raw)["id"] for _, raw, _ in answers] == [f"cmpl-{i}" for i in own]
    for i in own:
        rec = await record(http, cluster, i)
        assert (rec["request_id"], rec["client_request_id"]) == (i, "shared")
    assert (await record(http, cluster, "shared"))["request_id"] == own[1], "by client id: the newest"


@pytest.mark.parametrize(
    ("client_id", "status"),
    [
        pytest.param("x" * MAX_CLIENT_ID, 200, id="at-the-cap-kept"),
        pytest.param("x" * (MAX_CLIENT_ID + 1), 400, id="over-the-cap-refused"),
    ],
)
async def test_a_client_request_id_over_the_cap_is_refused_before_any_engine_sees_the_request(
    cluster: Cluster, http: aiohttp.ClientSession, sim_engine: EngineFactory, client_id: str, status: int
) -> None:
    async with fake_engine(relay(await sim_engine())) as d:
        await cluster.add("d0", d.url, "decode")
        await cluster.ready(0, 1)
        got, raw, headers = await post(http, cluster, body(False, False), request_id=client_id)
    assert got == status, raw
    if status == 400:
        assert b"X-Request-Id" in raw and not d.requests
        assert headers["x-request-id"] == headers[OWN], "an id it may use to find the record"
        async with http.get(f"{cluster.server.url}/admin/v1/requests/{headers[OWN]}", headers=ADMIN) as resp:
            assert (await resp.json())["status"] == 400
    else:
        assert headers["x-request-id"] == client_id and d.headers[0]["X-Request-Id"] == headers[OWN]
