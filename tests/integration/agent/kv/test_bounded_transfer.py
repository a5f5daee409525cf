"""Bounded transfers: whatever an agent is told, a fetch waits, and a grant pins, only so long; and a
receiver lands only blocks whose token ids (and extra keys: a LoRA adapter's, a cache salt's) hash to
the keys it asked for."""

from __future__ import annotations

import msgpack
import zmq
import zmq.asyncio

from tests.integration.agent.kv import test_transfer as base
from tests.integration.agent.kv.test_transfer import GEOMETRY, KEYS, Agent, StartAgent, refused, start_fetch
from vllm_disagg.agent.kv.grants import Grants
from vllm_disagg.agent.kv.report import stored_events
from vllm_disagg.clock import FakeClock
from vllm_disagg.protocol.kv_pool import MAX_FETCH_TIMEOUT_S, MAX_GRANT_TTL_S, MAX_STREAM_S
from vllm_disagg.wire.block_hash import Extra, block_hash, none_hash

agents = base.agents  # the fixture: holders and receivers on this loop


async def test_a_receiver_told_a_huge_timeout_waits_no_longer_than_the_cap(agents: StartAgent) -> None:
    ctx = zmq.asyncio.Context()
    holder = ctx.socket(zmq.ROUTER)  # sees the request, answers nothing
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    receiver = await agents()
    try:
        started = await receiver.transfer.fetch(f"tcp://127.0.0.1:{port}", None, "t", KEYS, 1e9)
        _, header = await holder.recv_multipart()
        assert msgpack.unpackb(header)[5] == MAX_FETCH_TIMEOUT_S  # what the receiver itself waits
        started.done.cancel()
    finally:
        holder.close(linger=0)
        ctx.term()


async def test_a_grant_told_a_huge_ttl_pins_no_longer_than_the_cap(agents: StartAgent) -> None:
    clock = FakeClock()
    holder = await agents(clock=clock)
    fill_keys(holder)
    holder.transfer.grant("t", KEYS, None, 1e9)
    clock.advance(MAX_GRANT_TTL_S - 1)
    assert holder.transfer.expire_grants() == []
    clock.advance(1)
    assert holder.transfer.expire_grants() == ["t"]
    assert holder.pool.stats().referenced == 0


async def test_a_grant_in_use_past_its_hard_deadline_is_ended_and_its_pins_released(
    agents: StartAgent,
) -> None:
    clock = FakeClock()
    holder = await agents(clock=clock)
    fill_keys(holder)
    assert holder.node.pool is not None
    grants = Grants(holder.node)
    grant = grants.add("t", KEYS, None, clock.monotonic() + 30)
    assert grant is not None and holder.pool.stats().referenced == len(KEYS)
    grant.in_use = True  # a stream started, and its receiver stalled
    clock.advance(30)
    assert grants.expire(clock.monotonic()) == []  # in use: its TTL alone does not end it
    assert grants.next_expiry() == grant.ends_by == grant.expires_at + MAX_STREAM_S
    clock.advance(MAX_STREAM_S)
    assert grants.expire(clock.monotonic()) == ["t"]
    assert holder.pool.stats().referenced == 0
    assert not grants.admits(b"k" * 40, clock.monotonic())


async def test_a_holder_naming_other_token_ids_than_its_keys_lands_nothing(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    lie = [(k, KEYS[i - 1] if i else None, (7,) * GEOMETRY.block_size) for i, k in enumerate(KEYS)]
    got = holder.pool.reserve("save:1", lie)
    holder.pool.commit("save:1", got)
    holder.pool.release("save:1")
    holder.transfer.grant("t", KEYS, None, 30)
    reason = await refused(receiver, *await start_fetch(receiver, holder, "t", KEYS))
    assert "token ids do not hash to the key" in reason


def fill_keys(agent: Agent) -> None:
    base.fill(agent, KEYS)


async def test_a_lora_prompt_s_blocks_move_with_their_extra_keys_and_stay_out_of_the_index(
    agents: StartAgent,
) -> None:
    # vLLM keys a LoRA request's blocks with the adapter: the receiver checks the keys with it.
    holder, receiver = await agents(), await agents()
    adapter: Extra = (("lora", "ada", "/adapters/ada"),)
    parent = none_hash()
    blocks: list[tuple[bytes, bytes | None, tuple[int, ...]]] = []
    for tokens in base.BLOCK_TOKENS[:3]:
        key = block_hash(parent, tokens, adapter)
        blocks.append((key, parent if blocks else None, tokens))
        parent = key
    keys = [key for key, _, _ in blocks]
    got = holder.pool.reserve("save:1", blocks, {key: adapter for key in keys})
    holder.pool.commit("save:1", got)
    holder.pool.release("save:1")
    holder.transfer.grant("t", keys, None, 30)
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t", keys, 10.0)
    assert await started.done == 3
    assert [receiver.pool.extra_of(k) for k in keys] == [adapter] * 3
    assert stored_events(receiver.node, keys) == []  # not indexable by their tokens alone


async def test_a_holder_that_leaves_out_the_extra_keys_lands_nothing(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    adapter: Extra = (("cache_salt", "s1"),)
    key = block_hash(none_hash(), base.BLOCK_TOKENS[0], adapter)
    got = holder.pool.reserve("save:1", [(key, None, base.BLOCK_TOKENS[0])])  # its extra keys forgotten
    holder.pool.commit("save:1", got)
    holder.pool.release("save:1")
    holder.transfer.grant("t", [key], None, 30)
    reason = await refused(receiver, *await start_fetch(receiver, holder, "t", [key]))
    assert "token ids do not hash to the key" in reason
