"""The pool's shared-memory arena, the pool's size as configured, and the engine's KV geometry."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from vllm_disagg.agent.kv.arena import FAILED, Capacity, Geometry, SlotArena
from vllm_disagg.errors import ConfigError

GEOMETRY = Geometry(num_layers=3, layer_block_bytes=1000, block_size=16)  # 3000 bytes: a slot of 4096
PAGE = 4096


@pytest.fixture
def arena() -> Iterator[SlotArena]:
    created = SlotArena.create(f"vllm-disagg-test-{uuid.uuid4().hex}", GEOMETRY, 5)
    yield created
    created.close()


def test_a_second_arena_on_the_same_file_sees_the_bytes_and_header_words_of_the_first(
    arena: SlotArena,
) -> None:
    other = SlotArena.attach(arena.path, GEOMETRY, 5)
    try:
        arena.layer_view(3, 1)[:4] = b"kv!!"
        arena.set_layers_ready(3, 2)
        other.set_layers_ready(4, FAILED)
        other.block_view(0)[-3:] = b"end"
        assert bytes(other.layer_view(3, 1)[:4]) == b"kv!!"
        assert other.layers_ready(3) == 2
        assert arena.layers_ready(4) == FAILED
        assert bytes(arena.layer_view(0, 2)[-3:]) == b"end"  # a block is its layers, layer-major
        assert [arena.layers_ready(s) for s in (0, 1, 2)] == [0, 0, 0]  # a new arena's slots are empty
    finally:
        other.close()
    assert arena.path.exists()  # only the owner removes the file


@pytest.mark.parametrize(
    ("geometry", "capacity"),
    [
        pytest.param(GEOMETRY, 6, id="another slot count"),
        pytest.param(Geometry(3, 5000, 16), 5, id="bigger blocks"),
        pytest.param(Geometry(1, 3000, 16), 5, id="other layers with slots of the same size"),
        pytest.param(Geometry(3, 1000, 32), 5, id="another block size in tokens"),
        pytest.param(Geometry(3, 1001, 16), 5, id="other layer bytes with slots of the same size"),
    ],
)
def test_attaching_with_another_geometry_or_capacity_is_refused(
    arena: SlotArena, geometry: Geometry, capacity: int
) -> None:
    with pytest.raises(ValueError, match=str(arena.path)):
        SlotArena.attach(arena.path, geometry, capacity)


def test_closing_the_owner_removes_the_file_and_closing_an_attacher_does_not(arena: SlotArena) -> None:
    other = SlotArena.attach(arena.path, GEOMETRY, 5)
    other.close()
    assert arena.path.exists()
    arena.close()
    assert not arena.path.exists()


def test_the_owner_closes_even_while_a_view_is_still_held(arena: SlotArena) -> None:
    view = arena.block_view(1)
    arena.close()
    assert not arena.path.exists()
    view.release()


def test_creating_replaces_a_file_left_by_an_agent_that_died(arena: SlotArena) -> None:
    arena.set_layers_ready(0, 3)
    stale = arena.path.name
    again = SlotArena.create(stale, Geometry(2, 4096, 16), 2)  # without the owner closing first
    try:
        assert again.path == arena.path
        assert again.path.stat().st_size == again.size
        assert again.layers_ready(0) == 0
    finally:
        again.close()


def test_slots_are_page_aligned_and_hold_their_layers_back_to_back(arena: SlotArena) -> None:
    starts = [arena.offset(slot) for slot in range(arena.capacity)]
    assert all(start % PAGE == 0 for start in starts)
    assert arena.slot_bytes % PAGE == 0 and arena.slot_bytes >= GEOMETRY.block_bytes
    assert len(set(range(s, s + GEOMETRY.block_bytes) for s in starts)) == arena.capacity
    assert starts[-1] + arena.slot_bytes == arena.size
    layers = [arena.offset(2, layer) for layer in range(GEOMETRY.num_layers)]
    assert layers == [starts[2] + layer * GEOMETRY.layer_block_bytes for layer in range(GEOMETRY.num_layers)]
    assert len(arena.block_view(2)) == GEOMETRY.block_bytes
    assert len(arena.layer_view(2, 1)) == GEOMETRY.layer_block_bytes


@pytest.mark.parametrize(
    ("slot", "layer"),
    [
        pytest.param(5, 0, id="a slot past the last"),
        pytest.param(-1, 0, id="a negative slot"),
        pytest.param(0, 3, id="a layer past the last"),
        pytest.param(0, -1, id="a negative layer"),
    ],
)
def test_a_slot_or_layer_outside_the_arena_is_an_index_error(arena: SlotArena, slot: int, layer: int) -> None:
    with pytest.raises(IndexError):
        arena.layer_view(slot, layer)


@pytest.mark.parametrize("slot", [5, -1])
def test_a_header_word_outside_the_arena_is_an_index_error(arena: SlotArena, slot: int) -> None:
    with pytest.raises(IndexError):
        arena.set_layers_ready(slot, 1)
    with pytest.raises(IndexError):
        arena.layers_ready(slot)
    assert bytes(arena.block_view(arena.capacity - 1)) == bytes(GEOMETRY.block_bytes)  # nothing written


# --- capacity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("4096", Capacity(4096, "blocks"), id="a bare number is blocks"),
        pytest.param("4096 blocks", Capacity(4096, "blocks"), id="blocks"),
        pytest.param("1 block", Capacity(1, "blocks"), id="one block"),
        pytest.param("512MiB", Capacity(512 * 2**20, "bytes"), id="mebibytes"),
        pytest.param("2GiB", Capacity(2 * 2**30, "bytes"), id="gibibytes"),
        pytest.param("1GB", Capacity(10**9, "bytes"), id="decimal gigabytes"),
        pytest.param(" 64 kib ", Capacity(64 * 2**10, "bytes"), id="spaces and any case"),
        pytest.param("1.5TiB", Capacity(1.5 * 2**40, "bytes"), id="a fraction"),
        pytest.param("8192B", Capacity(8192, "bytes"), id="bytes"),
        pytest.param("10%", Capacity(0.1, "share"), id="a share of the host's memory"),
        pytest.param("90 %", Capacity(0.9, "share"), id="the largest share"),
    ],
)
def test_capacity_is_parsed_from_blocks_bytes_or_a_share(text: str, expected: Capacity) -> None:
    assert Capacity.parse(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("lots", id="no number"),
        pytest.param("-4", id="negative"),
        pytest.param("1e9", id="exponent"),
        pytest.param("10 parsecs", id="an unknown unit"),
        pytest.param("0%", id="no share"),
        pytest.param("91%", id="a share that leaves the host too little"),
    ],
)
def test_a_capacity_that_is_not_blocks_bytes_or_a_share_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="kv pool capacity"):
        Capacity.parse(text)


def test_capacity_in_blocks_is_that_many_blocks() -> None:
    assert Capacity.parse("4096").blocks(GEOMETRY, memory_bytes=1) == 4096


def test_capacity_in_bytes_counts_whole_page_aligned_slots() -> None:
    slot = -(-GEOMETRY.block_bytes // PAGE) * PAGE
    assert Capacity.parse("1MiB").blocks(GEOMETRY) == 2**20 // slot
    assert Capacity.parse(f"{slot * 3 - 1}B").blocks(GEOMETRY) == 2  # a partial slot is not a block


def test_capacity_as_a_share_is_of_the_memory_given() -> None:
    memory = 64 * 2**30
    slot = -(-GEOMETRY.block_bytes // PAGE) * PAGE
    assert Capacity.parse("10%").blocks(GEOMETRY, memory_bytes=memory) == int(memory * 0.1 // slot)
    assert Capacity.parse("20%").blocks(GEOMETRY, memory_bytes=memory) > Capacity.parse("10%").blocks(
        GEOMETRY, memory_bytes=memory
    )


@pytest.mark.parametrize(
    ("text", "memory"),
    [
        pytest.param("0", None, id="zero blocks"),
        pytest.param("4095B", None, id="fewer bytes than one slot"),
        pytest.param("10%", 4096, id="a share of too little memory"),
    ],
)
def test_a_capacity_that_holds_no_block_is_a_config_error(text: str, memory: int | None) -> None:
    with pytest.raises(ConfigError, match="holds no block"):
        Capacity.parse(text).blocks(GEOMETRY, memory_bytes=memory)


# --- geometry ------------------------------------------------------------------------------------------


def test_a_geometry_round_trips_through_the_wire() -> None:
    assert Geometry.from_wire(GEOMETRY.to_wire()) == GEOMETRY
    assert GEOMETRY.block_bytes == GEOMETRY.num_layers * GEOMETRY.layer_block_bytes


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param([3, 1000, 16], id="not a map"),
        pytest.param({"num_layers": 3, "layer_block_bytes": 1000}, id="a field missing"),
        pytest.param({"num_layers": "three", "layer_block_bytes": 1000, "block_size": 16}, id="not a number"),
        pytest.param({"num_layers": 0, "layer_block_bytes": 1000, "block_size": 16}, id="no layers"),
    ],
)
def test_a_bad_geometry_from_the_wire_is_a_value_error(raw: object) -> None:
    with pytest.raises(ValueError, match="geometry"):
        Geometry.from_wire(raw)
