"""The agent's mirror of its engine's blocks: a snapshot rebuilds the orchestrator's index exactly.

The reference is the orchestrator's own ``KvIndex`` fed every event as it happened: a snapshot of the
mirror applied to an empty (or stale) index must give the same entries, whatever the events were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.agent.kv_forwarder import _items
from vllm_disagg.agent.kv_mirror import BLOCK_BYTES, KvMirror
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.protocol.messages import KvEvent

A = "agent-a"
BS = 4
TOKENS = list(range(300, 340))  # ten blocks of 4


def stored(first: int, count: int, parent: int | None = None, size: int = BS) -> KvEvent:
    """Blocks hashed ``first``, ``first + 1``, ... over TOKENS from block ``first - 1``."""
    start = (first - 1) * size
    return KvEvent(
        "stored", list(range(first, first + count)), parent, TOKENS[start : start + count * size], size
    )


def removed(*hashes: int) -> KvEvent:
    return KvEvent("removed", list(hashes))


CLEARED = KvEvent("cleared")


def live(events: list[KvEvent]) -> KvIndex:
    index = KvIndex()
    index.apply(A, events)
    return index


def resynced(mirror: KvMirror, *, max_items: int = 50_000, stale: list[KvEvent] | None = None) -> KvIndex:
    """An index (holding ``stale`` entries first) after applying the mirror's snapshot."""
    index = live(stale or [])
    index.apply(A, mirror.snapshot(max_items))
    return index


def mirrored(events: list[KvEvent], **kwargs: int) -> KvMirror:
    mirror = KvMirror(**kwargs)
    mirror.apply(events)
    return mirror


CASES = [
    pytest.param([stored(1, 3)], 3, 0, id="a chain of blocks is kept"),
    pytest.param([stored(1, 2), stored(3, 1, parent=2)], 3, 0, id="a block chained to a held parent is kept"),
    pytest.param([stored(3, 1, parent=99)], 0, 0, id="a block whose parent is not held is not"),
    pytest.param([stored(1, 2), removed(2)], 1, 0, id="a removed leaf goes"),
    pytest.param([stored(1, 3), removed(1)], 2, 1, id="a removed parent of cached blocks stays as a ghost"),
    pytest.param(
        [stored(1, 3), removed(1), removed(3), removed(2)], 0, 0, id="a ghost goes with its last child"
    ),
    pytest.param([stored(1, 3), removed(2), stored(2, 1, parent=1)], 3, 0, id="a ghost stored again is held"),
    pytest.param(
        [stored(1, 2), removed(1), stored(4, 1, parent=1)], 1, 1, id="a ghost is no parent for new blocks"
    ),
    pytest.param([stored(1, 3), CLEARED], 0, 0, id="cleared empties it"),
    pytest.param([stored(1, 2), stored(1, 1, size=8)], 1, 0, id="another block size is a new engine"),
    pytest.param(
        [KvEvent("stored", [1, 2], None, TOKENS[:6], BS)], 1, 0, id="a short block ends its event there"
    ),
    pytest.param([KvEvent("stored", [1], None, TOKENS[:4], 0)], 0, 0, id="a block size of 0 is ignored"),
    pytest.param([stored(1, 2), removed(77)], 2, 0, id="removing an unknown block changes nothing"),
]


@pytest.mark.parametrize(("events", "held", "ghosts"), CASES)
def test_the_mirror_keeps_what_the_index_keeps_and_a_snapshot_rebuilds_it(
    events: list[KvEvent], held: int, ghosts: int
) -> None:
    mirror = mirrored(events)
    assert (len(mirror), mirror.ghosts) == (held, ghosts)
    expected = live(events)
    stale = [stored(5, 2), removed(5)]  # what an older session left: a resync replaces it
    for rebuilt in (resynced(mirror), resynced(mirror, stale=stale), resynced(mirror, max_items=6)):
        assert rebuilt.engine_blocks(A) == expected.engine_blocks(A)
        assert rebuilt.total_blocks() == expected.total_blocks() == held


def test_a_snapshot_stores_a_ghost_to_chain_its_children_and_then_removes_it() -> None:
    mirror = mirrored([stored(1, 3), removed(1)])
    assert mirror.snapshot(50_000) == [
        CLEARED,
        KvEvent("stored", [1, 2, 3], None, TOKENS[:12], BS),
        removed(1),
    ]
    # Storing the ghost again makes its children reachable again, as in the engine.
    mirror.apply([stored(1, 1)])
    assert resynced(mirror).cached_tokens(TOKENS) == {A: 12}


def test_a_snapshot_puts_parents_first_even_when_a_parent_was_stored_again_after_its_child() -> None:
    mirror = mirrored([stored(1, 1), stored(2, 1, parent=1), removed(1), stored(1, 1)])
    events = mirror.snapshot(50_000)
    assert [(e.kind, e.block_hashes, e.parent_block_hash) for e in events] == [
        ("cleared", [], None),
        ("stored", [1, 2], None),
    ]


def test_a_chain_of_ghosts_thousands_long_is_kept_and_then_collected_without_recursion() -> None:
    n = 5000
    tokens = [t % 251 for t in range(n * BS)]
    mirror = mirrored([KvEvent("stored", list(range(1, n + 1)), None, tokens, BS)])
    mirror.apply([removed(*range(1, n))])  # all but the last: it still needs the whole chain
    assert (len(mirror), mirror.ghosts) == (1, n - 1)
    assert resynced(mirror).engine_blocks(A).keys() == {n}
    mirror.apply([removed(n)])
    assert (len(mirror), mirror.ghosts, mirror.tokens) == (0, 0, 0)


@pytest.mark.parametrize("max_items", [6, 11, 16, 100])
def test_no_snapshot_event_holds_more_items_than_the_limit(max_items: int) -> None:
    mirror = mirrored([stored(1, 10), removed(1, 2, 3, 4)])  # four ghosts
    events = mirror.snapshot(max_items)
    assert all(_items(e) <= max_items for e in events)
    assert resynced(mirror, max_items=max_items).engine_blocks(A) == live(
        [stored(1, 10), removed(1, 2, 3, 4)]
    ).engine_blocks(A)


def test_a_full_mirror_skips_new_blocks_and_counts_them_so_a_rebuilt_index_only_misses_blocks() -> None:
    events = [stored(1, 2), stored(3, 2, parent=2), stored(5, 1)]
    per_block = BLOCK_BYTES + 2 * BS  # TOKENS fit 2-byte ids
    mirror = mirrored(events, max_bytes=3 * per_block)
    assert (len(mirror), mirror.skipped, mirror.size_bytes) == (3, 2, 3 * per_block)  # 1-3 kept; 4, 5 not
    rebuilt = resynced(mirror).engine_blocks(A)
    assert rebuilt.items() < live(events).engine_blocks(A).items()
    assert set(rebuilt) == {1, 2, 3}
    mirror.apply([removed(3)])  # room again
    mirror.apply([stored(5, 1)])
    assert 5 in resynced(mirror).engine_blocks(A)


@pytest.mark.parametrize(
    ("tokens", "bytes_per_token"),
    [
        pytest.param([[1, 2, 3, 255], [0, 1, 2, 3]], 1, id="byte ids take a byte"),
        pytest.param([[1, 2, 3, 255], [70_000, 0, 5, 9]], 4, id="a wider id widens what follows"),
        pytest.param([[2**40, 0, 0, 0], [1, 2, 3, 4]], 8, id="a 64-bit id is kept whole"),
    ],
)
def test_token_ids_are_stored_in_the_narrowest_width_and_come_back_unchanged(
    tokens: list[list[int]], bytes_per_token: int
) -> None:
    events = [KvEvent("stored", [1], None, tokens[0], BS), KvEvent("stored", [2], 1, tokens[1], BS)]
    mirror = mirrored(events)
    assert mirror.size_bytes - 2 * BLOCK_BYTES <= 2 * BS * bytes_per_token
    assert resynced(mirror).engine_blocks(A) == live(events).engine_blocks(A)
    assert mirror.snapshot(50_000)[1].token_ids == tokens[0] + tokens[1]


# --- the property: any sequence of engine events ------------------------------------------------

UNKNOWN = 12345  # a parent whose event the agent never saw


@dataclass
class Engine:
    """A model of an engine's prefix cache: content-addressed blocks, as vLLM hashes them."""

    held: set[int] = field(default_factory=set)
    size: int = BS
    prompts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # hash -> tokens up to its end
    parents: dict[int, int | None] = field(default_factory=dict)

    def block_hash(self, parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens), self.size)) & (2**64 - 1)


Op = tuple[str, int, list[list[int]]]
# (what, parent or eviction seed, blocks): a chain of 1-4 blocks (tokens from a tiny alphabet, so
# prefixes repeat) under no parent (-1), a parent the agent never saw (-2), one stored at some time
# (-3) or the n-th held block;
# or evicting held blocks, leaves or not (vLLM evicts by LRU, not by position in a chain); or the
# cache cleared; or the engine publishing 8-token blocks (or back), which starts the instance afresh.
ops = st.lists(
    st.tuples(
        st.sampled_from(["store"] * 12 + ["remove"] * 6 + ["clear", "resize"]),
        st.sampled_from([-1, -2, -3]) | st.integers(min_value=0, max_value=30),
        st.lists(st.lists(st.integers(0, 2), min_size=BS, max_size=BS), min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=60,
)


def engine_events(program: list[Op]) -> tuple[list[KvEvent], Engine]:
    """What an engine following ``program`` publishes, and what it holds at the end."""
    engine = Engine()
    events: list[KvEvent] = []
    for op, arg, blocks in program:
        order = sorted(engine.held)
        if op == "store":
            if arg == -1 or not order:
                parent = None
            elif arg == -2:
                parent = UNKNOWN
            elif arg == -3:  # an evicted one (its re-store was missed), best one with cached children
                evicted = set(engine.prompts) - engine.held
                needed = sorted({p for h in engine.held if (p := engine.parents[h]) is not None} & evicted)
                choice = needed or sorted(evicted) or order
                parent = choice[len(events) % len(choice)]
            else:
                parent = order[arg % len(order)]
            hashes: list[int] = []
            tokens: list[int] = []
            chain = parent
            prompt = engine.prompts.get(parent, ()) if parent is not None else ()
            for drawn in blocks:
                # A block holds ``engine.size`` tokens and its hash covers them all: one hash, one
                # content (after a resize, the drawn 4 tokens are repeated to fill an 8-token block).
                block = drawn * (engine.size // BS)
                chain = engine.block_hash(chain, block)
                hashes.append(chain)
                tokens += block
                prompt += tuple(block)
                engine.prompts[chain] = prompt
                engine.parents[chain] = hashes[-2] if len(hashes) > 1 else parent
            engine.held.update(hashes)
            events.append(KvEvent("stored", hashes, parent, tokens, engine.size))
        elif op == "remove" and order:
            gone = sorted({order[(arg + 7 * i) % len(order)] for i in range(len(blocks))})
            engine.held.difference_update(gone)
            events.append(KvEvent("removed", gone))
        elif op == "clear":
            engine.held.clear()
            events.append(CLEARED)
        elif op == "resize":
            engine.size = 8 if engine.size == BS else BS
    return events, engine


@settings(max_examples=400, deadline=None)
@given(program=ops, max_items=st.integers(min_value=1, max_value=40))
def test_any_event_sequence_resynced_into_an_empty_index_equals_the_live_index_and_the_engine(
    program: list[Op], max_items: int
) -> None:
    events, engine = engine_events(program)
    mirror = mirrored(events)
    expected = live(events)
    snapshot = mirror.snapshot(max_items)
    assert all(_items(e) <= max_items or len(e.block_hashes) == 1 for e in snapshot)  # a block is whole
    rebuilt = resynced(mirror, max_items=max_items)
    assert rebuilt.engine_blocks(A) == expected.engine_blocks(A)
    assert rebuilt.total_blocks() == expected.total_blocks()
    for prompt in engine.prompts.values():  # and every prompt scores the same
        assert rebuilt.cached_tokens(prompt) == expected.cached_tokens(prompt)
    assert set(rebuilt.engine_blocks(A)) <= engine.held  # never a block the engine does not hold
    assert len(mirror) == expected.blocks_of(A)
