"""KV-cache events end to end: a simulated engine's PUB, a real agent in-process, the orchestrator's index.

The engine publishes on a real ZeroMQ PUB socket; the agent (``agent.main.serve``, attached to the
engine with ``kv_events_endpoint``) forwards to a real orchestrator, whose ``KvIndex`` the test reads.
The test subscribes to the engine itself to count what it announced. The control plane's rules for
``KvEvents`` (refusals, when an instance's entries are dropped) are pinned with scripted agents.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Literal

import aiohttp
import pytest
import zmq
import zmq.asyncio

from tests.helpers import eventually, free_port
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator_support import MODEL, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.agent.main import serve
from vllm_disagg.config import AgentConfig, SimTiming
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.protocol.messages import Heartbeat, KvEvent, KvEvents
from vllm_disagg.sim_engine.textgen import tokenize
from vllm_disagg.wire.kv_events import BlockRemoved, BlockStored, decode_frames, encode_batch

AGENT = "agent-kv"
BLOCK = 16
PROMPT = "The quick brown fox jumps over the lazy dog; " * 3 + "and then?"  # 144 tokens: 9 full blocks
PROMPT_IDS = tokenize(PROMPT)


class EngineEvents:
    """The test's own subscriber to the engine: counts the blocks the engine says it holds."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.blocks = 0  # stored minus removed, since the last reset
        self.batches = 0
        self.stored: list[tuple[int, ...]] = []  # token ids of each stored event

    async def drain(self) -> None:
        while await self.sock.poll(timeout=20):
            batch = decode_frames(await self.sock.recv_multipart())
            self.batches += 1
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.blocks += len(event.block_hashes)
                    self.stored.append(event.token_ids)
                elif isinstance(event, BlockRemoved):
                    self.blocks -= len(event.block_hashes)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def kv_port() -> int:
    """A free port for an engine's KV-events PUB socket."""
    return free_port()


async def complete(http: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = jsonutil.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2})
    async with http.post(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("leaving", ["goodbye", "timeout"])
async def test_an_agent_forwards_its_engines_kv_events_into_the_index_until_it_is_gone(
    orch: OrchestratorServer,
    http: aiohttp.ClientSession,
    sim_engine: EngineFactory,
    kv_port: int,
    leaving: Literal["goodbye", "timeout"],
) -> None:
    engine = await sim_engine(kv_events_port=kv_port, timing=SimTiming(block_size=BLOCK))
    endpoint = f"tcp://127.0.0.1:{kv_port}"
    cfg = AgentConfig(
        agent_id=AGENT,
        role="both",
        orchestrator=orch.zmq_endpoint,
        model=MODEL,
        attach_url=engine.url,
        kv_events_endpoint=endpoint,
        scrape_interval_s=0.05,
        sim=SimTiming(block_size=BLOCK),
    )
    ours = EngineEvents(endpoint)
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(cfg, stop))
    index = orch.kv_index
    try:
        view = await eventually(lambda: orch.registry.get(AGENT), what="the agent's Hello")
        assert view.info.tokenizer == ""  # the sim's tokens are bytes

        probes = iter(range(1_000_000))

        sent: list[str] = []

        async def both_hear() -> bool:
            # Subscribers miss what is published while they join: one-block prompts until both hear.
            # The agent forwards a moment after the engine publishes, so any probe so far counts.
            sent.append(f"probe {next(probes):>10} ....")
            await complete(http, engine.url, sent[-1])
            await ours.drain()
            return bool(ours.stored and ours.stored[-1] == tuple(tokenize(sent[-1])[:BLOCK])) and any(
                index.cached_tokens(tokenize(fence)).get(AGENT) for fence in sent
            )

        await eventually(both_hear, what="the agent and the test to hear the engine")
        await eventually(
            lambda: index.cached_tokens(tokenize(sent[-1])).get(AGENT), what="the last probe forwarded"
        )
        # From here both get every event, in order: count the engine's blocks from this baseline.
        baseline, ours.blocks = index.blocks_of(AGENT), 0

        await complete(http, engine.url, PROMPT)
        full = len(PROMPT_IDS) // BLOCK * BLOCK

        async def indexed() -> bool:
            await ours.drain()
            return index.cached_tokens(PROMPT_IDS).get(AGENT) == full

        await eventually(indexed, what="the prompt's blocks in the orchestrator's index")
        await ours.drain()
        assert ours.blocks == len(PROMPT_IDS) // BLOCK == 9
        assert index.blocks_of(AGENT) == baseline + ours.blocks
        assert index.cached_tokens(PROMPT_IDS) == {AGENT: full}
        assert index.cached_tokens(PROMPT_IDS[:40]) == {AGENT: 32}

        samples = await scrape(http, orch.url)
        assert sample(samples, "vllm_disagg_kv_index_blocks", instance=AGENT) == index.blocks_of(AGENT)
        assert sample(samples, "vllm_disagg_kv_events_total", instance=AGENT) >= 2  # a probe's, the prompt's
        assert ("vllm_disagg_kv_events_missed_total", frozenset({("instance", AGENT)})) in samples

        if leaving == "goodbye":
            stop.set()
            assert await asyncio.wait_for(agent, 30) == 0
        else:  # the agent vanishes without a word: the heartbeat timeout says it is dead
            agent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await agent
        await eventually(lambda: not orch.registry.is_live(AGENT), what="the instance dead")
        assert (index.blocks_of(AGENT), index.cached_tokens(PROMPT_IDS), index.total_blocks()) == (0, {}, 0)
    finally:
        stop.set()
        if not agent.done():
            agent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await agent
        ours.close()


STORED = KvEvent("stored", [101, 102], None, PROMPT_IDS[: 2 * BLOCK], BLOCK)


async def test_kv_events_from_an_agent_without_a_session_are_refused_as_unknown_agent(
    orch: OrchestratorServer, fake_agent: AgentFactory
) -> None:
    stranger = await fake_agent("stranger", "http://x", "both", join=False)

    def refused() -> bool:
        stranger.transport.send(KvEvents(seq=1, events=[STORED]))  # dropped until connected: repeat
        return bool(stranger.refusals)

    await eventually(refused, interval=0.05, what="a refusal")
    assert {r.code for r in stranger.refusals} == {"unknown_agent"}
    assert orch.kv_index.blocks_of("stranger") == 0


async def test_kv_events_from_a_live_session_are_applied_and_counted(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory
) -> None:
    agent = await fake_agent("p0", "http://127.0.0.1:9", "both")
    agent.transport.send(KvEvents(seq=1, events=[STORED, KvEvent("removed", [102])], missed=3))
    await eventually(lambda: orch.kv_index.blocks_of("p0") == 1, what="the events applied")
    assert orch.kv_index.cached_tokens(PROMPT_IDS) == {"p0": BLOCK}
    samples = await scrape(http, orch.url)
    assert sample(samples, "vllm_disagg_kv_events_total", instance="p0") == 2
    assert sample(samples, "vllm_disagg_kv_events_missed_total", instance="p0") == 3
    assert sample(samples, "vllm_disagg_kv_index_blocks", instance="p0") == 1


@pytest.mark.parametrize("how", ["hello again", "engine stopped", "goodbye"])
async def test_an_instances_entries_are_dropped_when_its_session_or_engine_ends(
    orch: OrchestratorServer, fake_agent: AgentFactory, how: str
) -> None:
    agent = await fake_agent("d0", "http://127.0.0.1:9", "both")
    other = await fake_agent("d1", "http://127.0.0.1:10", "both")
    for who in (agent, other):
        who.transport.send(KvEvents(seq=1, events=[STORED]))
    await eventually(
        lambda: orch.kv_index.cached_tokens(PROMPT_IDS) == {"d0": 2 * BLOCK, "d1": 2 * BLOCK},
        what="both indexed",
    )
    if how == "hello again":
        await agent.hello()  # a new session may be a new engine, its cache empty
    elif how == "engine stopped":
        agent.stop_heartbeats()
        agent.transport.send(Heartbeat(seq=99, engine_state="stopped"))
    else:
        await agent.close(goodbye=True)
    await eventually(lambda: orch.kv_index.blocks_of("d0") == 0, what="d0's entries dropped")
    assert orch.kv_index.cached_tokens(PROMPT_IDS) == {"d1": 2 * BLOCK}


async def test_an_agent_that_launches_the_simulated_engine_subscribes_where_it_publishes(
    orch: OrchestratorServer, http: aiohttp.ClientSession, kv_port: int
) -> None:
    cfg = AgentConfig(
        agent_id=AGENT,
        role="both",
        orchestrator=orch.zmq_endpoint,
        model=MODEL,
        engine_port=free_port(),
        kv_events_port=kv_port,
        scrape_interval_s=0.05,
        stop_grace_s=5,
        sim=SimTiming(block_size=BLOCK),
    )
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(cfg, stop))
    try:
        await eventually(
            lambda: (v := orch.registry.get(AGENT)) is not None and v.state == "ready",
            timeout=60,
            what="the launched engine ready",
        )
        index = orch.kv_index
        probes = iter(range(1_000_000))

        sent: list[str] = []

        async def heard() -> bool:
            # Any probe so far counts: the agent forwards a moment after the engine publishes.
            sent.append(f"probe {next(probes):>10} ....")
            await complete(http, cfg.engine_url, sent[-1])
            return any(index.cached_tokens(tokenize(fence)) for fence in sent)

        await eventually(heard, what="the agent to hear the engine it launched")
        await complete(http, cfg.engine_url, PROMPT)
        await eventually(
            lambda: index.cached_tokens(PROMPT_IDS) == {AGENT: len(PROMPT_IDS) // BLOCK * BLOCK},
            what="the prompt in the index",
        )
        stop.set()
        assert await asyncio.wait_for(agent, 30) == 0
        assert index.blocks_of(AGENT) == 0
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await agent


async def test_an_agent_listening_for_its_engine_forwards_what_the_engine_publishes_to_it(
    orch: OrchestratorServer, http: aiohttp.ClientSession, sim_engine: EngineFactory, tmp_path: Path
) -> None:
    """``--kv-events-listen`` (a pod's loopback, Kubernetes): the agent binds, the engine's PUB connects
    (vLLM does when its endpoint names a host), so nothing of the engine's listens beyond the host."""
    engine = await sim_engine(timing=SimTiming(block_size=BLOCK))
    listen = f"ipc://{tmp_path}/kv-events.sock"
    cfg = AgentConfig(
        agent_id=AGENT,
        role="both",
        orchestrator=orch.zmq_endpoint,
        model=MODEL,
        attach_url=engine.url,
        kv_events_listen=listen,
        scrape_interval_s=0.05,
        sim=SimTiming(block_size=BLOCK),
    )
    stop = asyncio.Event()
    agent = asyncio.create_task(serve(cfg, stop))
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        await eventually(lambda: orch.registry.get(AGENT), what="the agent's Hello")
        pub.connect(listen)  # as vLLM's publisher does with tcp://127.0.0.1:P
        ids = PROMPT_IDS[: 2 * BLOCK]
        seq = iter(range(1_000_000))

        async def indexed() -> bool:
            # A PUB drops what it sends before the subscriber's handshake is done: send until heard.
            stored = BlockStored((201, 202), None, tuple(ids), BLOCK)
            await pub.send_multipart(encode_batch(next(seq), 0.0, [stored]))
            return orch.kv_index.cached_tokens(ids).get(AGENT) == 2 * BLOCK

        await eventually(indexed, what="the engine's events in the orchestrator's index")
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(agent, 30)
        pub.close(linger=0)
        ctx.term()


def test_an_agent_listens_for_kv_events_only_on_its_own_host() -> None:
    with pytest.raises(ConfigError, match="kv_events_listen must be ipc:// or loopback"):
        AgentConfig(
            agent_id="a",
            role="both",
            model="m",
            attach_url="http://127.0.0.1:1",
            kv_events_listen="tcp://*:5557",
        )
