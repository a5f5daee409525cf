"""The pool's disk tier: blocks evicted from memory are kept in files, read back whole or not at all,
within a byte capacity, and found again by the next agent."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_disagg.agent.kv.arena import Capacity, Geometry
from vllm_disagg.agent.kv.disk import SUFFIX, DiskTier
from vllm_disagg.agent.kv.node import DiskConfig, PoolNode
from vllm_disagg.errors import ConfigError

GEOMETRY = Geometry(num_layers=2, layer_block_bytes=64, block_size=4)
FILE = 8 + 4 + 2 + 32 + 32 + 4 + 8 * 4 + GEOMETRY.block_bytes + 16  # magic, length, header, payload, sum


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * GEOMETRY.block_bytes)


def spill(tier: DiskTier, i: int) -> None:
    assert tier.spill(key(i), key(i - 1), (i, i + 1, i + 2, i + 3), payload(i))


def test_a_spilled_block_reads_back_byte_for_byte_with_its_chain_and_tokens(tmp_path: Path) -> None:
    tier = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    spill(tier, 7)
    into = memoryview(bytearray(GEOMETRY.block_bytes))
    assert tier.load(key(7), into)
    assert bytes(into) == bytes(payload(7))
    info = tier.info(key(7))
    assert info is not None and (info.parent, info.token_ids) == (key(6), (7, 8, 9, 10))
    assert tier.stats().loads == 1 and tier.take_stored() == [key(7)]


def test_a_block_s_extra_keys_are_kept_across_a_restart(tmp_path: Path) -> None:
    extra = (("lora", "ada", "/adapters/ada"), ("cache_salt", "s1"))
    assert DiskTier.open(tmp_path, GEOMETRY, 1 << 20).spill(key(1), None, (1, 2, 3, 4), payload(1), extra)
    spill(DiskTier.open(tmp_path, GEOMETRY, 1 << 20), 2)
    again = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    one, two = again.info(key(1)), again.info(key(2))
    assert one is not None and one.extra == extra and two is not None and two.extra is None


def test_a_new_tier_on_the_same_directory_finds_every_block_and_reads_it(tmp_path: Path) -> None:
    first = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    for i in range(1, 4):
        spill(first, i)
    again = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)  # the agent restarted
    assert set(again.keys()) == {key(1), key(2), key(3)}
    assert again.leading([key(1), key(2), key(3), key(9)]) == 3
    into = memoryview(bytearray(GEOMETRY.block_bytes))
    assert again.load(key(2), into) and bytes(into) == bytes(payload(2))


def test_another_geometry_neither_sees_nor_removes_the_blocks(tmp_path: Path) -> None:
    spill(DiskTier.open(tmp_path, GEOMETRY, 1 << 20), 1)
    other = DiskTier.open(tmp_path, Geometry(4, 64, 4), 1 << 20)
    assert len(other) == 0
    assert len(DiskTier.open(tmp_path, GEOMETRY, 1 << 20)) == 1


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-40],  # cut short: the page cache never reached the disk
        lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:],  # one bit of the payload
        lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]),  # the checksum itself
    ],
    ids=["torn", "payload-bit", "checksum"],
)
def test_a_torn_or_changed_file_is_never_loaded_and_is_removed(tmp_path: Path, damage: object) -> None:
    tier = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    spill(tier, 1)
    path = tier.directory / (key(1).hex() + SUFFIX)
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    into = memoryview(bytearray(b"\xaa" * GEOMETRY.block_bytes))
    assert not tier.load(key(1), into)
    assert bytes(into) == b"\xaa" * GEOMETRY.block_bytes  # nothing of it reached the slot
    assert key(1) not in tier and not path.exists()
    assert tier.stats().corrupt == 1 and tier.take_removed() == [key(1)]


def test_a_file_renamed_to_another_key_is_not_served_as_that_block(tmp_path: Path) -> None:
    tier = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    spill(tier, 1)
    spill(tier, 2)
    one, two = (tier.directory / (key(i).hex() + SUFFIX) for i in (1, 2))
    os.replace(one, two)  # block 2's name, block 1's bytes: the restart's header check refuses it
    again = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    assert len(again) == 0 and again.stats().corrupt == 1


def test_leftover_temporary_files_and_strangers_are_cleaned_or_ignored(tmp_path: Path) -> None:
    tier = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    (tier.directory / "abc.kvb.1234.tmp").write_bytes(b"half")
    (tier.directory / "notes.txt").write_text("kept")
    (tier.directory / (key(5).hex() + SUFFIX)).write_bytes(b"garbage")
    again = DiskTier.open(tmp_path, GEOMETRY, 1 << 20)
    assert len(again) == 0
    assert sorted(p.name for p in again.directory.iterdir()) == ["notes.txt"]


def test_past_its_byte_capacity_the_least_recently_used_files_go(tmp_path: Path) -> None:
    tier = DiskTier.open(tmp_path, GEOMETRY, 3 * FILE)
    for i in (1, 2, 3):
        spill(tier, i)
    assert tier.stats().bytes == 3 * FILE
    tier.load(key(1), memoryview(bytearray(GEOMETRY.block_bytes)))  # 1 is now the newest
    spill(tier, 4)
    assert set(tier.keys()) == {key(1), key(3), key(4)}
    assert not (tier.directory / (key(2).hex() + SUFFIX)).exists()
    assert tier.stats().evictions == 1 and tier.take_removed() == [key(2)]
    # A smaller capacity at the next start trims the oldest at once.
    assert set(DiskTier.open(tmp_path, GEOMETRY, 2 * FILE).keys()) == {key(1), key(4)}


# --- under the pool ---------------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Iterator[PoolNode]:
    # A pool of 4 blocks: the fifth stored evicts the oldest, to disk.
    made = PoolNode(
        f"vllm-disagg-test-{uuid.uuid4().hex}",
        Capacity.parse("4 blocks"),
        disk=DiskConfig(tmp_path / "disk", 1 << 20),
    )
    yield made
    made.close()


def store(node: PoolNode, *ids: int) -> None:
    pool, arena = node.pool, node.arena
    assert pool is not None and arena is not None
    # A block continues block i - 1 where that is pooled or stored with it; else it starts a chain.
    chained = [i > 1 and (i - 1 in ids or key(i - 1) in pool) for i in ids]
    got = pool.reserve(
        "save:1", [(key(i), key(i - 1) if c else None, (i,) * 4) for i, c in zip(ids, chained, strict=True)]
    )
    for k, slot in got.items():
        arena.block_view(slot)[:] = payload(k[-1])
    pool.commit("save:1", got)
    pool.release("save:1")


def test_a_block_evicted_from_memory_is_on_disk_and_a_lookup_brings_it_back(node: PoolNode) -> None:
    node.open(GEOMETRY)
    pool, arena, disk = node.pool, node.arena, node.disk
    assert pool is not None and arena is not None and disk is not None
    store(node, 1, 2, 3, 4)
    store(node, 11)  # evicts the chain's tail, 4: its bytes go to disk before the slot is reused
    assert key(4) not in pool and key(4) in disk
    assert set(disk.keys()) == {key(4)}  # spilled on eviction only
    chain = [key(1), key(2), key(3), key(4)]
    assert pool.lookup(chain) == 3
    assert node.promote(chain) == 1  # 4 alone: 1 to 3 are still in memory
    assert pool.lookup(chain) == 4
    slot = pool.slot_of(key(4))
    assert slot is not None and bytes(arena.block_view(slot)) == bytes(payload(4))
    assert arena.layers_ready(slot) == GEOMETRY.num_layers
    assert pool.owners() == []  # the promoter's references are gone: the block is the LRU's


def test_a_corrupt_file_stops_the_promotion_there_and_the_rest_is_computed(node: PoolNode) -> None:
    node.open(GEOMETRY)
    pool, disk = node.pool, node.disk
    assert pool is not None and disk is not None
    store(node, 1, 2, 3, 4)
    store(node, 11, 12, 13)  # 4, 3 and 2 go to disk (a chain leaves from its tail)
    path = disk.directory / (key(3).hex() + SUFFIX)
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    chain = [key(1), key(2), key(3), key(4)]
    assert node.promote(chain) == 1  # 2; 3 is corrupt, and 4 is no use without it
    assert pool.lookup(chain) == 2
    assert pool.stats().pending == 0  # the slots reserved for 3 and 4 are dropped, never served
    assert key(3) not in disk and key(4) in disk


def test_a_graceful_stop_keeps_memory_on_disk_for_the_next_agent(tmp_path: Path) -> None:
    config = DiskConfig(tmp_path / "disk", 1 << 20)
    first = PoolNode(f"vllm-disagg-test-{uuid.uuid4().hex}", Capacity.parse("4 blocks"), disk=config)
    first.open(GEOMETRY)
    store(first, 1, 2)
    first.close()
    second = PoolNode(f"vllm-disagg-test-{uuid.uuid4().hex}", Capacity.parse("4 blocks"), disk=config)
    try:
        second.open(GEOMETRY)
        assert second.pool is not None and second.pool.lookup([key(1), key(2)]) == 0
        assert second.promote([key(1), key(2)]) == 2
        assert second.pool.lookup([key(1), key(2)]) == 2
    finally:
        second.close()


def test_the_tier_keeps_its_directories_to_this_user(tmp_path: Path) -> None:
    loose = tmp_path / "pools"
    loose.mkdir(mode=0o755)
    tier = DiskTier.open(loose, GEOMETRY, 1 << 20)
    spill(tier, 1)
    assert loose.stat().st_mode & 0o777 == 0o700  # the blocks are prompts' KV
    assert tier.directory.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in tier.directory.iterdir())


def test_a_directory_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symbolic link"):
        DiskTier.open(tmp_path / "link", GEOMETRY, 1 << 20)
