"""The agent's pool node: pool and arena open at the engine's geometry, and reopen empty at another."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from vllm_disagg.agent.kv.arena import Capacity, Geometry
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool

GEOMETRY = Geometry(num_layers=2, layer_block_bytes=4096, block_size=16)
OTHER = Geometry(num_layers=4, layer_block_bytes=4096, block_size=16)
MEMORY = 2**20  # what the node is told the host has: the tests never depend on this host's memory

Heard = list[tuple[list[BlockKey], list[BlockKey]]]


@pytest.fixture
def node() -> Iterator[PoolNode]:
    opened = PoolNode(f"vllm-disagg-test-{uuid.uuid4().hex}", Capacity.parse("10%"), memory_bytes=MEMORY)
    yield opened
    opened.close()


@pytest.fixture
def heard(node: PoolNode) -> Heard:
    calls: Heard = []
    node.listeners.append(lambda stored, removed: calls.append((stored, removed)))
    return calls


def pool_of(node: PoolNode) -> PrefixPool:
    assert node.pool is not None
    return node.pool


def store(node: PoolNode, *keys: BlockKey) -> None:
    pool = pool_of(node)
    got = pool.reserve("save:1", [(key, None, (i,)) for i, key in enumerate(keys)])
    pool.commit("save:1", got)
    pool.release("save:1")
    node.changed()


def test_a_node_has_no_pool_until_the_engine_says_its_geometry(node: PoolNode) -> None:
    assert (node.pool, node.arena, node.geometry) == (None, None, None)


def test_opening_sizes_the_pool_and_the_arena_by_the_capacity_at_that_geometry(node: PoolNode) -> None:
    arena = node.open(GEOMETRY)
    blocks = node.capacity.blocks(GEOMETRY, MEMORY)
    assert pool_of(node).capacity == arena.capacity == blocks
    assert blocks < node.capacity.blocks(Geometry(1, 4096, 16), MEMORY)  # sized by the geometry
    assert node.geometry == GEOMETRY
    assert arena.path.exists()
    assert arena.path.name.startswith(node.name)


def test_opening_again_at_the_same_geometry_keeps_the_arena_and_the_blocks(
    node: PoolNode, heard: Heard
) -> None:
    arena = node.open(GEOMETRY)
    pool = pool_of(node)
    store(node, b"a0", b"a1")
    assert node.open(GEOMETRY) is arena
    assert node.pool is pool
    assert pool.lookup([b"a0", b"a1"]) == 2
    assert heard == [([b"a0", b"a1"], [])]


def test_another_geometry_empties_the_pool_and_the_listeners_hear_every_block_removed(
    node: PoolNode, heard: Heard
) -> None:
    old = node.open(GEOMETRY)
    store(node, b"a0", b"a1")
    new = node.open(OTHER)
    assert new is not old
    assert new.geometry == OTHER == node.geometry
    assert heard[-1] == ([], [b"a0", b"a1"])
    assert len(pool_of(node)) == 0
    assert pool_of(node).capacity == node.capacity.blocks(OTHER, MEMORY)
    assert new.path.exists()
    with pytest.raises(ValueError):  # the old arena is closed: its bytes are gone
        old.layers_ready(0)


def test_closing_removes_the_shared_memory_file_and_tells_the_listeners(node: PoolNode, heard: Heard) -> None:
    arena = node.open(GEOMETRY)
    store(node, b"a0")
    node.close()
    assert not arena.path.exists()
    assert (node.pool, node.arena) == (None, None)
    assert heard == [([b"a0"], []), ([], [b"a0"])]
    node.changed()
    assert len(heard) == 2  # nothing open: nothing to tell


def test_listeners_hear_what_changed_since_the_last_call_and_nothing_when_nothing_did(
    node: PoolNode, heard: Heard
) -> None:
    node.open(GEOMETRY)
    store(node, b"a0")
    node.changed()
    pool = pool_of(node)
    pool.reserve("xfer:1", [(b"b0", None, (0,))])
    node.changed()  # a pending block is not stored yet
    pool.release("xfer:1")  # the transfer died: the listeners hear its block removed, never stored
    node.changed()
    assert heard == [([b"a0"], []), ([], [b"b0"])]
