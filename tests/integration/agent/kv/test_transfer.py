"""Agent-to-agent KV transfers on real ZeroMQ sockets over loopback, between two pools with real arenas.

Each test has a holder and a receiver (two ``PoolNode``s and their ``KvTransfer``s on this loop): the
holder grants blocks to a token, the receiver fetches them. What must hold: the bytes arrive
identical, layer by layer; a fetch the grant does not cover is refused and writes nothing; a fetch
that fails for any reason leaves its slots ``FAILED`` and its pool without the blocks and without a
reference; both sides' pins are gone once a fetch is over.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from tests.helpers import eventually
from vllm_disagg.agent.kv.arena import FAILED, Capacity, Geometry
from vllm_disagg.agent.kv.frames import FetchRequest, Refused, Start, decode, encode
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.plane import FetchStarted, KvPlane
from vllm_disagg.agent.kv.pool import PrefixPool
from vllm_disagg.agent.kv.transfer import KvTransfer
from vllm_disagg.clock import FakeClock
from vllm_disagg.private_files import mask
from vllm_disagg.protocol.curve import Keypair, load_keypair, make_keypair
from vllm_disagg.wire.block_hash import prompt_block_hashes

GEOMETRY = Geometry(num_layers=4, layer_block_bytes=4096, block_size=16)
# Real keys: the receiver checks that the token ids a holder sends hash to the keys it asked for.
BLOCK_TOKENS = [(i + 1,) * GEOMETRY.block_size for i in range(6)]
KEYS = prompt_block_hashes([t for block in BLOCK_TOKENS for t in block], GEOMETRY.block_size)
TIMEOUT_S = 10.0


@dataclass
class Agent:
    """One side: its pool node and its transfer."""

    node: PoolNode
    transfer: KvTransfer

    @property
    def pool(self) -> PrefixPool:
        assert self.node.pool is not None
        return self.node.pool


StartAgent = Callable[..., Awaitable[Agent]]


@pytest.fixture
async def agents() -> AsyncIterator[StartAgent]:
    started: list[Agent] = []

    async def start(
        geometry: Geometry = GEOMETRY,
        capacity: int = 16,
        on_chunk: Callable[[Agent, int, Sequence[int]], None] | None = None,
        **options: object,
    ) -> Agent:
        node = PoolNode(f"vllm-disagg-test-{uuid.uuid4().hex}", Capacity(capacity, "blocks"))
        node.open(geometry)

        def hook(layer: int, slots: Sequence[int]) -> None:
            if on_chunk is not None:
                on_chunk(agent, layer, slots)

        agent = Agent(node, KvTransfer(node, on_chunk=hook, **options))  # type: ignore[arg-type]
        await agent.transfer.start()
        started.append(agent)
        return agent

    yield start
    for agent in started:
        await agent.transfer.close()
        agent.node.close()


def fill(agent: Agent, keys: Sequence[bytes]) -> dict[bytes, bytes]:
    """Store ``keys`` with random bytes, as the engine's saves would; the bytes by key."""
    assert agent.node.arena is not None
    got = agent.pool.reserve(
        "save:1", [(k, keys[i - 1] if i else None, tokens(k)) for i, k in enumerate(keys)]
    )
    data = {}
    for key, slot in got.items():
        data[key] = os.urandom(agent.node.arena.geometry.block_bytes)
        agent.node.arena.block_view(slot)[:] = data[key]
    agent.pool.commit("save:1", got)
    agent.pool.release("save:1")
    agent.node.changed()
    return data


def tokens(key: bytes) -> tuple[int, ...]:
    """A block's token ids, as the engine saved them (none known for a key not of ``KEYS``)."""
    return BLOCK_TOKENS[KEYS.index(key)] if key in KEYS else ()


def slot_of(agent: Agent, key: bytes) -> int:
    """``key``'s slot in ``agent``'s pool: it holds the block or has reserved room for it."""
    found = agent.pool.slot_of(key)
    assert found is not None
    return found


def block_bytes(agent: Agent, key: bytes) -> bytes:
    slot = agent.pool.slot_of(key)
    assert slot is not None and agent.node.arena is not None
    return bytes(agent.node.arena.block_view(slot))


async def fetch_all(receiver: Agent, holder: Agent, token: str, keys: Sequence[bytes]) -> int:
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, token, keys, TIMEOUT_S)
    return await started.done


async def unpinned(agent: Agent) -> None:
    await eventually(lambda: agent.pool.stats().referenced == 0, timeout=5, what="no references")


def test_a_kv_plane_has_no_endpoint_until_started() -> None:
    plane: KvPlane = KvTransfer(PoolNode("unused", Capacity(1, "blocks")))
    assert plane.endpoint == ""


# --- what arrives ----------------------------------------------------------------------------------
async def test_granted_blocks_arrive_identical_and_ready_and_every_pin_is_let_go(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    sent = fill(holder, KEYS)
    assert holder.transfer.grant("t1", KEYS, None, 30) == len(KEYS)
    assert holder.pool.stats().referenced == len(KEYS)  # pinned for the fetch

    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t1", KEYS, TIMEOUT_S)
    assert (started.requested, started.already_held, started.reserved) == (6, 0, 6)
    assert all(receiver.pool.state_of(k) == "pending" for k in KEYS)  # the engine may pin them now
    assert await started.done == 6

    assert all(block_bytes(receiver, k) == sent[k] for k in KEYS)
    assert all(receiver.pool.state_of(k) == "ready" for k in KEYS)
    # With their token ids and parents: the receiver's pool reports them, and the index chains them.
    assert [receiver.pool.info(k) for k in KEYS] == [holder.pool.info(k) for k in KEYS]
    assert receiver.node.arena is not None
    assert {receiver.node.arena.layers_ready(receiver.pool.slot_of(k) or 0) for k in KEYS} == {4}
    assert receiver.pool.stats().referenced == 0
    await unpinned(holder)  # the receiver's Done ended the grant
    assert (receiver.transfer.ended[-1].reason, receiver.transfer.ended[-1].failed) == ("", False)


async def test_received_counts_what_landed_per_source_pool_largest_first(agents: StartAgent) -> None:
    holder, other, receiver = await agents(), await agents(), await agents()
    fill(holder, KEYS)
    fill(other, [b"\xee" * 32])
    holder.transfer.grant("t1", KEYS[:2], None, 30)
    assert await fetch_all(receiver, holder, "t1", KEYS[:2]) == 2
    holder.transfer.grant("t2", KEYS, None, 30)
    assert await fetch_all(receiver, holder, "t2", KEYS) == 4  # the first two are held already
    holder.transfer.grant("t3", KEYS[:2], None, 30)
    assert await fetch_all(receiver, holder, "t3", KEYS[:2]) == 0  # nothing to move: no transfer
    assert await fetch_all(receiver, holder, "no-such-grant", [b"\x77" * 32]) == 0  # refused
    other.transfer.grant("o1", [b"\xee" * 32], None, 30)
    assert await fetch_all(receiver, other, "o1", [b"\xee" * 32]) == 1

    got = receiver.transfer.received()
    assert [(c.source, c.nbytes, c.transfers) for c in got] == [
        (holder.transfer.endpoint, 6 * GEOMETRY.block_bytes, 2),
        (other.transfer.endpoint, GEOMETRY.block_bytes, 1),
    ]
    assert all(c.seconds > 0 for c in got), "request to last byte"
    assert holder.transfer.received() == [], "what a pool served is not what it received"


async def test_layers_land_one_by_one_while_the_blocks_are_still_pending(agents: StartAgent) -> None:
    holder = await agents(chunk_bytes=2 * GEOMETRY.layer_block_bytes)  # two blocks per chunk
    seen: list[tuple[int, list[int], bool]] = []

    def watch(agent: Agent, layer: int, slots: Sequence[int]) -> None:
        assert agent.node.arena is not None
        ready = [agent.node.arena.layers_ready(s) for s in all_slots]
        seen.append((layer, ready, all(agent.pool.state_of(k) == "pending" for k in KEYS[:5])))

    receiver = await agents(on_chunk=watch)
    fill(holder, KEYS[:5])
    holder.transfer.grant("t", KEYS[:5], None, 30)
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t", KEYS[:5], TIMEOUT_S)
    all_slots = [slot_of(receiver, k) for k in KEYS[:5]]
    assert await started.done == 5

    # 4 layers x 3 chunks (2 + 2 + 1 blocks), in order: layer l's blocks say l + 1 as soon as they land,
    # while the blocks of the layers after still say l, and none is committed before the last layer.
    assert [layer for layer, _, _ in seen] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [ready for _, ready, _ in seen[:3]] == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert seen[4][1] == [2, 2, 2, 2, 1]
    assert seen[-1][1] == [4, 4, 4, 4, 4]
    assert all(pending for _, _, pending in seen)


async def test_blocks_the_receiver_already_leads_with_are_not_fetched_again(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    sent = fill(holder, KEYS)
    mine = fill(receiver, KEYS[:2])
    holder.transfer.grant("t", KEYS, None, 30)
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t", KEYS, TIMEOUT_S)
    assert (started.already_held, started.reserved) == (2, 4)
    assert await started.done == 4
    assert block_bytes(receiver, KEYS[0]) == mine[KEYS[0]]
    assert block_bytes(receiver, KEYS[5]) == sent[KEYS[5]]


async def test_the_prefix_held_here_is_not_evicted_to_make_room_for_its_continuation(
    agents: StartAgent,
) -> None:
    holder, receiver = await agents(), await agents(capacity=4)
    fill(holder, KEYS)
    fill(receiver, KEYS[:2])  # unreferenced: the first blocks an eviction would take
    holder.transfer.grant("t", KEYS, None, 30)
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t", KEYS, TIMEOUT_S)
    assert (started.already_held, started.reserved) == (2, 2)
    assert await started.done == 2
    assert receiver.pool.lookup(KEYS) == 4


async def test_nothing_to_fetch_when_everything_is_held_already(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    fill(holder, KEYS[:2])
    fill(receiver, KEYS[:2])
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t", KEYS[:2], TIMEOUT_S)
    assert (started.already_held, started.reserved, await started.done) == (2, 0, 0)
    assert receiver.pool.stats().referenced == 0


async def test_a_bad_endpoint_is_an_error_before_anything_is_reserved(agents: StartAgent) -> None:
    receiver = await agents()
    with pytest.raises(zmq.ZMQError):
        await receiver.transfer.fetch("tcp://no-port-here", None, "t", KEYS, TIMEOUT_S)
    assert receiver.pool.stats().used == 0


async def test_a_holder_missing_some_blocks_sends_the_prefix_it_has(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    fill(holder, KEYS[:3])
    assert holder.transfer.grant("t", KEYS, None, 30) == 3
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t", KEYS, TIMEOUT_S)
    slots = [receiver.pool.slot_of(k) or 0 for k in KEYS]
    assert await started.done == 3
    assert [k in receiver.pool for k in KEYS] == [True] * 3 + [False] * 3
    assert receiver.node.arena is not None
    assert [receiver.node.arena.layers_ready(s) for s in slots[3:]] == [FAILED] * 3
    ended = receiver.transfer.ended[-1]
    assert "3 of the 6" in ended.reason and not ended.failed  # a shorter prefix is no failure


async def test_a_pool_full_of_pinned_blocks_fetches_what_fits(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents(capacity=2)
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, None, 30)
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, "t", KEYS, TIMEOUT_S)
    assert started.reserved == 2
    assert await started.done == 2
    assert receiver.pool.stats().used == 2


# --- what is refused -------------------------------------------------------------------------------
async def refused(receiver: Agent, started: FetchStarted, slots: list[int]) -> str:
    """Await a fetch that must fail; check it wrote nothing and left nothing behind; its reason."""
    assert await started.done == 0
    assert receiver.node.arena is not None
    assert [receiver.node.arena.layers_ready(s) for s in slots] == [FAILED] * len(slots)
    assert all(not any(receiver.node.arena.layer_view(s, 0)) for s in slots)  # fresh arena: zeros
    assert receiver.pool.stats().used == 0 and receiver.pool.stats().referenced == 0
    assert receiver.transfer.ended[-1].failed
    return receiver.transfer.ended[-1].reason


async def start_fetch(
    receiver: Agent, holder: Agent, token: str, keys: Sequence[bytes]
) -> tuple[FetchStarted, list[int]]:
    started = await receiver.transfer.fetch(holder.transfer.endpoint, None, token, keys, TIMEOUT_S)
    return started, [receiver.pool.slot_of(k) or 0 for k in keys]


async def test_keys_the_grant_did_not_name_are_refused_and_nothing_is_written(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS[:2], None, 30)
    reason = await refused(receiver, *await start_fetch(receiver, holder, "t", KEYS[:3]))
    assert "1 of 3 keys requested were not granted" in reason


async def test_an_unknown_token_is_refused(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    fill(holder, KEYS)
    reason = await refused(receiver, *await start_fetch(receiver, holder, "guess", KEYS[:1]))
    assert "unknown token" in reason


async def test_an_expired_grant_is_refused_and_its_pins_are_gone(agents: StartAgent) -> None:
    clock = FakeClock()
    holder, receiver = await agents(clock=clock), await agents()
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, None, 5)
    clock.advance(5)
    reason = await refused(receiver, *await start_fetch(receiver, holder, "t", KEYS))
    assert "grant expired" in reason
    assert holder.pool.stats().referenced == 0


async def test_an_unused_grant_lets_go_of_its_pins_once_its_ttl_passed(agents: StartAgent) -> None:
    clock = FakeClock()
    holder = await agents(clock=clock)
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, None, 5)
    clock.advance(4)
    assert holder.transfer.expire_grants() == []
    clock.advance(1)
    assert holder.transfer.expire_grants() == ["t"]  # what the loop timer calls
    assert holder.pool.stats().referenced == 0


async def test_a_token_serves_one_fetch(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS[:2], None, 30)
    assert await fetch_all(receiver, holder, "t", KEYS[:2]) == 2
    await unpinned(holder)  # the fetch's Done ended the grant
    receiver.pool.clear()
    started, _ = await start_fetch(receiver, holder, "t", KEYS[:2])
    assert await started.done == 0
    assert "unknown token" in receiver.transfer.ended[-1].reason


async def test_pools_of_different_geometry_do_not_exchange_blocks(agents: StartAgent) -> None:
    holder = await agents()
    receiver = await agents(geometry=Geometry(num_layers=4, layer_block_bytes=2048, block_size=16))
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, None, 30)
    reason = await refused(receiver, *await start_fetch(receiver, holder, "t", KEYS))
    assert "geometry mismatch" in reason
    assert holder.pool.stats().referenced == len(KEYS)  # the grant is still good for a right fetch


async def test_garbage_gets_a_refusal_and_the_holder_keeps_serving(agents: StartAgent) -> None:
    holder, receiver = await agents(), await agents()
    fill(holder, KEYS)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(holder.transfer.endpoint)
    try:
        for parts in (
            [b"\xc1garbage"],
            [b"a", b"b"],
            [msgpack.packb(["start", 1, {}])],  # not a frame a receiver sends
            [msgpack.packb(["start", 1, GEOMETRY.to_wire()])],
        ):
            await raw.send_multipart(parts)
            answer = decode(await asyncio.wait_for(raw.recv(), 5), 1 << 16)
            assert isinstance(answer, Refused) and answer.reason
    finally:
        raw.close(linger=0)
        ctx.term()
    holder.transfer.grant("t", KEYS, None, 30)
    assert await fetch_all(receiver, holder, "t", KEYS) == len(KEYS)


async def test_a_receiver_of_a_later_version_is_refused_saying_so_and_may_ask_again_in_ours(
    agents: StartAgent,
) -> None:
    """A rolling upgrade: a newer agent fetches from this one. The holder reads no frames of a later
    version; it says so with a code the receiver can act on, and serves the same grant in version 1."""
    holder = await agents()
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, None, 30)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(holder.transfer.endpoint)
    try:
        await raw.send(encode(FetchRequest("t", tuple(KEYS), GEOMETRY, 1, 30.0, version=2)))
        refusal = decode(await asyncio.wait_for(raw.recv(), 5), 1 << 16)
        assert isinstance(refusal, Refused) and refusal.code == "unsupported_version"
        assert "v2" in refusal.reason and "v1" in refusal.reason
        assert holder.pool.stats().referenced == len(KEYS), "the grant is still there for a fetch in v1"
        await raw.send(encode(FetchRequest("t", tuple(KEYS), GEOMETRY, 1, 30.0)))
        start = decode(await asyncio.wait_for(raw.recv(), 5), 1 << 16)
        assert isinstance(start, Start) and start.version == 1 and start.blocks == len(KEYS)
    finally:
        raw.close(linger=0)
        ctx.term()


# --- with agent keys (CurveZMQ) --------------------------------------------------------------------
@pytest.fixture
def keypairs(tmp_path: Path) -> dict[str, Keypair]:
    out = {}
    for name in ("holder", "receiver", "intruder"):
        make_keypair(tmp_path, name)
        out[name] = load_keypair(str(tmp_path / f"{name}.key_secret"))
    return out


async def test_with_keys_only_the_granted_key_fetches(
    agents: StartAgent, keypairs: dict[str, Keypair]
) -> None:
    big = Geometry(num_layers=2, layer_block_bytes=1 << 16, block_size=16)  # parts at the size limit
    holder = await agents(geometry=big, keys=keypairs["holder"])
    receiver = await agents(geometry=big, keys=keypairs["receiver"])
    intruder = await agents(geometry=big, keys=keypairs["intruder"])
    sent = fill(holder, KEYS)
    holder_key = keypairs["holder"].public
    holder.transfer.grant("for-receiver", KEYS, keypairs["receiver"].public, 30)

    # A key no grant names does not get past the handshake.
    started = await intruder.transfer.fetch(
        holder.transfer.endpoint, holder_key, "for-receiver", KEYS, TIMEOUT_S
    )
    assert "refused this agent's key" in await refused(
        intruder, started, [intruder.pool.slot_of(k) or 0 for k in KEYS]
    )

    # A key some other grant names gets in, but not with this grant's token.
    holder.transfer.grant("for-intruder", KEYS[:1], keypairs["intruder"].public, 30)
    started = await intruder.transfer.fetch(
        holder.transfer.endpoint, holder_key, "for-receiver", KEYS, TIMEOUT_S
    )
    reason = await refused(intruder, started, [intruder.pool.slot_of(k) or 0 for k in KEYS])
    assert "not the one granted" in reason

    started = await receiver.transfer.fetch(
        holder.transfer.endpoint, holder_key, "for-receiver", KEYS, TIMEOUT_S
    )
    assert await started.done == len(KEYS)
    assert all(block_bytes(receiver, k) == sent[k] for k in KEYS)


async def test_with_keys_a_holder_of_another_key_is_not_trusted(
    agents: StartAgent, keypairs: dict[str, Keypair]
) -> None:
    holder = await agents(keys=keypairs["holder"])
    receiver = await agents(keys=keypairs["receiver"])
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, keypairs["receiver"].public, 30)
    impostor_key = keypairs["intruder"].public  # the receiver expects this key of the holder
    started = await receiver.transfer.fetch(holder.transfer.endpoint, impostor_key, "t", KEYS, TIMEOUT_S)
    assert "handshake" in await refused(receiver, started, [receiver.pool.slot_of(k) or 0 for k in KEYS])


# --- what dies -------------------------------------------------------------------------------------
async def test_a_holder_closed_mid_transfer_leaves_failed_slots_and_no_blocks(agents: StartAgent) -> None:
    first_chunk = asyncio.Event()
    holder = await agents(window=1, chunk_bytes=GEOMETRY.layer_block_bytes)  # 24 chunks, one at a time
    receiver = await agents(window=1, on_chunk=lambda *_: first_chunk.set())
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, None, 30)
    started, slots = await start_fetch(receiver, holder, "t", KEYS)
    await first_chunk.wait()
    await holder.transfer.close()
    reason = await refused_after_landing(receiver, started, slots)
    assert "connection closed" in reason


async def refused_after_landing(receiver: Agent, started: FetchStarted, slots: list[int]) -> str:
    assert await started.done == 0
    assert receiver.node.arena is not None
    assert [receiver.node.arena.layers_ready(s) for s in slots] == [FAILED] * len(slots)
    assert receiver.pool.stats().used == 0 and receiver.pool.stats().referenced == 0
    assert receiver.transfer.ended[-1].failed
    return receiver.transfer.ended[-1].reason


async def test_a_receiver_gone_mid_transfer_lets_the_holder_unpin(agents: StartAgent) -> None:
    first_chunk = asyncio.Event()
    holder = await agents(window=1, chunk_bytes=GEOMETRY.layer_block_bytes)
    receiver = await agents(window=1, on_chunk=lambda *_: first_chunk.set())
    fill(holder, KEYS)
    holder.transfer.grant("t", KEYS, None, 30)
    started, slots = await start_fetch(receiver, holder, "t", KEYS)
    await first_chunk.wait()
    await receiver.transfer.close()
    await refused_after_landing(receiver, started, slots)
    await unpinned(holder)


async def test_nothing_listening_fails_the_fetch_at_once(agents: StartAgent) -> None:
    gone = await agents()
    endpoint = gone.transfer.endpoint
    await gone.transfer.close()
    receiver = await agents()
    started = await receiver.transfer.fetch(endpoint, None, "t", KEYS, TIMEOUT_S)
    slots = [receiver.pool.slot_of(k) or 0 for k in KEYS]
    assert "cannot connect" in await refused_after_landing(receiver, started, slots)


async def test_a_silent_holder_times_the_fetch_out(agents: StartAgent) -> None:
    ctx = zmq.asyncio.Context()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    receiver = await agents()
    try:
        started = await receiver.transfer.fetch(f"tcp://127.0.0.1:{port}", None, "t", KEYS, 0.3)
        slots = [receiver.pool.slot_of(k) or 0 for k in KEYS]
        assert "timed out" in await refused_after_landing(receiver, started, slots)
    finally:
        mute.close(linger=0)
        ctx.term()


# --- the benchmark ---------------------------------------------------------------------------------
def test_bench_kv_runs_small_and_reports_its_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_disagg.cli.commands import main

    argv = ["bench", "kv", "--blocks", "4", "--rounds", "1", "--layers", "4", "--layer-block-kib", "16"]
    argv += ["--ttft-rounds", "0", "--handoff-rounds", "0"]  # real vLLM: tests/e2e/vllm/test_bench_kv_ttft.py
    assert main([*argv, "--churn-s", "2", "--churn-capacity", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"agent_gbps", "loopback_gbps", "ratio"} <= result.keys()
    assert result["churn_max_used"] <= result["churn_capacity"] == 8
    assert result["churn_fetches"] > 0 and result["churn_errors"] == 0
    # The disk tier under it: blocks evicted from memory went there, and every one was read back whole.
    assert result["churn_spilled"] > 0 and result["churn_disk_checked"] > 0 and result["churn_ok"]


async def test_a_receiver_that_vanishes_without_a_word_is_found_out_and_unpinned(
    agents: StartAgent, caplog: pytest.LogCaptureFixture
) -> None:
    token = "grant-token-that-must-never-reach-a-log"
    holder = await agents(chunk_bytes=GEOMETRY.layer_block_bytes)
    fill(holder, KEYS)
    holder.transfer.grant(token, KEYS, None, 30)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(holder.transfer.endpoint)
    try:
        await raw.send(encode(FetchRequest(token, tuple(KEYS), GEOMETRY, 1, 30.0)))
        assert isinstance(decode(await asyncio.wait_for(raw.recv(), 5), 1 << 16), Start)
        await asyncio.wait_for(raw.recv_multipart(), 5)  # one chunk, then silence: no credit, no Done
    finally:
        raw.close(linger=0)
        ctx.term()
    assert holder.pool.stats().referenced == len(KEYS)
    await unpinned(holder)  # its next ping finds the connection gone
    # The holder says which grant's stream ended, by a digest: the token itself never reaches a log.
    assert f"kv stream of grant {mask(token)}" in caplog.text
    assert token not in caplog.text
