"""The simulated engine publishes vLLM's KV-cache events on a real ZeroMQ PUB socket."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq
import zmq.asyncio

from tests.helpers import eventually, free_port
from vllm_disagg import jsonutil
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.orchestrator.state.prefix_index import PrefixIndex, apply_batch, prompt_block_hashes
from vllm_disagg.sim_engine.engine import ENGINE_KEY, SimServer, start_engine
from vllm_disagg.sim_engine.textgen import tokenize
from vllm_disagg.wire.kv_events import BlockStored, KvEventBatch, decode_frames

BLOCK = 16
PROMPT = "The quick brown fox jumps over the lazy dog; " * 2 + "and then?"  # 99 tokens: 6 full blocks


@pytest.fixture
async def sub() -> AsyncIterator[tuple[zmq.asyncio.Socket, int]]:
    """A SUB socket subscribed to everything, and the port it will connect to."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        yield sock, free_port()
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    "timing",
    [SimTiming(block_size=BLOCK), SimTiming(block_size=BLOCK, decode_step_s=0.001)],
    ids=["zero-delay", "stepped"],
)
async def test_block_stored_events_feed_a_prefix_index(
    sub: tuple[zmq.asyncio.Socket, int], timing: SimTiming
) -> None:
    sock, port = sub
    server: SimServer = await start_engine(SimEngineConfig(port=0, kv_events_port=port, timing=timing))
    index = PrefixIndex(BLOCK)
    received: list[KvEventBatch] = []
    ids = tokenize(PROMPT)
    keys = prompt_block_hashes(ids, BLOCK)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        async with aiohttp.ClientSession() as http:

            async def complete(prompt: str) -> None:
                body = jsonutil.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 2})
                async with http.post(
                    f"{server.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    assert resp.status == 200

            async def drain() -> int:
                got = 0
                while await sock.poll(timeout=20):
                    batch = decode_frames(await sock.recv_multipart())
                    received.append(batch)
                    apply_batch(index, server.url, batch)
                    got += 1
                return got

            probes = iter(range(1_000_000))

            async def joined() -> bool:
                # A SUB misses what is published while it joins (slow joiner), and a cached prompt is not
                # announced twice: send fresh one-block prompts until one's event arrives.
                await complete(f"probe {next(probes):>10} ....")
                return await drain() > 0

            await eventually(joined, what="the subscriber to hear a first event")
            await complete(PROMPT)

            async def indexed() -> bool:
                await drain()
                return index.match(keys).get(server.url) == len(ids) // BLOCK

            await eventually(indexed, what="the prompt's blocks in the index")
    finally:
        await server.close()
    events = [e for batch in received for e in batch.events]
    assert all(isinstance(e, BlockStored) and e.block_size == BLOCK for e in events)
    assert index.match(keys) == {server.url: len(ids) // BLOCK} == {server.url: 6}


async def test_port_zero_publishes_nothing_and_a_taken_port_fails_startup(
    sub: tuple[zmq.asyncio.Socket, int],
) -> None:
    sock, port = sub
    off = await start_engine(SimEngineConfig(port=0))
    try:
        assert off.app[ENGINE_KEY].kv_events is None
        assert off.app[ENGINE_KEY].core.prefix_cache.listener is None
    finally:
        await off.close()
    sock.bind(f"tcp://127.0.0.1:{port}")
    with pytest.raises(zmq.ZMQError):
        await start_engine(SimEngineConfig(port=0, kv_events_port=port))
