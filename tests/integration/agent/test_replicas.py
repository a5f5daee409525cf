"""The agent as a real process with three orchestrator replicas: ``--orchestrator a,b,c``.

Each replica is a test-driven ROUTER (``FakeOrchestrator``); the agent follows a real simulated engine
whose KV events it forwards. It says Hello to all three, heartbeats and KV events reach all three, a
replica that forgot the agent alone gets the index resync, a drain from the leader shows in every
replica's heartbeats, a deposed leader's command is refused, the leader's shutdown ends the agent with a
Goodbye to each, and ``--command-log`` holds one line per command.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.helpers import free_port
from tests.integration.agent.test_agent import (
    AGENT_ID,
    HEARTBEAT_S,
    AgentProcess,
    FakeOrchestrator,
)
from tests.integration.conftest import EngineFactory
from vllm_disagg import jsonutil
from vllm_disagg.agent.fencing import stale_error
from vllm_disagg.config import SimTiming
from vllm_disagg.protocol.commands import Drain, Shutdown, Undrain
from vllm_disagg.protocol.messages import (
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    STALE_EPOCH,
    Ack,
    Command,
    Goodbye,
    Heartbeat,
    Hello,
    KvEvents,
    Refuse,
    Welcome,
)
from vllm_disagg.sim_engine.textgen import tokenize

BLOCK = 16


@pytest.fixture
async def replicas() -> AsyncIterator[list[FakeOrchestrator]]:
    fakes = [FakeOrchestrator() for _ in range(3)]
    try:
        yield fakes
    finally:
        for fake in fakes:
            fake.close()


async def welcome(replica: FakeOrchestrator) -> Hello:
    """Wait for a Hello and accept it as an orchestrator of this release."""
    hello = await replica.next(Hello)
    replica.send(Welcome(PROTOCOL_VERSION, AGENT_ID, HEARTBEAT_S, 1.0, protocol_minor=PROTOCOL_MINOR))
    return hello


def stored_tokens(prompt: str) -> Callable[[KvEvents], bool]:
    """KvEvents holding the stored first block of ``prompt``."""
    first = tokenize(prompt)[:BLOCK]
    return lambda m: any(e.kind == "stored" and e.token_ids[:BLOCK] == first for e in m.events)


def cleared(replica: FakeOrchestrator) -> int:
    """``cleared`` events the replica has read: one per index resync (the engine never restarts here)."""
    return sum(
        e.kind == "cleared" for i in replica.seen if isinstance(i.message, KvEvents) for e in i.message.events
    )


async def complete(url: str, prompt: str) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{url}/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 1}
        ) as resp,
    ):
        assert resp.status == 200


async def heard(url: str, replica: FakeOrchestrator) -> None:
    """Probe prompts until the replica gets the engine's events (the agent's SUB misses what precedes
    its joining)."""
    for n in itertools.count():
        probe = f"probe {n:>10} ...."
        await complete(url, probe)
        try:
            await replica.next(KvEvents, stored_tokens(probe), timeout=1.0)
            return
        except AssertionError:
            if n > 60:
                raise


async def test_an_agent_of_three_replicas_serves_each_and_obeys_only_the_current_leader(
    replicas: list[FakeOrchestrator], sim_engine: EngineFactory, tmp_path: Path
) -> None:
    kv_port = free_port()
    engine = await sim_engine(kv_events_port=kv_port, timing=SimTiming(block_size=BLOCK))
    command_log = tmp_path / "commands.jsonl"
    agent = AgentProcess(
        tmp_path / "agent.log",
        "--agent-id", AGENT_ID,
        "--role", "decode",
        "--orchestrator", ",".join(r.endpoint for r in replicas),
        "--command-log", str(command_log),
        "--attach", engine.url,
        "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}",
        "--scrape-interval-s", "0.05",
    )  # fmt: skip
    try:
        await _serve_three(agent, replicas, engine.url)
    finally:
        agent.kill()
    a, _, c = (r.endpoint for r in replicas)
    lines = [jsonutil.loads(line) for line in command_log.read_text().splitlines()]
    assert [(x["id"], x["kind"], x["epoch"], x["from"], x["accepted"], x["code"]) for x in lines] == [
        (1, "drain", 3, a, True, ""),
        (2, "undrain", 2, c, False, STALE_EPOCH),
        (3, "shutdown", 3, a, True, ""),
    ]


async def _serve_three(agent: AgentProcess, replicas: list[FakeOrchestrator], url: str) -> None:
    hellos = [await welcome(r) for r in replicas]
    assert hellos[0] == hellos[1] == hellos[2] and hellos[0].instance.role == "decode"
    for replica in replicas:
        await replica.next(Heartbeat, lambda h: h.engine_state == "ready")

    # KV events reach all three.
    first = replicas[0]
    await heard(url, first)
    prompt = "The quick brown fox jumps over the lazy dog; " * 2
    await complete(url, prompt)
    for replica in replicas:
        await replica.next(KvEvents, stored_tokens(prompt))

    # A replica that forgot the agent (restarted) says so: it alone gets the resync snapshot.
    forgetful = replicas[1]
    forgetful.send(Refuse("unknown_agent", "no session; say Hello"))
    await welcome(forgetful)
    snapshot = await forgetful.next(KvEvents)
    assert snapshot.events[0].kind == "cleared" and stored_tokens(prompt)(snapshot)
    later = "Another prompt, cached after the resync: " * 2
    await complete(url, later)
    for replica in replicas:
        await replica.next(KvEvents, stored_tokens(later))
    assert [cleared(r) for r in replicas] == [1, 2, 1]

    # The leader (epoch 3) drains; every replica's heartbeats say so; a deposed leader is refused.
    leader, deposed = replicas[0], replicas[2]
    leader.send(Command.of(1, Drain(), epoch=3))
    assert await leader.next(Ack) == Ack(1, True)
    for replica in replicas:
        await replica.next(Heartbeat, lambda h: h.draining)
    deposed.send(Command.of(2, Undrain(), epoch=2))
    assert await deposed.next(Ack) == Ack(2, False, stale_error(2, 3), code=STALE_EPOCH)
    for replica in replicas:  # an undrain carried out would have sent undrained heartbeats at once
        for _ in range(3):
            assert (await replica.next(Heartbeat)).draining
    leader.send(Command.of(3, Shutdown(), epoch=3))
    assert await leader.next(Ack) == Ack(3, True)
    for replica in replicas:
        assert await replica.next(Goodbye) == Goodbye("shutdown command")
    assert await agent.exit_code() == 0
    assert "now obeying epoch 3" in agent.output()
