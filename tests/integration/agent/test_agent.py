"""The agent as a real process against a test-driven orchestrator socket and real (simulated) engines.

The orchestrator's side is a real ``RouterTransport`` driven by each test, so these tests pin the
agent's behaviour without depending on the orchestrator's implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest

from tests.helpers import cli_argv, eventually, free_port
from vllm_disagg.agent.session import EXIT_REFUSED
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.protocol.messages import (
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    VLLM_CAPABILITIES,
    Ack,
    Command,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvLayout,
    Message,
    Refuse,
    Welcome,
)
from vllm_disagg.protocol.transport import Incoming, RouterTransport
from vllm_disagg.sim_engine.engine import SimServer, start_engine

M = TypeVar("M", bound=Message)

AGENT_ID = "agent-under-test"
HEARTBEAT_S = 0.05
DEADLINE_S = 60.0  # generous: a shared 2-core machine starts Python processes slowly


class FakeOrchestrator:
    """The orchestrator's end of the protocol, driven step by step by a test."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:0") -> None:
        self.router = RouterTransport(endpoint)
        self.endpoint = self.router.endpoint
        self.seen: list[Incoming] = []
        self.peer = b""  # the agent's connection (of its last Hello): what it sends comes on it

    async def next(
        self, kind: type[M], where: Callable[[M], bool] = lambda _: True, *, timeout: float = DEADLINE_S
    ) -> M:
        """The next ``kind`` message matching ``where``; other messages are recorded and skipped."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {kind.__name__} within {timeout}s; saw {self.tags()[-10:]}")
            try:
                incoming = await asyncio.wait_for(self.router.recv(), remaining)
            except TimeoutError:
                continue
            self.seen.append(incoming)
            assert incoming.error is None, f"the agent sent a bad frame: {incoming.error}"
            if isinstance(incoming.message, Hello) or not self.peer:  # a restarted one hears heartbeats
                self.peer = incoming.peer
            assert incoming.peer == self.peer, "the agent's frames come on the connection that said Hello"
            if isinstance(incoming.message, kind) and where(incoming.message):
                return incoming.message

    def tags(self) -> list[str]:
        return [i.message.TAG if i.message else "<error>" for i in self.seen]

    def send(self, message: Message) -> None:
        assert self.router.send(self.peer, message), f"could not send {message.TAG}: agent not connected"

    async def welcome(self) -> Hello:
        """Wait for Hello and accept it with a fast heartbeat."""
        hello = await self.next(Hello)
        self.send(
            Welcome(PROTOCOL_VERSION, AGENT_ID, heartbeat_interval_s=HEARTBEAT_S, heartbeat_timeout_s=1.0)
        )
        return hello

    def close(self) -> None:
        self.router.close()


class AgentProcess:
    """``vllm-disagg agent`` as a child process, its output in a file."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cli_argv("agent", *args), stdout=log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def exit_code(self, timeout: float = DEADLINE_S) -> int:
        try:
            return await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent still running after {timeout}s; output:\n{self.output()}") from None

    def engine_pids(self) -> set[int]:
        """The agent's child processes (its engine)."""
        pids: set[int] = set()
        for children in Path(f"/proc/{self.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in children.read_text().split())
        return pids

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie waiting for a reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


async def refuses_connections(url: str) -> bool:
    async with aiohttp.ClientSession() as http:
        try:
            async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)):
                return False
        except aiohttp.ClientConnectionError:
            return True


@pytest.fixture
async def orchestrator() -> AsyncIterator[FakeOrchestrator]:
    fake = FakeOrchestrator()
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture
def spawn_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []

    def spawn(endpoint: str, *args: str) -> AgentProcess:
        agent = AgentProcess(
            tmp_path / f"agent-{len(agents)}.log",
            "--agent-id", AGENT_ID,
            "--role", "decode",
            "--orchestrator", endpoint,
            "--model", "sim-model",
            "--scrape-interval-s", "0.05",
            "--stop-grace-s", "5",
            *args,
        )  # fmt: skip
        agents.append(agent)
        return agent

    yield spawn
    for agent in agents:  # SIGKILL: the kernel (die_with_parent) takes any engine down with it
        agent.kill()


@pytest.fixture
async def sim_engine() -> AsyncIterator[SimServer]:
    # Not the agent's defaults: an attached agent must report what the engine says, not what it assumed.
    server = await start_engine(SimEngineConfig(port=0, max_model_len=2048, timing=SimTiming(block_size=32)))
    try:
        yield server
    finally:
        await server.close()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def test_attached_agent_says_hello_with_its_instance_and_heartbeats_follow_the_engine(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess], sim_engine: SimServer
) -> None:
    agent = spawn_agent(orchestrator.endpoint, "--attach", sim_engine.url, "--block-size", "64")
    hello = await orchestrator.welcome()
    assert hello == Hello(
        protocol_version=PROTOCOL_VERSION,
        agent_id=AGENT_ID,
        instance=InstanceInfo(
            url=sim_engine.url,
            role="decode",
            model="sim-model",
            engine="sim",
            block_size=32,
            max_model_len=2048,
            capabilities=VLLM_CAPABILITIES,  # asked of the engine: it says its streams' token ids
            # What its server says of its layout (/version, /v1/models root); the rest is not known.
            layout=KvLayout(vllm_version="0.32.0+sim", model_path="sim-model"),
        ),
        incarnation=hello.incarnation,
        protocol_minor=PROTOCOL_MINOR,
    ), "the engine's own block size and context length (vllm:cache_config_info, /v1/models), not the flag's"
    assert len(hello.incarnation) == 16
    ready = await orchestrator.next(Heartbeat, lambda h: h.engine_state == "ready")
    later = await orchestrator.next(Heartbeat)
    assert later.seq > ready.seq
    assert later.metrics.generation_tokens == 3, "the agent's three one-token probes, nothing else"

    async with aiohttp.ClientSession() as http:
        body = {"model": "sim-model", "prompt": "count my tokens", "max_tokens": 5}
        async with http.post(f"{sim_engine.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
    served = await orchestrator.next(Heartbeat, lambda h: h.metrics.generation_tokens >= 3 + 5)
    assert served.metrics.requests_finished >= 1
    assert served.metrics.prompt_tokens >= len("count my tokens")
    assert served.metrics.ttft_s is not None
    assert served.metrics.scraped_at > 0

    orchestrator.send(Command(id=1, kind="shutdown"))
    assert await orchestrator.next(Ack) == Ack(id=1, ok=True)
    await orchestrator.next(Goodbye)
    assert await agent.exit_code() == 0
    assert not await refuses_connections(sim_engine.url)  # an attached engine is not the agent's to stop


async def test_an_agent_started_before_the_orchestrator_registers_once_it_binds_and_again_after_a_restart(
    spawn_agent: Callable[..., AgentProcess],
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    agent = spawn_agent(endpoint, "--attach", dead_url())
    await eventually(lambda: "cannot scrape" in agent.output(), timeout=DEADLINE_S, what="agent running")

    first = FakeOrchestrator(endpoint)
    try:
        await first.welcome()
        beat = await first.next(Heartbeat)
        assert beat.engine_state == "unhealthy"  # nothing listens at the attached URL
    finally:
        first.close()

    second = FakeOrchestrator(endpoint)  # a restarted orchestrator: knows nobody
    try:
        stray = await second.next(Heartbeat)
        assert stray.seq > beat.seq
        second.send(Refuse(code="unknown_agent", reason="no session; say Hello"))
        await second.welcome()
        assert (await second.next(Heartbeat)).seq > stray.seq
    finally:
        second.close()


async def test_drain_is_acked_and_carried_by_heartbeats_and_garbage_from_the_orchestrator_is_ignored(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> None:
    spawn_agent(orchestrator.endpoint, "--attach", dead_url())
    await orchestrator.welcome()
    assert not (await orchestrator.next(Heartbeat)).draining

    assert orchestrator.router.send_raw(orchestrator.peer, b"\xc1 not msgpack")
    orchestrator.send(Hello(PROTOCOL_VERSION, "x", InstanceInfo("u", "both", "m")))  # wrong direction
    orchestrator.send(Command(id=7, kind="drain"))
    assert await orchestrator.next(Ack) == Ack(id=7, ok=True)
    assert (await orchestrator.next(Heartbeat)).draining

    orchestrator.send(Command(id=8, kind="undrain"))
    assert await orchestrator.next(Ack) == Ack(id=8, ok=True)
    assert not (await orchestrator.next(Heartbeat)).draining


async def test_shutdown_is_acked_then_the_agent_says_goodbye_and_exits_0(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> None:
    agent = spawn_agent(orchestrator.endpoint, "--attach", dead_url())
    await orchestrator.welcome()
    await orchestrator.next(Heartbeat)
    orchestrator.send(Command(id=3, kind="shutdown", args={"reason": "scale in"}))
    assert await orchestrator.next(Ack) == Ack(id=3, ok=True)
    assert await orchestrator.next(Goodbye) == Goodbye(reason="shutdown command")
    assert await agent.exit_code() == 0


async def test_other_refusals_while_registering_keep_the_agent_saying_hello(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> None:
    spawn_agent(orchestrator.endpoint, "--attach", dead_url())
    await orchestrator.next(Hello)
    orchestrator.send(Refuse(code="not_ready", reason="orchestrator still loading"))
    await orchestrator.welcome()  # the agent tried again
    await orchestrator.next(Heartbeat)


async def test_an_orchestrator_of_protocol_1_0_is_said_hello_without_the_fields_it_does_not_know(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> None:
    """An orchestrator of 1.0 refuses unknown fields, the minor among them: refused for it (in 1.0's
    words), the agent says Hello as 1.0 and registers (the Welcome here has no minor either)."""
    spawn_agent(orchestrator.endpoint, "--attach", dead_url())
    first = await orchestrator.next(Hello)
    assert first.protocol_minor == PROTOCOL_MINOR
    orchestrator.send(Refuse(code="field_type_error", reason="Hello: unknown field(s) ['protocol_minor']"))
    await orchestrator.next(Hello, lambda h: h.protocol_minor == 0)
    orchestrator.send(
        Welcome(PROTOCOL_VERSION, AGENT_ID, heartbeat_interval_s=HEARTBEAT_S, heartbeat_timeout_s=1.0)
    )
    await orchestrator.next(Heartbeat)


async def test_a_version_mismatch_refusal_ends_the_agent_with_a_nonzero_code_and_the_reason(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> None:
    agent = spawn_agent(orchestrator.endpoint, "--attach", dead_url())
    await orchestrator.next(Hello)
    orchestrator.send(Refuse(code="version_mismatch", reason="orchestrator speaks protocol 99"))
    assert await agent.exit_code() == EXIT_REFUSED != 0
    assert "orchestrator speaks protocol 99" in agent.output()


async def launched_agent(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> tuple[AgentProcess, str, int]:
    """An agent launching its own sim engine, registered and ready: (agent, engine URL, engine pid)."""
    port = free_port()
    agent = spawn_agent(
        orchestrator.endpoint, "--engine", "sim", "--engine-port", str(port), "--restart-backoff-s", "0.5"
    )
    await orchestrator.welcome()
    await orchestrator.next(Heartbeat, lambda h: h.engine_state == "ready")
    (engine_pid,) = agent.engine_pids()
    return agent, f"http://127.0.0.1:{port}", engine_pid


async def test_a_sigkilled_engine_is_reported_restarting_then_ready_again_with_a_new_process(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> None:
    agent, url, engine_pid = await launched_agent(orchestrator, spawn_agent)
    os.kill(engine_pid, signal.SIGKILL)
    await orchestrator.next(Heartbeat, lambda h: h.engine_state == "restarting")
    await orchestrator.next(Heartbeat, lambda h: h.engine_state == "ready")
    (new_pid,) = agent.engine_pids()
    assert new_pid != engine_pid
    assert not await refuses_connections(url)

    agent.proc.send_signal(signal.SIGTERM)  # a clean stop: Goodbye, engine stopped, exit 0
    await orchestrator.next(Goodbye)
    assert await agent.exit_code() == 0
    assert gone(new_pid)


async def test_a_sigkilled_agent_takes_its_engine_down_with_it(
    orchestrator: FakeOrchestrator, spawn_agent: Callable[..., AgentProcess]
) -> None:
    agent, url, engine_pid = await launched_agent(orchestrator, spawn_agent)
    agent.kill()  # SIGKILL: no cleanup code runs in the agent
    await eventually(lambda: gone(engine_pid), timeout=DEADLINE_S, what=f"engine {engine_pid} gone")
    assert await refuses_connections(url)
