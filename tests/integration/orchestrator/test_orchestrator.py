"""The orchestrator on real sockets: registration, health, expiry, protocol refusals, admin API, CLI."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from tests.helpers import ADMIN, ADMIN_TOKEN, eventually, free_port
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator_support import (
    MODEL,
    FakeAgent,
    orch_config,
    registered,
    sample,
    scrape,
    spawn_orchestrator,
)
from vllm_disagg import jsonutil
from vllm_disagg.cli.commands import main as cli_main
from vllm_disagg.orchestrator.admin.auth import ENV_ADMIN_TOKEN
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import PROTOCOL_MINOR, PROTOCOL_VERSION, Goodbye, Heartbeat, Welcome
from vllm_disagg.sim_engine.textgen import expected_text


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """GET with the admin token."""
    async with http.get(url, headers=ADMIN) as resp:
        return resp.status, jsonutil.loads(await resp.read())


async def post_json(
    http: aiohttp.ClientSession, url: str, body: Any = None
) -> tuple[int, Any, dict[str, str]]:
    """POST with the admin token."""
    data = jsonutil.dumps(body) if body is not None else b""
    async with http.post(url, data=data, headers=ADMIN) as resp:
        return resp.status, jsonutil.loads(await resp.read()), dict(resp.headers)


async def instance(http: aiohttp.ClientSession, orch: OrchestratorServer, agent_id: str) -> dict[str, Any]:
    _, body = await get_json(http, f"{orch.url}/admin/v1/instances")
    return next(i for i in body["instances"] if i["agent_id"] == agent_id)


async def complete(
    http: aiohttp.ClientSession, orch: OrchestratorServer, prompt: str = "hi"
) -> tuple[int, Any, dict[str, str]]:
    return await post_json(
        http, f"{orch.url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    )


async def test_health_turns_ok_when_a_decode_instance_registers_and_ready(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    status, body = await get_json(http, f"{orch.url}/health")
    assert status == 503
    assert "no ready decode-capable instance" in body["reason"]

    engine = await sim_engine()
    agent = await fake_agent("d0", engine.url, "decode", join=False)
    agent.engine_state = "starting"
    await agent.join()
    await eventually(lambda: orch.registry.get("d0") is not None, what="d0 registered")
    assert (await get_json(http, f"{orch.url}/health"))[0] == 503, "a starting engine is not ready"
    assert (await instance(http, orch, "d0"))["state"] == "joining"

    agent.engine_state = "ready"

    async def healthy() -> bool | None:
        return (await get_json(http, f"{orch.url}/health"))[0] == 200

    await eventually(healthy, timeout=10, what="/health 200")
    _, body = await get_json(http, f"{orch.url}/health")
    assert body["status"] == "ok"
    assert body["ready"] == {"decode": 1, "prefill": 0}
    item = await instance(http, orch, "d0")
    assert (item["state"], item["role"], item["url"], item["model"]) == ("ready", "decode", engine.url, MODEL)
    assert item["seconds_since_heartbeat"] < 10
    _, models = await get_json(http, f"{orch.url}/v1/models")
    assert [m["id"] for m in models["data"]] == [MODEL]


async def test_liveness_answers_at_once_and_readiness_waits_for_a_decode_instance(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    assert await get_json(http, f"{orch.url}/health/live") == (200, {"status": "ok"})
    status, body = await get_json(http, f"{orch.url}/health/ready")
    assert (status, body["reason"]) == (503, "no ready decode-capable instance")
    assert "leader" not in body, "a single orchestrator has no leader to speak of"
    await fake_agent("p0", (await sim_engine()).url, "prefill")
    await eventually(lambda: orch.registry.snapshot().ready_prefill, what="p0 ready")
    assert (await get_json(http, f"{orch.url}/health/ready"))[0] == 503, "a prefill instance cannot route"
    await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    assert await get_json(http, f"{orch.url}/health/ready") == (200, {"status": "ok", "ready_decode": 1})


async def test_a_prefill_only_cluster_is_not_healthy(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await fake_agent("p0", (await sim_engine()).url, "prefill")
    await eventually(lambda: orch.registry.snapshot().ready_prefill, what="p0 ready")
    status, body = await get_json(http, f"{orch.url}/health")
    assert status == 503
    assert body["ready"] == {"decode": 0, "prefill": 1}


async def test_silent_instance_dies_within_the_timeout_and_requests_go_to_another(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    d0 = await fake_agent("d0", (await sim_engine()).url, "decode")
    await fake_agent("d1", (await sim_engine()).url, "decode")
    await eventually(lambda: len(orch.registry.snapshot().ready_decode.get(MODEL, ())) == 2, what="2 ready")

    d0.stop_heartbeats()
    loop = asyncio.get_running_loop()
    silent_since = loop.time()
    await eventually(lambda: registered(orch, "d0").state == "dead", timeout=15, what="d0 dead")
    # Dead no sooner than the timeout (the last heartbeat may precede stop_heartbeats by one interval).
    assert loop.time() - silent_since >= 1.5 - 0.1 - 0.05
    item = await instance(http, orch, "d0")
    assert item["state"] == "dead"
    assert "no heartbeat" in item["dead_reason"]

    for n in range(6):
        status, body, headers = await complete(http, orch, prompt=f"prompt {n}")
        assert status == 200, body
        assert headers["X-Disagg-Decode"] == "d1"
        assert body["choices"][0]["text"] == expected_text(f"prompt {n}", 3)


async def test_goodbye_marks_the_instance_dead_at_once(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    d0 = await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    d0.stop_heartbeats()
    d0.transport.send(Goodbye(reason="bye"))
    await eventually(lambda: registered(orch, "d0").state == "dead", timeout=1.0, what="dead")
    assert "goodbye" in (await instance(http, orch, "d0"))["dead_reason"]


async def test_a_dead_instance_comes_back_with_a_new_hello(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    d0 = await fake_agent("d0", (await sim_engine()).url, "decode")
    d0.stop_heartbeats()
    await eventually(lambda: registered(orch, "d0").state == "dead", timeout=15, what="d0 dead")

    # The agent keeps heartbeating as if nothing happened: it is told to say Hello again.
    d0.heartbeat_now()
    refusal = await d0.next_refusal()
    assert refusal.code == "unknown_agent"
    assert "Hello" in refusal.reason

    await d0.join()
    await eventually(lambda: registered(orch, "d0").state == "ready", what="d0 back")
    item = await instance(http, orch, "d0")
    assert item["session"] == 2
    assert (await complete(http, orch))[0] == 200


async def test_garbage_frame_is_refused_and_everything_keeps_serving(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    good = await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    rogue = await fake_agent("rogue", "http://127.0.0.1:9", "decode", join=False)
    await rogue.hello()  # connected and known; now misbehave

    cases = [
        (b"\xc1\xc1 not msgpack", "malformed_frame"),
        (msgpack.packb(["no-such-type", {}]), "unknown_message_type"),
        (msgpack.packb(["heartbeat", {"seq": "one", "engine_state": "ready"}]), "field_type_error"),
    ]
    for frame, code in cases:
        assert rogue.transport.send_raw(frame)
        refusal = await rogue.next_refusal()
        assert refusal.code == code
        assert refusal.reason

    samples = await scrape(http, orch.url)
    for _, code in cases:
        assert sample(samples, "vllm_disagg_protocol_refused_total", code=code) == 1
    # HTTP and the other agent's session are unaffected.
    status, body, headers = await complete(http, orch)
    assert status == 200, body
    assert headers["X-Disagg-Decode"] == "d0"
    assert orch.registry.get("d0").state == "ready"  # type: ignore[union-attr]
    assert good.refusals == []


async def test_hello_with_another_protocol_version_is_refused_with_both_versions(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    old = await fake_agent("old", "http://x", "decode", join=False, protocol_version=PROTOCOL_VERSION + 1)
    refusal = await old.hello()
    assert refusal.TAG == "refuse"
    assert refusal.code == "version_mismatch"  # type: ignore[union-attr]
    assert refusal.reason == (  # type: ignore[union-attr]
        f"agent speaks protocol v{PROTOCOL_VERSION + 1}.0, "
        f"orchestrator v{PROTOCOL_VERSION}.{PROTOCOL_MINOR}: the major versions must match"
    )
    assert orch.registry.get("old") is None
    assert (
        sample(await scrape(http, orch.url), "vllm_disagg_protocol_refused_total", code="version_mismatch")
        == 1
    )


@pytest.mark.parametrize("minor", [0, PROTOCOL_MINOR, PROTOCOL_MINOR + 5], ids=["1.0", "same", "newer"])
async def test_an_agent_of_another_minor_version_registers_and_its_unknown_fields_are_ignored(
    orch: OrchestratorServer, http: aiohttp.ClientSession, minor: int
) -> None:
    """Agents and the orchestrator upgrade one at a time: within a major version any minor registers.
    A newer agent's extra fields (in Hello, its instance, a heartbeat's metrics) are ignored; an agent of
    1.0 gets a Welcome without the minor field, which it would refuse."""
    agent = FakeAgent(orch.zmq_endpoint, "skewed", "http://127.0.0.1:9", "decode")
    extra = {"gpu_kind": "H200"} if minor > PROTOCOL_MINOR else {}
    info = {**dataclasses.asdict(agent.info), **extra}
    hello = {"protocol_version": PROTOCOL_VERSION, "agent_id": "skewed", "instance": info, **extra}
    if minor:
        hello["protocol_minor"] = minor
    try:
        welcome_frames = []

        async def said_welcome() -> bool:
            agent.transport.send_raw(msgpack.packb(["hello", hello]))
            with contextlib.suppress(TimeoutError):
                welcome_frames.append(await asyncio.wait_for(agent.inbox.get(), 0.2))
            return bool(welcome_frames)

        await eventually(said_welcome, what="a Welcome")
        welcome = welcome_frames[0]
        assert isinstance(welcome, Welcome)
        assert welcome.protocol_minor == (PROTOCOL_MINOR if minor else 0)
        beat = {"seq": 1, "engine_state": "ready", "draining": False, "metrics": {"num_running": 2, **extra}}
        agent.transport.send_raw(msgpack.packb(["heartbeat", {**beat, **extra}]))
        await eventually(
            lambda: (v := orch.registry.get("skewed")) is not None and v.state == "ready", what="ready"
        )
        async with http.get(f"{orch.url}/admin/v1/instances", headers=ADMIN) as resp:
            listed = await resp.json()
        (skewed,) = [i for i in listed["instances"] if i["agent_id"] == "skewed"]
        assert skewed["protocol"] == f"{PROTOCOL_VERSION}.{minor}"
        assert orch.registry.get("skewed").metrics.num_running == 2  # type: ignore[union-attr]
        assert agent.refusals == []
    finally:
        await agent.close()


async def test_heartbeat_before_hello_is_refused_as_unknown_agent(orch: OrchestratorServer) -> None:
    stranger = FakeAgent(orch.zmq_endpoint, "stranger", "http://x", "decode")
    try:
        async with asyncio.timeout(20):
            while not stranger.refusals:  # the DEALER drops sends until connected: repeat
                stranger.transport.send(Heartbeat(seq=1, engine_state="ready"))
                await asyncio.sleep(0.05)
        assert stranger.refusals[0].code == "unknown_agent"
        assert orch.registry.get("stranger") is None
    finally:
        await stranger.close()


async def test_admin_drain_stops_routing_at_once_and_undrain_resumes(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    d0 = await fake_agent("d0", (await sim_engine()).url, "decode")
    await fake_agent("d1", (await sim_engine()).url, "decode")
    await eventually(lambda: len(orch.registry.snapshot().ready_decode.get(MODEL, ())) == 2, what="2 ready")

    status, body, _ = await post_json(http, f"{orch.url}/admin/v1/instances/d0/drain")
    assert status == 200, body
    assert body["ack"]["ok"] is True
    assert body["instance"]["state"] == "draining"
    assert [c.kind for c in d0.commands] == ["drain"]
    assert body["ack"]["id"] == d0.commands[0].id

    for n in range(8):
        status, _, headers = await complete(http, orch, prompt=f"p{n}")
        assert status == 200
        assert headers["X-Disagg-Decode"] == "d1", "a drained instance gets no new request"

    status, body, _ = await post_json(http, f"{orch.url}/admin/v1/instances/d0/undrain")
    assert status == 200, body
    await eventually(lambda: registered(orch, "d0").state == "ready", what="d0 undrained")
    seen = {(await complete(http, orch, prompt=f"q{n}"))[2]["X-Disagg-Decode"] for n in range(20)}
    assert seen == {"d0", "d1"}


async def test_an_admin_drain_outlives_the_agents_session_and_a_new_agent_is_told_again(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    url = (await sim_engine()).url
    first = await fake_agent("d0", url, "decode")
    await fake_agent("d1", (await sim_engine()).url, "decode")
    await eventually(lambda: len(orch.registry.snapshot().ready_decode.get(MODEL, ())) == 2, what="2 ready")
    status, body, _ = await post_json(http, f"{orch.url}/admin/v1/instances/d0/drain")
    assert status == 200 and body["instance"]["state"] == "draining", body
    await first.close()  # the agent process dies; another one starts for the same engine
    second = await fake_agent("d0", url, "decode")

    def back() -> InstanceView | None:
        view = registered(orch, "d0")
        return view if view.session == 2 and view.state != "joining" else None

    view = await eventually(back, what="d0 back")
    assert view.state == "draining", "the operator's drain is not forgotten"
    await eventually(lambda: [c.kind for c in second.commands] == ["drain"], what="the new agent told")
    for n in range(6):
        assert (await complete(http, orch, prompt=f"p{n}"))[2]["X-Disagg-Decode"] == "d1"


@pytest.mark.parametrize(
    ("path", "status", "fragment"),
    [
        pytest.param("/admin/v1/instances/nobody/drain", 404, "no instance", id="drain-unknown-id-is-404"),
        pytest.param(
            "/admin/v1/instances/nobody/shutdown", 404, "no instance", id="shutdown-unknown-id-is-404"
        ),
    ],
)
async def test_admin_commands_to_unknown_instances(
    orch: OrchestratorServer, http: aiohttp.ClientSession, path: str, status: int, fragment: str
) -> None:
    got, body, _ = await post_json(http, orch.url + path)
    assert got == status
    assert fragment in body["error"]["message"]


async def test_admin_command_without_ack_is_a_504_within_the_command_timeout(
    http: aiohttp.ClientSession, sim_engine: EngineFactory
) -> None:
    server = await start_orchestrator(orch_config(command_timeout_s=0.5), shutdown_timeout_s=1.0)
    mute = FakeAgent(server.zmq_endpoint, "mute", (await sim_engine()).url, "decode", auto_ack=False)
    try:
        await mute.join()
        await eventually(lambda: server.registry.snapshot().ready_decode, what="mute ready")
        status, body, _ = await post_json(http, f"{server.url}/admin/v1/instances/mute/shutdown")
        assert status == 504
        assert "did not acknowledge" in body["error"]["message"]
        assert [c.kind for c in mute.commands] == ["shutdown"]
    finally:
        await mute.close()
        await server.close()


async def test_admin_shutdown_returns_the_agents_ack(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    d0 = await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    status, body, _ = await post_json(http, f"{orch.url}/admin/v1/instances/d0/shutdown")
    assert status == 200
    assert body["command"] == "shutdown"
    assert body["ack"] == {"id": d0.commands[0].id, "ok": True, "error": ""}


async def test_commands_to_a_dead_instance_fail_fast(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    gone = await fake_agent("gone", "http://127.0.0.1:9", "decode")
    await gone.close(goodbye=True)
    await eventually(lambda: registered(orch, "gone").state == "dead", what="gone dead")
    status, body, _ = await post_json(http, f"{orch.url}/admin/v1/instances/gone/drain")
    assert status == 502
    assert "no live session" in body["error"]["message"]


async def test_metrics_expose_instances_and_requests(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    await fake_agent("p0", (await sim_engine()).url, "prefill")
    await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_prefill, what="p0 ready")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    for _ in range(3):
        assert (await complete(http, orch))[0] == 200
    stream = {"model": MODEL, "prompt": "a stream", "max_tokens": 5, "stream": True}
    async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(stream)) as resp:
        assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
    samples = await scrape(http, orch.url)
    assert sample(samples, "vllm_disagg_instance_up", instance="p0", role="prefill", state="ready") == 1
    assert sample(samples, "vllm_disagg_instance_up", instance="d0", role="decode", state="ready") == 1
    assert sample(samples, "vllm_disagg_instance_in_flight", instance="d0") == 0
    assert (
        sample(samples, "vllm_disagg_requests_total", route="completions", mode="disaggregated", status="200")
        == 4
    )
    assert sample(samples, "vllm_disagg_request_duration_seconds_count", route="completions") == 4
    for each in ("prefill_leg", "time_to_first_byte", "gateway_overhead", "schedule", "queue"):
        assert sample(samples, f"vllm_disagg_{each}_seconds_count") == 4, each
    assert sample(samples, "vllm_disagg_kv_handoff_seconds_count") == 4, "each request was disaggregated"
    assert sample(samples, "vllm_disagg_time_per_output_token_seconds_count") == 1, "the one stream"
    assert sample(samples, "vllm_disagg_time_per_output_token_seconds_sum") > 0
    assert sample(samples, "vllm_disagg_event_loop_lag_seconds_count") > 0, "sampled since the start"


async def test_status_and_drain_commands_talk_to_the_admin_api(
    orch: OrchestratorServer,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")

    assert await asyncio.to_thread(cli_main, ["status", "--url", orch.url]) == 0
    out = capsys.readouterr().out
    header, row = out.splitlines()[:2]
    assert header.split()[:3] == ["AGENT", "STATE", "ROLE"]
    assert row.split()[:4] == ["d0", "ready", "decode", MODEL]

    assert await asyncio.to_thread(cli_main, ["drain", "d0", "--url", orch.url]) == 0
    assert "drain d0: acknowledged (state: draining)" in capsys.readouterr().out
    assert orch.registry.get("d0").state == "draining"  # type: ignore[union-attr]

    assert await asyncio.to_thread(cli_main, ["drain", "nobody", "--url", orch.url]) == 1
    assert "HTTP 404" in capsys.readouterr().err


async def test_status_json_requests_and_debug_show_the_cluster_where_each_request_went_and_why(
    orch: OrchestratorServer,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    assert await asyncio.to_thread(cli_main, ["status", "--json", "--url", orch.url]) == 0
    listed = jsonutil.loads(capsys.readouterr().out)
    assert [(i["agent_id"], i["state"]) for i in listed["instances"]] == [("d0", "ready")]

    body = jsonutil.dumps({"model": MODEL, "prompt": "where did I go?", "max_tokens": 2})
    async with http.post(f"{orch.url}/v1/completions", data=body, headers={"X-Request-Id": "cli-1"}) as r:
        assert r.status == 200
        own = r.headers["X-Disagg-Request-Id"]  # the gateway's id of it: records are kept under it
    assert await asyncio.to_thread(cli_main, ["requests", "--url", orch.url]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[:5] == ["REQUEST", "STATUS", "MODE", "PREFILL", "DECODE"]
    assert row.split()[:5] == [own, "200", "colocated", "-", "d0"]
    assert await asyncio.to_thread(cli_main, ["requests", "cli-1", "--url", orch.url]) == 0
    record = jsonutil.loads(capsys.readouterr().out)
    assert (record["request_id"], record["client_request_id"], record["decode"]) == (own, "cli-1", "d0")
    assert record["explanation"]
    assert await asyncio.to_thread(cli_main, ["requests", "never-seen", "--url", orch.url]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert await asyncio.to_thread(cli_main, ["debug", "--url", orch.url]) == 0
    state = jsonutil.loads(capsys.readouterr().out)
    assert state["scheduler"]["models"][MODEL]["decode"]["eligible"] == ["d0"]


async def test_events_prints_the_event_log_one_line_each(
    orch: OrchestratorServer,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    assert await asyncio.to_thread(cli_main, ["events", "--url", orch.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[2:4] == ["joined", "d0"] and "role=decode" in lines[0]
    assert any(line.split()[2:4] == ["state", "d0"] and "change=joining -> ready" in line for line in lines)
    assert await asyncio.to_thread(cli_main, ["events", "--json", "--since", "1", "--url", orch.url]) == 0
    seqs = [jsonutil.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()]
    assert seqs and min(seqs) == 2


async def test_status_and_drain_need_the_admin_token_and_say_so_in_one_line(
    orch: OrchestratorServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.delenv(ENV_ADMIN_TOKEN)
    assert await asyncio.to_thread(cli_main, ["status", "--url", orch.url]) == 1
    assert capsys.readouterr().err.strip().endswith("HTTP 401: missing 'Authorization: Bearer <admin token>'")
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-admin-token-at-all\n")
    argv = ["drain", "d0", "--url", orch.url, "--admin-token-file", str(wrong)]
    assert await asyncio.to_thread(cli_main, argv) == 1
    assert capsys.readouterr().err == "error: HTTP 401: wrong admin token\n"
    right = tmp_path / "token"
    right.write_text(ADMIN_TOKEN + "\n")
    assert (
        await asyncio.to_thread(cli_main, ["status", "--url", orch.url, "--admin-token-file", str(right)])
        == 0
    )
    assert "no instances registered" in capsys.readouterr().out


async def test_status_command_reports_an_unreachable_orchestrator(capsys: pytest.CaptureFixture[str]) -> None:
    assert await asyncio.to_thread(cli_main, ["status", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "cannot reach the orchestrator" in capsys.readouterr().err


async def test_orchestrator_subcommand_serves_and_stops_cleanly_on_sigterm(
    http: aiohttp.ClientSession,
) -> None:
    port, zmq_port = free_port(), free_port()
    proc, first = await spawn_orchestrator(
        "--port", str(port), "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}",
        "--heartbeat-interval-s", "0.1", "--heartbeat-timeout-s", "1",
    )  # fmt: skip
    try:
        assert f"http http://127.0.0.1:{port}  agents tcp://127.0.0.1:{zmq_port}" in first, first
        async with http.get(f"http://127.0.0.1:{port}/health") as resp:
            assert resp.status == 503  # serving, no instance yet
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_orchestrator_subcommand_refuses_bad_config() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from vllm_disagg.cli.commands import main; raise SystemExit(main())",
        "orchestrator",
        "--heartbeat-interval-s",
        "2",
        "--heartbeat-timeout-s",
        "1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "heartbeat_timeout_s must exceed heartbeat_interval_s" in err.decode()


async def test_remove_forgets_a_dead_instance_but_never_a_live_one(
    orch: OrchestratorServer, fake_agent: AgentFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = await fake_agent("d0", "http://127.0.0.1:9", "decode")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    assert await asyncio.to_thread(cli_main, ["remove", "d0", "--url", orch.url]) == 1
    assert "HTTP 409" in capsys.readouterr().err and orch.registry.get("d0") is not None
    agent.stop_heartbeats()
    await eventually(lambda: (v := orch.registry.get("d0")) is not None and v.state == "dead", what="d0 dead")
    assert await asyncio.to_thread(cli_main, ["remove", "d0", "--url", orch.url]) == 0
    assert capsys.readouterr().out == "removed d0\n"
    assert orch.registry.get("d0") is None
    assert await asyncio.to_thread(cli_main, ["remove", "d0", "--url", orch.url]) == 1
    assert "HTTP 404" in capsys.readouterr().err
