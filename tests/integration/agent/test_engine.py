"""``EngineSupervisor`` in-process with stand-in engines: stuck starts, stubborn children, clean stops."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import aiohttp
import pytest

from tests.helpers import eventually, free_port
from tests.integration.agent.test_agent import gone
from vllm_disagg.agent.engine import EngineSupervisor
from vllm_disagg.agent.engine_command import EngineCommand
from vllm_disagg.clock import SystemClock
from vllm_disagg.config import AgentConfig
from vllm_disagg.protocol.messages import EngineState
from vllm_disagg.runtime import SELF_ARGV

DEADLINE_S = 60.0

# Ignores SIGTERM, starts a grandchild that ignores it too, writes both pids, never serves /health.
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()} {grandchild.pid}\\n")
time.sleep(600)
"""


class StubbornEngine(EngineCommand):
    """An engine that never becomes healthy and ignores SIGTERM, as does its child."""

    kind = "stubborn"

    def __init__(self, pid_file: Path) -> None:
        self.pid_file = pid_file

    def argv(self, cfg: AgentConfig) -> list[str]:
        return [sys.executable, "-c", STUBBORN, str(self.pid_file)]

    def env(self, cfg: AgentConfig) -> Mapping[str, str]:
        return {"STUBBORN": "1"}


class SimStandIn(EngineCommand):
    """The real sim engine, launched through a custom command to prove ``argv`` is what runs."""

    kind = "sim"

    def argv(self, cfg: AgentConfig) -> list[str]:
        return [*SELF_ARGV, "sim-engine", "--port", str(cfg.engine_port)]


def pids(pid_file: Path) -> list[tuple[int, int]]:
    if not pid_file.exists():
        return []
    return [(int(a), int(b)) for a, b in (line.split() for line in pid_file.read_text().splitlines())]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


def config(**changes: object) -> AgentConfig:
    defaults: dict[str, object] = dict(
        agent_id="a", role="both", engine_port=free_port(), scrape_interval_s=0.05, stop_grace_s=0.5
    )
    return AgentConfig(**{**defaults, **changes})  # type: ignore[arg-type]


async def test_an_engine_stuck_starting_is_killed_with_its_children_and_restarted(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    pid_file = tmp_path / "pids"
    cfg = config(startup_timeout_s=0.5, restart_backoff_s=0.05, restart_backoff_max_s=0.1)
    supervisor = EngineSupervisor(cfg, http, SystemClock(), command=StubbornEngine(pid_file))
    seen_states: set[str] = set()
    # What the hook saw: were all the engines launched so far gone (the KV forwarder clears then)?
    old_engines_gone_at_restart: list[bool] = []
    supervisor.on_restart = lambda: old_engines_gone_at_restart.append(
        all(gone(c) and gone(g) for c, g in pids(pid_file))
    )

    def watch() -> bool:
        seen_states.add(supervisor.state)
        return len(pids(pid_file)) >= 2

    task = asyncio.create_task(supervisor.run())
    try:
        await eventually(watch, timeout=DEADLINE_S, what="a second launch after the stuck first one")
        (first_child, first_grandchild), *_ = pids(pid_file)
        await eventually(lambda: gone(first_child) and gone(first_grandchild), timeout=DEADLINE_S)
        assert supervisor.restarts >= 1
        assert old_engines_gone_at_restart[: supervisor.restarts] == [True] * supervisor.restarts
        assert {"starting"} <= seen_states
        assert "ready" not in seen_states
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await supervisor.stop()
    assert supervisor.state == "stopped"
    for child, grandchild in pids(pid_file):
        assert gone(child) and gone(grandchild), "stop() must leave no process of the engine's group"


async def test_stop_kills_a_process_group_that_ignores_sigterm_after_the_grace_period(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:

    pid_file = tmp_path / "pids"
    supervisor = EngineSupervisor(config(), http, SystemClock(), command=StubbornEngine(pid_file))
    task = asyncio.create_task(supervisor.run())
    try:
        ((child, grandchild),) = await eventually(lambda: pids(pid_file), timeout=DEADLINE_S)
        assert supervisor.pid == child
        environ = await asyncio.to_thread(Path(f"/proc/{child}/environ").read_bytes)
        assert b"STUBBORN=1" in environ.split(b"\0")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await supervisor.stop()
    assert gone(child) and gone(grandchild)
    assert supervisor.pid is None


async def test_a_launched_engine_becomes_ready_and_a_second_stop_is_harmless(
    http: aiohttp.ClientSession,
) -> None:

    cfg = config()
    supervisor = EngineSupervisor(cfg, http, SystemClock(), command=SimStandIn())
    task = asyncio.create_task(supervisor.run())
    try:
        await eventually(lambda: supervisor.state == "ready", timeout=DEADLINE_S, what="engine ready")
        pid = supervisor.pid
        assert pid is not None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await supervisor.stop()
    await supervisor.stop()
    assert gone(pid)
    assert supervisor.state == "stopped"


async def test_attach_mode_follows_health_only(http: aiohttp.ClientSession, tmp_path: Path) -> None:

    pid_file = tmp_path / "pids"
    cfg = config(attach_url=f"http://127.0.0.1:{free_port()}")
    supervisor = EngineSupervisor(cfg, http, SystemClock(), command=StubbornEngine(pid_file))
    assert supervisor.attached
    task = asyncio.create_task(supervisor.run())
    try:
        # The state starts as "starting": only a tick of run() can make it "unhealthy".
        await eventually(lambda: supervisor.state == "unhealthy", timeout=DEADLINE_S)
        decision = await supervisor.tick()
        assert (decision.state, decision.action, supervisor.pid) == ("unhealthy", "none", None)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await supervisor.stop()
    assert not pid_file.exists()  # an attached supervisor launches nothing


class RoleRecordingSim(SimStandIn):
    """The real sim engine; remembers the role of every launch (vLLM's argv gives it as kv_role)."""

    def __init__(self) -> None:
        self.roles: list[str] = []

    def argv(self, cfg: AgentConfig) -> list[str]:
        self.roles.append(cfg.role)
        return super().argv(cfg)


def state_of(supervisor: EngineSupervisor) -> EngineState:
    """Its state now: read in a call, as mypy would apply an earlier assert's narrowing past an await."""
    return supervisor.state


async def test_a_relaunch_for_a_role_change_says_restarting_at_once_and_starts_the_engine_as_that_role(
    http: aiohttp.ClientSession,
) -> None:
    command = RoleRecordingSim()
    supervisor = EngineSupervisor(config(role="prefill"), http, SystemClock(), command=command)
    states: list[str] = []
    restarted: list[bool] = []
    supervisor.on_state = states.append
    supervisor.on_restart = lambda: restarted.append(True)
    task = asyncio.create_task(supervisor.run())
    try:
        await eventually(lambda: supervisor.state == "ready", timeout=DEADLINE_S, what="engine ready")
        old = supervisor.pid
        states.clear()
        supervisor.relaunch("decode")
        assert supervisor.state == "restarting", "no heartbeat after the Ack may still say ready"
        assert supervisor.config.role == "decode"
        await eventually(
            lambda: state_of(supervisor) == "ready", timeout=DEADLINE_S, what="the new engine ready"
        )
        assert old is not None and gone(old) and supervisor.pid not in (None, old)
        assert states == ["restarting", "starting", "ready"] and restarted == [True]
        assert command.roles == ["prefill", "decode"] and supervisor.restarts == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await supervisor.stop()
