"""A 2P2D cluster of simulated engines started through ``vllm-disagg up``: the spine end to end.

Everything is a real process on loopback: ``up``, the orchestrator, four agents, four engines.
"""

from __future__ import annotations

import os
import re
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.up_support import Cluster, engine_pids, start_up, stop
from tests.helpers import (
    ADMIN,
    eventually,
    eventually_sync,
    http_json,
    metric_sum,
    parse_prometheus,
    sse_text,
)
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.admin.auth import ENV_ADMIN_TOKEN, admin_headers
from vllm_disagg.sim_engine.textgen import expected_chat_text, expected_text

MODEL = "sim-model"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up.",
    "In a disaggregated deployment the prefill instance computes the prompt's KV cache once.",
    "Decode instances pull the KV blocks and generate tokens, one step at a time, for every request.",
    "A router that knows queue depth, KV usage and prefix caches can place requests much better.",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    labels = ("--label", "zone=z1", "--instance-label", "decode-1:domain=b")
    running = start_up(tmp_path_factory.mktemp("up2p2d"), 2, 2, *labels)
    yield running
    stop(running)


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes, Any]:
    async with session.post(url, data=jsonutil.dumps(body)) as resp:
        return resp.status, await resp.read(), resp.headers


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_2p2d_serves_every_request_with_the_exact_expected_text(
    cluster: Cluster, chat: bool, stream: bool
) -> None:
    route = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as session:
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "stream": stream}
            body.update({"messages": messages} if chat else {"prompt": prompt})
            status, raw, headers = await _post(session, cluster.base + route, body)
            assert status == 200, raw
            want = expected_chat_text(messages, 12) if chat else expected_text(prompt, 12)
            if stream:
                got = sse_text(raw, chat=chat)
            else:
                choice = jsonutil.loads(raw)["choices"][0]
                got = choice["message"]["content"] if chat else choice["text"]
            assert got == want
            assert headers["X-Disagg-Mode"] == "disaggregated"
            assert headers["X-Disagg-Prefill"].startswith("prefill-")
            assert headers["X-Disagg-Decode"].startswith("decode-")


def test_up_labels_every_instance_and_one_instance_on_its_own(cluster: Cluster) -> None:
    labels = {i["agent_id"]: i["labels"] for i in cluster.instances()}
    assert labels == {
        "prefill-0": {"zone": "z1"},
        "prefill-1": {"zone": "z1"},
        "decode-0": {"zone": "z1"},
        "decode-1": {"zone": "z1", "domain": "b"},
    }


async def test_engine_counters_show_prefill_legs_on_p_and_decode_legs_on_d(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as session:

        async def engine_samples() -> dict[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
            out = {}
            for item in cluster.instances():
                async with session.get(f"{item['url']}/metrics") as resp:
                    out[item["agent_id"]] = parse_prometheus(await resp.text())
            return out

        before = await engine_samples()
        n = 8
        for i in range(n):
            prompt = f"request {i}: " + PROMPTS[i % len(PROMPTS)]
            status, raw, _ = await _post(
                session, cluster.base + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5}
            )
            assert status == 200, raw
        after = await engine_samples()

    def grew(agent: str, name: str, **labels: str) -> float:
        return metric_sum(after[agent], name, **labels) - metric_sum(before[agent], name, **labels)

    prefills = [a for a in after if a.startswith("prefill-")]
    decodes = [a for a in after if a.startswith("decode-")]
    # Every request ran once on some P with max_tokens=1, and once on some D with its real max_tokens.
    p_legs = sum(grew(a, "vllm:request_params_max_tokens_count") for a in prefills)
    p_legs_of_one = sum(grew(a, "vllm:request_params_max_tokens_bucket", le="1.0") for a in prefills)
    d_legs = sum(grew(a, "vllm:request_params_max_tokens_count") for a in decodes)
    d_legs_of_one = sum(grew(a, "vllm:request_params_max_tokens_bucket", le="1.0") for a in decodes)
    assert p_legs == n and p_legs_of_one == n
    assert d_legs == n and d_legs_of_one == 0
    # The decode side received the prompts' KV instead of computing it.
    external = sum(
        grew(a, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") for a in decodes
    )
    assert external > 0
    assert sum(grew(a, "vllm:generation_tokens_total") for a in decodes) == n * 5


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b"{not json", 400, "json"),
        (jsonutil.dumps({"model": "no-such-model", "prompt": "hi"}), 404, "no-such-model"),
        (jsonutil.dumps({"model": MODEL}), 400, "prompt"),
    ],
    ids=["malformed-json-is-400", "unknown-model-is-404", "missing-prompt-is-400"],
)
async def test_bad_requests_get_a_clear_error_and_the_gateway_keeps_serving(
    cluster: Cluster, body: bytes, status: int, reason: str
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(cluster.base + "/v1/completions", data=body) as resp:
            assert resp.status == status
            error = jsonutil.loads(await resp.read())["error"]
            assert reason in error["message"].lower()
        still = {"model": MODEL, "prompt": "still here", "max_tokens": 3}
        ok, raw, _ = await _post(session, cluster.base + "/v1/completions", still)
        assert ok == 200 and jsonutil.loads(raw)["choices"][0]["text"] == expected_text("still here", 3)


async def test_missing_messages_on_chat_is_400(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as session:
        status, raw, _ = await _post(session, cluster.base + "/v1/chat/completions", {"model": MODEL})
    assert status == 400
    assert "messages" in jsonutil.loads(raw)["error"]["message"]


async def test_a_sigkilled_agent_leaves_routing_and_requests_keep_succeeding(tmp_path: Path) -> None:
    # --max-crashes 1: up gives up at the first crash instead of restarting the agent
    # (tests/e2e/test_up_supervision.py has the restarts).
    running = start_up(tmp_path, 1, 2, "--max-crashes", "1")
    try:
        victim = next(i for i in running.instances() if i["agent_id"] == "decode-0")
        agent_pid = next(pid for pid in engine_pids([int(victim["url"].rsplit(":", 1)[1])]) if _is_agent(pid))
        os.kill(agent_pid, signal.SIGKILL)

        def victim_dead() -> bool:
            return any(i["agent_id"] == "decode-0" and i["state"] == "dead" for i in running.instances())

        # Heartbeat timeout is 1 s; allow a wide margin for a loaded 2-core machine.
        await eventually(victim_dead, timeout=15, what="decode-0 marked dead")
        gave_up = (
            "up: agent decode-0 crashed once in 60 s (last: code -9); giving up: its instance leaves routing"
        )
        await eventually(lambda: gave_up in running.log.read_text().splitlines(), timeout=15, what=gave_up)
        async with aiohttp.ClientSession() as session:
            for i in range(10):
                prompt = f"after the kill {i}"
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                status, raw, headers = await _post(session, running.base + "/v1/completions", body)
                assert status == 200, raw
                assert headers["X-Disagg-Decode"] == "decode-1"
                assert jsonutil.loads(raw)["choices"][0]["text"] == expected_text(prompt, 4)
    finally:
        assert stop(running) == 0
    # Nothing outlives ``up``: no agent, no engine.
    await eventually(lambda: not engine_pids(running.engine_ports), timeout=15, what="no orphan processes")


async def test_a_decode_instance_turned_prefill_by_the_operator_serves_prefill_legs(tmp_path: Path) -> None:
    running = start_up(tmp_path, prefill=1, decode=2)
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{running.base}/admin/v1/instances/decode-1/role"
            async with session.post(url, json={"role": "prefill"}, headers=ADMIN) as resp:
                assert resp.status == 200, await resp.text()
            # Only decode-1 may prefill now: the operator cordons the original prefill instance.
            async with session.post(
                f"{running.base}/admin/v1/instances/prefill-0/cordon", headers=ADMIN
            ) as resp:
                assert resp.status == 200, await resp.text()
            for i in range(4):
                prompt = f"prefilled by a former decode instance {i}"
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                status, raw, headers = await _post(session, running.base + "/v1/completions", body)
                assert status == 200, raw
                pair = (headers["X-Disagg-Mode"], headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"])
                assert pair == ("disaggregated", "decode-1", "decode-0"), pair
                assert jsonutil.loads(raw)["choices"][0]["text"] == expected_text(prompt, 4)
        changed = next(i for i in running.instances() if i["agent_id"] == "decode-1")
        assert (changed["role"], changed["session"], changed["state"]) == ("prefill", 1, "ready"), changed
    finally:
        assert stop(running) == 0


def _is_agent(pid: int) -> bool:
    return "\x00agent\x00" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")


def test_the_admin_token_reaches_the_orchestrator_only_never_an_agent_or_engine(cluster: Cluster) -> None:
    # This test process holds the token in its environment (tests/conftest.py), as an operator's shell
    # may: ``up`` passes it on to the orchestrator alone.
    pids = engine_pids(cluster.engine_ports)
    assert len(pids) >= 2 * len(cluster.engine_ports)  # an agent and an engine per instance
    for pid in pids:
        names = [e.split(b"=", 1)[0] for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
        assert ENV_ADMIN_TOKEN.encode() not in names, f"pid {pid} has the admin token in its environment"


def test_up_stops_everything_on_sigterm(cluster: Cluster) -> None:
    ports = cluster.engine_ports
    assert len(engine_pids(ports)) >= 2 * len(ports)  # an agent and an engine per instance
    assert stop(cluster) == 0
    eventually_sync(lambda: not engine_pids(ports), timeout=15, what="no orphan processes")
    said = cluster.log.read_text()
    assert "stopped" in said
    assert "restarting" not in said and "giving up" not in said, "a stop is not a crash"


def test_without_a_token_up_makes_one_only_its_owner_can_read_and_says_where(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV_ADMIN_TOKEN}
    env["VLLM_DISAGG_HOME"] = str(tmp_path / "home")
    running = start_up(tmp_path, 1, 1, env=env)
    try:
        said = re.search(r"admin token: (\S+)", running.log.read_text())
        assert said is not None, running.log.read_text()
        path = Path(said.group(1))
        assert path.is_relative_to(tmp_path / "home") and stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        status, body = http_json(f"{running.base}/admin/v1/instances", headers=admin_headers(token))
        assert status == 200 and len(body["instances"]) == 2
        status, _ = http_json(f"{running.base}/admin/v1/instances", headers=ADMIN)
        assert status == 401, "the tests' token is not this cluster's"
    finally:
        stop(running)
