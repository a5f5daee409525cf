"""The gateway and the scheduler together: exact prompt tokens, pinning, explanations, timelines."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import KV_FROM_PREFILL, wait_ready
from tests.integration.orchestrator_support import MODEL, fake_engine, request_record
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import GATEWAY_KEY, OrchestratorServer
from vllm_disagg.sim_engine.textgen import tokenize


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], Any]:
    async with http.post(url, data=jsonutil.dumps(body), headers=headers or {}) as resp:
        return resp.status, await resp.json(), resp.headers


async def _two_prefill_one_decode(
    orch: OrchestratorServer, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    for agent_id, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        engine = await sim_engine(engine_id=agent_id)
        await fake_agent(agent_id, engine.url, role)
    await wait_ready(orch, 2, 1)


@pytest.mark.parametrize("how", ["header", "body"])
async def test_a_client_pins_the_prefill_instance_by_header_or_body(
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    how: str,
) -> None:
    await _two_prefill_one_decode(orch, fake_agent, sim_engine)
    for n, pinned in enumerate(["p1", "p0", "p1", "p1"]):
        body: dict[str, Any] = {"model": MODEL, "prompt": f"pinned {n}", "max_tokens": 3}
        headers = {"X-Request-Id": f"pin-{how}-{n}"}
        if how == "header":
            headers["X-Disagg-Prefill"] = pinned
        else:
            body["prefill_endpoint"] = pinned
        status, answer, out = await _post(http, f"{orch.url}/v1/completions", body, headers)
        assert status == 200, answer
        assert (out["X-Disagg-Mode"], out["X-Disagg-Prefill"], out["X-Disagg-Decode"]) == (
            "disaggregated",
            pinned,
            "d0",
        )
        record = await request_record(http, orch, f"pin-{how}-{n}")
        assert record["explanation"]["pinned_prefill"] == pinned
        assert record["explanation"]["decider"]["plugin"] == "client"


async def test_the_pin_field_never_reaches_an_engine(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    async def prefill(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": KV_FROM_PREFILL})

    async def decode(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": " ok"}]})

    async with fake_engine(prefill) as p, fake_engine(decode) as d:
        await fake_agent("p0", p.url, "prefill")
        await fake_agent("d0", d.url, "decode")
        await wait_ready(orch, 1, 1)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "prefill_endpoint": p.url}
        status, answer, _ = await _post(http, f"{orch.url}/v1/completions", body)
        assert status == 200, answer
    assert "prefill_endpoint" not in p.requests[0]
    assert "prefill_endpoint" not in d.requests[0]


@pytest.mark.parametrize(
    ("headers", "extra", "reason"),
    [
        pytest.param({"X-Disagg-Prefill": "nope"}, {}, "'nope' is not registered", id="unknown-instance"),
        pytest.param(
            {}, {"prefill_endpoint": "d0"}, "role 'decode' and cannot prefill", id="a-decode-instance"
        ),
        pytest.param(
            {}, {"prefill_endpoint": 7}, "'prefill_endpoint' must be a non-empty string", id="not-a-string"
        ),
        pytest.param(
            {"X-Disagg-Prefill": "p0"}, {"prefill_endpoint": "p1"}, "disagree", id="header-and-body-disagree"
        ),
    ],
)
async def test_an_unusable_pin_is_a_400_with_the_reason_and_the_gateway_keeps_serving(
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    headers: dict[str, str],
    extra: dict[str, Any],
    reason: str,
) -> None:
    await _two_prefill_one_decode(orch, fake_agent, sim_engine)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **extra}
    status, answer, _ = await _post(http, f"{orch.url}/v1/completions", body, headers)
    assert status == 400
    assert reason in answer["error"]["message"]
    assert answer["error"]["param"] == "prefill_endpoint"
    status, _, _ = await _post(
        http, f"{orch.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    )
    assert status == 200


async def test_sim_prompts_are_tokenized_exactly_and_the_explanation_says_so(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await _two_prefill_one_decode(orch, fake_agent, sim_engine)
    prompt = "Exactly this many bytes. " * 3
    status, answer, _ = await _post(
        http,
        f"{orch.url}/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 2},
        {"X-Request-Id": "tok"},
    )
    assert status == 200, answer
    request = (await request_record(http, orch, "tok"))["explanation"]["request"]
    assert request["tokenized"] is True
    assert request["prompt_tokens"] == len(tokenize(prompt)) == answer["usage"]["prompt_tokens"]


async def test_a_streamed_answer_has_a_first_token_stage(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await _two_prefill_one_decode(orch, fake_agent, sim_engine)
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 6, "stream": True}
    async with http.post(
        f"{orch.url}/v1/completions", data=jsonutil.dumps(body), headers={"X-Request-Id": "s"}
    ) as resp:
        assert resp.status == 200
        await resp.read()
    record = await eventually(lambda: request_record(http, orch, "s"), what="record")
    t = record["timeline"]
    assert t["decode_start"] <= t["first_token"] <= t["last_token"] <= record["total_s"]
    assert record["stages"]["first_token_s"] == t["first_token"]


async def test_the_admin_api_shows_the_scheduler_tokenizers_and_index(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await _two_prefill_one_decode(orch, fake_agent, sim_engine)
    status, _, _ = await _post(
        http, f"{orch.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    )
    assert status == 200
    async with http.get(f"{orch.url}/admin/v1/scheduler", headers=ADMIN) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["scheduler"] == "plugins"
    assert body["config"] == "default.yaml"
    assert body["tokenizers"] == {MODEL: "bytes"}
    assert set(body["kv_index"]["instances"]) == {"p0", "p1", "d0"}


async def test_a_models_tokenizer_is_registered_when_its_first_instance_says_hello(
    orch: OrchestratorServer, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    engine = await sim_engine()
    await fake_agent("d0", engine.url, "decode")
    gateway = orch.app[GATEWAY_KEY]
    await eventually(lambda: gateway.tokenizers.status() == {MODEL: "bytes"}, what="tokenizer registered")
