"""The orchestrator's KV index survives losing its agents' sessions: an orchestrator restart, or an
agent expired while it was stopped and registering again.

A real orchestrator in-process on fixed ports; two real agents as processes (``vllm-disagg agent
--engine sim``), each launching a simulated engine that publishes KV events. The prefill engine's cache
is small, so it evicts the first blocks of older prompts while their later blocks stay cached: the
index then holds chains whose first blocks are gone, which a rebuild must reproduce too. After the
sessions are lost and the agents registered again, the index holds exactly the entries it held
before (the agents resynced it from their mirrors), the engines are the same processes, and a
repeated prompt is scored as a hit on the instance that caches it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, cli_argv, eventually, free_port
from tests.integration.orchestrator_support import MODEL, orch_config
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.sim_engine.textgen import tokenize

pytestmark = pytest.mark.slow

BLOCK = 16
CACHE_BLOCKS = 20  # the prefill engine's capacity: each prompt below has 12 full blocks
PROMPTS = [f"Conversation {i}: " + "tell me about the weather on the coast. " * 5 for i in range(3)]
RECOVERY_S = 5.0  # the promise: new requests succeed within this long of the recovery
DEADLINE_S = 60.0  # starting Python processes on a loaded 2-core machine


class Agent:
    """``vllm-disagg agent --engine sim`` as a child process, its output in a file."""

    def __init__(self, log_path: Path, orchestrator: str, agent_id: str, role: str, *extra: str) -> None:
        self.agent_id = agent_id
        self.log_path = log_path
        argv = cli_argv(
            "agent", "--engine", "sim", "--agent-id", agent_id, "--role", role,
            "--orchestrator", orchestrator, "--model", MODEL,
            "--engine-port", str(free_port()), "--kv-events-port", str(free_port()),
            "--scrape-interval-s", "0.05", "--stop-grace-s", "5", *extra,
        )  # fmt: skip
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pids(self) -> set[int]:
        """The agent's children: its engine."""
        pids: set[int] = set()
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in children.read_text().split())
        return pids

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process would not die until continued
            self.proc.kill()
        self.proc.wait()


class Orchestrators:
    """Orchestrators started one after another on the same HTTP port and ZeroMQ endpoint."""

    def __init__(self) -> None:
        self.config = orch_config(port=free_port(), zmq_endpoint=f"tcp://127.0.0.1:{free_port()}")
        self.running: list[OrchestratorServer] = []

    async def start(self) -> OrchestratorServer:
        self.running.append(await start_orchestrator(self.config, shutdown_timeout_s=2.0))
        return self.running[-1]

    async def stop(self, server: OrchestratorServer) -> None:
        self.running.remove(server)
        await server.close()


@pytest.fixture
async def orchestrators() -> AsyncIterator[Orchestrators]:
    started = Orchestrators()
    try:
        yield started
    finally:
        for server in list(started.running):
            await started.stop(server)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    started: list[Agent] = []

    def start(orchestrator: str, agent_id: str, role: str, *extra: str) -> Agent:
        started.append(Agent(tmp_path / f"{agent_id}.log", orchestrator, agent_id, role, *extra))
        return started[-1]

    yield start
    for agent in started:  # the kernel (die_with_parent) takes each engine down with its agent
        agent.kill()


async def complete(base: str, prompt: str, request_id: str) -> tuple[int, str]:
    """One completion through the gateway on a fresh connection: (status, prefill instance)."""
    body = jsonutil.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2})
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
        http.post(f"{base}/v1/completions", data=body, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status, resp.headers.get("X-Disagg-Prefill", "")


async def explanation(base: str, request_id: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{base}/admin/v1/requests/{request_id}", headers=ADMIN) as resp,
    ):
        assert resp.status == 200
        record: dict[str, Any] = await resp.json()
        return record


def full_tokens(prompt: str) -> int:
    return len(tokenize(prompt)) // BLOCK * BLOCK


async def lose_sessions_by_restarting(
    orch: OrchestratorServer, orchestrators: Orchestrators, _: Agent
) -> OrchestratorServer:
    await orchestrators.stop(orch)
    return await orchestrators.start()


async def lose_sessions_by_expiry(
    orch: OrchestratorServer, _: Orchestrators, prefill: Agent
) -> OrchestratorServer:
    os.kill(prefill.proc.pid, signal.SIGSTOP)  # the agent, not its engine: the engine keeps its cache
    try:
        await eventually(lambda: not orch.registry.is_live("prefill-0"), timeout=DEADLINE_S, what="expired")
        assert orch.kv_index.blocks_of("prefill-0") == 0  # dropped with the session
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    return orch


@pytest.mark.parametrize(
    "lose_sessions",
    [
        pytest.param(lose_sessions_by_restarting, id="the orchestrator restarted on the same endpoint"),
        pytest.param(lose_sessions_by_expiry, id="the prefill agent expired while stopped, then said Hello"),
    ],
)
async def test_after_the_agents_register_again_the_index_is_rebuilt_from_their_engines_blocks(
    orchestrators: Orchestrators,
    agents: Callable[..., Agent],
    lose_sessions: Callable[[OrchestratorServer, Orchestrators, Agent], Awaitable[OrchestratorServer]],
) -> None:
    orch = await orchestrators.start()
    prefill = agents(orch.zmq_endpoint, "prefill-0", "prefill", "--num-blocks", str(CACHE_BLOCKS))
    decode = agents(orch.zmq_endpoint, "decode-0", "decode")

    def ready(server: OrchestratorServer) -> bool:
        views = [server.registry.get(a.agent_id) for a in (prefill, decode)]
        return all(v is not None and v.state == "ready" for v in views)

    await eventually(lambda: ready(orch), timeout=DEADLINE_S, what="both instances ready")
    engines = {a.agent_id: a.engine_pids() for a in (prefill, decode)}
    assert all(len(pids) == 1 for pids in engines.values()), engines

    # The agent's subscription to its engine misses what the engine publishes while it joins: send
    # one-block probes straight to the engine until one of them is indexed.
    probes: list[str] = []
    engine_url = orch.registry.get("prefill-0").info.url  # type: ignore[union-attr]

    async def heard() -> bool | None:
        probes.append(f"probe {len(probes):>9}.")  # 16 bytes: one block
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": probes[-1], "max_tokens": 1}
            async with http.post(f"{engine_url}/v1/completions", json=body) as resp:
                assert resp.status == 200
        cached = [orch.kv_index.cached_tokens(tokenize(p)).get("prefill-0") for p in probes]
        return BLOCK in cached or None

    await eventually(heard, interval=0.05, what="the agent to hear its engine")
    for i, prompt in enumerate(PROMPTS):
        assert await complete(orch.url, prompt, f"before-{i}") == (200, "prefill-0")
    last = tokenize(PROMPTS[-1])
    # Events arrive in order: once the last prompt is indexed, everything before it is.
    await eventually(
        lambda: orch.kv_index.cached_tokens(last).get("prefill-0") == full_tokens(PROMPTS[-1]),
        what="the last prompt indexed",
    )
    before = orch.kv_index.engine_blocks("prefill-0")
    assert len(before) == CACHE_BLOCKS  # the engine is full: older prompts lost their first blocks
    assert "prefill-0" not in orch.kv_index.cached_tokens(tokenize(PROMPTS[0]))

    orch = await lose_sessions(orch, orchestrators, prefill)
    recovery = time.monotonic()

    async def served() -> bool | None:
        # Shorter than a block: it leaves the engines' caches as they are.
        status, _ = await complete(orch.url, "hi again", f"after-{time.monotonic()}")
        return status == 200 or None

    await eventually(served, timeout=DEADLINE_S, interval=0.05, what="a request served after the recovery")
    assert time.monotonic() - recovery < RECOVERY_S
    await eventually(
        lambda: orch.kv_index.engine_blocks("prefill-0") == before, what="the same entries as before"
    )
    assert {a.agent_id: a.engine_pids() for a in (prefill, decode)} == engines  # no engine restarted

    await eventually(lambda: ready(orch), what="both instances ready again")
    status, pick = await complete(orch.url, PROMPTS[-1], "repeat")
    assert (status, pick) == (200, "prefill-0")
    request = (await explanation(orch.url, "repeat"))["explanation"]["request"]
    assert request["cached_tokens"]["prefill-0"] == full_tokens(PROMPTS[-1])
    log = prefill.output()
    assert "saying Hello again" in log and "resyncing the orchestrator's KV index" in log, log[-3000:]
