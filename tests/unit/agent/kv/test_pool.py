"""The node's prefix pool: who holds a block keeps it, the rest go least recently used first, tail first."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool

Block = tuple[BlockKey, BlockKey | None, tuple[int, ...]]  # what ``reserve`` takes: key, parent, tokens


def chain(name: str, n: int) -> list[BlockKey]:
    return [f"{name}{i}".encode() for i in range(n)]


def blocks(keys: list[BlockKey]) -> list[Block]:
    return [(key, keys[i - 1] if i else None, (i,)) for i, key in enumerate(keys)]


def save(pool: PrefixPool, owner: str, keys: list[BlockKey]) -> dict[BlockKey, int]:
    """What the engine's save does: reserve, write, commit, let go."""
    got = pool.reserve(owner, blocks(keys))
    pool.commit(owner, got)
    pool.release(owner)
    return got


# --- specifications --------------------------------------------------------------------------------


def test_a_request_waiting_in_the_queue_keeps_its_prefix_under_eviction_pressure() -> None:
    pool = PrefixPool(4)
    prefix = chain("a", 2)
    save(pool, "save:1", prefix)
    assert pool.pin("req:1", prefix).keys == tuple(prefix)
    got = save(pool, "save:2", chain("b", 5))  # wants every slot
    assert list(got) == chain("b", 2)  # stops at the first block with no slot to free
    assert pool.lookup(prefix) == 2
    assert pool.references(prefix[0]) == 1


def test_releasing_an_aborted_request_frees_its_prefix_for_eviction() -> None:
    pool = PrefixPool(2)
    prefix = chain("a", 2)
    save(pool, "save:1", prefix)
    pool.pin("req:1", prefix)
    pool.release("req:1")  # the request was aborted while waiting
    assert [pool.references(k) for k in prefix] == [0, 0]
    assert len(save(pool, "save:2", chain("b", 2))) == 2
    assert pool.lookup(prefix) == 0
    assert pool.take_removed() == prefix[::-1]  # the tail went first


def test_a_chain_released_together_is_evicted_from_its_tail() -> None:
    pool = PrefixPool(3)
    prefix = chain("a", 3)
    save(pool, "save:1", prefix)
    for evicted in range(1, 4):
        save(pool, f"save:x{evicted}", [f"x{evicted}".encode()])
        assert pool.lookup(prefix) == 3 - evicted  # what is left is still a usable prefix


def test_a_request_whose_prefix_was_evicted_before_it_pinned_gets_the_shorter_prefix() -> None:
    pool = PrefixPool(3)
    prefix = chain("a", 3)
    save(pool, "save:1", prefix)
    save(pool, "save:2", [b"x"])  # evicts the chain's tail
    assert pool.lookup(prefix) == 2
    pinned = pool.pin("req:1", prefix)
    assert pinned.keys == tuple(prefix[:2])  # the engine recomputes the third block
    assert pinned.slots == tuple(pool.slot_of(k) for k in prefix[:2])
    assert pool.stats().misses == 1
    pool.release("req:1")
    assert [pool.references(k) for k in prefix] == [0, 0, 0]  # nothing dangles


def test_reserving_the_rest_of_a_held_prefix_does_not_evict_the_prefix() -> None:
    pool = PrefixPool(3)
    prompt = chain("a", 4)
    save(pool, "save:1", prompt[:2])
    save(pool, "save:2", [b"x"])
    got = pool.reserve("save:3", blocks(prompt))
    assert list(got) == [prompt[2]]  # x made room; the held prefix was skipped and kept
    assert pool.lookup(prompt) == 3
    assert pool.take_removed() == [b"x"]


def test_reserving_only_a_chain_s_new_block_keeps_the_chain_it_continues_from_eviction() -> None:
    # The engine sends a prompt's chain once, then only the blocks each step completes.
    pool = PrefixPool(3)
    prompt = chain("a", 3)
    save(pool, "save:1", prompt[:2])
    save(pool, "save:2", [b"x"])  # newer than the chain: eviction would take the chain's tail first
    got = pool.reserve("save:3", blocks(prompt)[2:])
    assert list(got) == [prompt[2]]
    assert pool.take_removed() == [b"x"]  # not a1, which would have left a2 unreachable
    pool.commit("save:3", got)
    assert pool.lookup(prompt) == 3


def test_a_block_whose_parent_left_the_pool_is_an_orphan_and_is_not_reserved() -> None:
    pool = PrefixPool(2)
    prompt = chain("a", 3)
    save(pool, "save:1", prompt[:2])
    save(pool, "save:2", chain("x", 2))  # the chain is gone
    got, orphans = pool.reserve_chain("save:3", blocks(prompt)[2:])
    assert got == {} and orphans == [prompt[2]]  # no lookup could reach it: not written
    got, orphans = pool.reserve_chain("save:3", blocks(prompt)[:2])  # the chain again, from its head
    assert list(got) == prompt[:2] and orphans == []


def test_a_pending_block_whose_writer_aborts_is_dropped_and_its_reader_sees_it_gone() -> None:
    pool = PrefixPool(2)
    key = b"a0"
    slot = pool.reserve("xfer:1", blocks([key]))[key]
    pinned = pool.pin("req:1", [key])
    assert pinned.ready == (False,)  # a transfer in flight: wait per layer
    assert pool.lookup([key], pending_ok=False) == 0
    assert pool.release("xfer:1") == [key]
    assert (pool.state_of(key), pool.references(key)) == (None, 0)
    assert (pool.take_stored(), pool.take_removed()) == ([], [key])
    # The reader still waits on that slot's header word: no other block may land there meanwhile.
    assert pool.reserve("xfer:2", blocks([key, b"a1"])) == {key: 1 - slot}
    pool.release("xfer:2")
    assert pool.release("req:1") == []
    assert pool.reserve("save:1", blocks([b"b0", b"b1"])) == {b"b0": slot, b"b1": 1 - slot}


def test_a_block_committed_by_another_owner_stays_pending() -> None:
    pool = PrefixPool(2)
    pool.reserve("save:1", blocks([b"a0"]))
    assert pool.commit("save:2", [b"a0"]) == []
    assert pool.state_of(b"a0") == "pending"
    assert pool.commit("save:1", [b"a0", b"a0"]) == [b"a0"]
    assert pool.take_stored() == [b"a0"]


def test_each_pin_is_undone_by_the_one_release() -> None:
    pool = PrefixPool(2)
    save(pool, "save:1", chain("a", 2))
    pool.pin("req:1", chain("a", 2))
    pool.pin("req:1", chain("a", 1))
    assert pool.references(b"a0") == 2
    pool.release("req:1")
    assert (pool.references(b"a0"), pool.references(b"a1")) == (0, 0)
    assert "req:1" not in pool.owners()


def test_an_agent_restart_forgets_every_block_and_reference() -> None:
    pool = PrefixPool(3)
    save(pool, "save:1", chain("a", 2))
    pool.pin("req:1", chain("a", 2))
    pool.reserve("save:2", blocks([b"b0"]))
    pool.take_removed()
    assert sorted(pool.clear()) == [b"a0", b"a1", b"b0"]
    assert (len(pool), pool.owners(), pool.references(b"a0")) == (0, [], 0)
    assert sorted(pool.take_removed()) == [b"a0", b"a1", b"b0"]
    assert pool.take_stored() == []
    assert sorted(save(pool, "save:3", chain("c", 3)).values()) == [0, 1, 2]


def test_a_pool_needs_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        PrefixPool(0)


# --- any interleaving, against a model ---------------------------------------------------------------

OWNERS = ("req:1", "req:2", "save:1", "save:2", "xfer:1")
WRITERS = ("save:1", "save:2", "xfer:1")
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=8)  # prompts share prefixes often


def prompt_blocks(prompt: list[int]) -> list[Block]:
    keys = [b"k" + bytes(prompt[: i + 1]) for i in range(len(prompt))]
    return [(key, keys[i - 1] if i else None, tuple(prompt[: i + 1])) for i, key in enumerate(keys)]


@dataclass
class Held:
    slot: int
    state: str
    writer: str
    parent: BlockKey | None
    tokens: tuple[int, ...]


class PoolMachine(RuleBasedStateMachine):
    """The pool next to a plain model: blocks, references by owner in first-reference order, an LRU list."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PrefixPool(1)
        self.blocks: dict[BlockKey, Held] = {}
        self.refs: dict[str, dict[BlockKey, int]] = {}
        self.lru: list[BlockKey] = []  # unreferenced ready blocks, oldest first
        self.orphans: dict[int, set[str]] = {}  # slot of an aborted pending block -> readers pinning it
        self.pinned: dict[str, dict[int, BlockKey]] = {}  # owner -> slots it was handed, and for what
        self.removed: list[BlockKey] = []
        self.committed: set[BlockKey] = set()  # since the last announcement
        self.mirror: set[BlockKey] = set()  # what a listener of stored/removed believes is held
        self.seen: set[BlockKey] = set()

    @initialize(capacity=st.integers(1, 6))
    def start(self, capacity: int) -> None:
        self.pool = PrefixPool(capacity)

    # --- the model ---
    def referenced(self, key: BlockKey) -> bool:
        return any(key in held for held in self.refs.values())

    def ref(self, owner: str, key: BlockKey) -> None:
        held = self.refs.setdefault(owner, {})
        held[key] = held.get(key, 0) + 1
        if key in self.lru:
            self.lru.remove(key)

    def forget(self, key: BlockKey) -> None:
        del self.blocks[key]
        if key in self.lru:
            self.lru.remove(key)
        for owner, held in list(self.refs.items()):
            held.pop(key, None)
            if not held:
                del self.refs[owner]
        self.removed.append(key)

    def model_reserve(self, owner: str, wanted: list[Block]) -> list[BlockKey]:
        kept = [k for k in dict.fromkeys(k for k, _, _ in wanted) if k in self.lru]
        lru = [k for k in self.lru if k not in kept]
        out: list[BlockKey] = []
        for key, parent, tokens in wanted:
            self.seen.add(key)
            if key in self.blocks:
                continue
            if len(self.blocks) + len(self.orphans) == self.pool.capacity:
                if not lru:
                    break
                self.forget(lru.pop(0))
            self.blocks[key] = Held(-1, "pending", owner, parent, tokens)
            self.ref(owner, key)
            out.append(key)
        self.lru = lru + kept[::-1]
        return out

    def model_release(self, owner: str) -> list[BlockKey]:
        self.pinned.pop(owner, None)
        for slot, readers in list(self.orphans.items()):
            readers.discard(owner)
            if not readers:
                del self.orphans[slot]
        dropped: list[BlockKey] = []
        for key in reversed(list(self.refs.pop(owner, {}))):
            held = self.blocks[key]
            if held.state == "pending" and held.writer == owner:
                readers = {o for o, h in self.refs.items() if key in h}
                self.forget(key)
                if readers:
                    self.orphans[held.slot] = readers
                dropped.append(key)
            elif held.state == "ready" and not self.referenced(key):
                self.lru.append(key)
        return dropped

    # --- steps, each checked against the model ---
    def do_reserve(self, owner: str, wanted: list[Block]) -> dict[BlockKey, int]:
        expected = self.model_reserve(owner, wanted)
        got = self.pool.reserve(owner, wanted)
        assert list(got) == expected
        for key, slot in got.items():
            self.blocks[key].slot = slot
        return got

    def do_commit(self, owner: str, keys: list[BlockKey]) -> None:
        expected = []
        for key in keys:
            held = self.blocks.get(key)
            if held is not None and held.state == "pending" and held.writer == owner:
                held.state, held.writer = "ready", ""
                expected.append(key)
                self.committed.add(key)
        assert self.pool.commit(owner, keys) == expected

    def do_release(self, owner: str) -> None:
        expected = self.model_release(owner)
        assert self.pool.release(owner) == expected
        assert all(self.pool.state_of(k) is None for k in expected)  # an aborted write is gone

    @rule(owner=st.sampled_from(WRITERS), prompt=prompts)
    def reserve(self, owner: str, prompt: list[int]) -> None:
        self.do_reserve(owner, prompt_blocks(prompt))

    @rule(owner=st.sampled_from(WRITERS), picks=st.lists(st.integers(0, 255), max_size=6))
    def commit(self, owner: str, picks: list[int]) -> None:
        keys = sorted(self.blocks)  # any block: others' pending and ready ones are left alone
        self.do_commit(owner, [keys[i % len(keys)] for i in picks] if keys else [])

    @rule(prompt=prompts)
    def insert(self, prompt: list[int]) -> None:
        got = self.do_reserve("save:once", prompt_blocks(prompt))
        self.do_commit("save:once", list(got))
        self.do_release("save:once")

    @rule(owner=st.sampled_from(OWNERS), prompt=prompts, pending_ok=st.booleans())
    def pin(self, owner: str, prompt: list[int], pending_ok: bool) -> None:
        keys = [k for k, _, _ in prompt_blocks(prompt)]
        self.seen.update(keys)
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            if self.blocks[keys[n]].state == "pending" and not pending_ok:
                break
            n += 1
        assert self.pool.lookup(keys, pending_ok=pending_ok) == n  # a shorter prefix is recomputed
        pinned = self.pool.pin(owner, keys, pending_ok=pending_ok)
        assert pinned.keys == tuple(keys[:n])
        assert pinned.slots == tuple(self.blocks[k].slot for k in keys[:n])
        assert pinned.ready == tuple(self.blocks[k].state == "ready" for k in keys[:n])
        for key in keys[:n]:
            self.ref(owner, key)
            self.pinned.setdefault(owner, {})[self.blocks[key].slot] = key

    @rule(owner=st.sampled_from(OWNERS), pick=st.integers(0, 255))
    def pin_in_flight(self, owner: str, pick: int) -> None:
        """A request finds its prefix still landing: it pins a chain whose last block is pending."""
        pending = sorted(k for k, held in self.blocks.items() if held.state == "pending")
        if pending:
            self.pin(owner, list(pending[pick % len(pending)][1:]), pending_ok=True)

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner: str) -> None:  # a request done or aborted, a writer done or dead
        self.do_release(owner)

    @rule(pick=st.integers(0, 255))
    def abort(self, pick: int) -> None:
        """A writer dies with blocks still pending."""
        writers = sorted({held.writer for held in self.blocks.values() if held.state == "pending"})
        if writers:
            self.do_release(writers[pick % len(writers)])

    @rule()
    def restart(self) -> None:
        assert self.pool.clear() == list(self.blocks)
        self.removed += list(self.blocks)
        self.blocks, self.refs, self.lru, self.orphans, self.pinned = {}, {}, [], {}, {}

    @rule()
    def announce(self) -> None:
        removed, stored = self.pool.take_removed(), self.pool.take_stored()
        assert removed == self.removed
        ready = {k for k, held in self.blocks.items() if held.state == "ready"}
        assert set(stored) == self.committed & ready  # never a block aborted, evicted or pending
        self.mirror = (self.mirror - set(removed)) | set(stored)
        assert self.mirror == ready  # removed then stored: a listener's view is exact
        self.removed, self.committed = [], set()

    @rule()
    def drain(self) -> None:
        """Every owner lets go: nothing stays referenced, and the whole capacity can be refilled."""
        for owner in sorted(set(self.pool.owners()) | set(self.refs)):
            self.do_release(owner)
        assert all(self.pool.references(k) == 0 for k in self.seen)
        assert self.pool.stats().pending == 0
        capacity = self.pool.capacity
        got = self.do_reserve("probe", blocks(chain("probe", capacity)))
        assert sorted(got.values()) == list(range(capacity))  # no slot leaked, none handed twice
        self.do_release("probe")
        assert len(self.pool) == 0

    @invariant()
    def agrees_with_the_model(self) -> None:
        pool = self.pool
        assert len(pool) == len(self.blocks) <= pool.capacity
        for key in self.seen:
            held = self.blocks.get(key)
            assert pool.state_of(key) == (None if held is None else held.state)
            assert pool.references(key) == sum(h.get(key, 0) for h in self.refs.values())
            if held is not None:  # a block's slot never moves while it is held: no reuse under a pin
                assert pool.slot_of(key) == held.slot
                assert pool.info(key) == (held.parent, held.tokens)
        slots = [held.slot for held in self.blocks.values()]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < pool.capacity for s in slots)
        assert not set(slots) & set(self.orphans)
        by_slot = {held.slot: key for key, held in self.blocks.items()}
        for owner, handed in self.pinned.items():  # no slot a pinner holds goes to another block
            for slot, key in handed.items():
                assert by_slot.get(slot, key) == key
                assert slot in by_slot or owner in self.orphans[slot]
        stats, pending = pool.stats(), sum(held.state == "pending" for held in self.blocks.values())
        referenced = sum(self.referenced(k) for k in self.blocks)
        assert (stats.used, stats.pending, stats.referenced) == (len(self.blocks), pending, referenced)
        assert set(self.refs) <= set(pool.owners())
        assert all(k in self.blocks for held in self.refs.values() for k in held)  # no use after evict
        free = {k for k, h in self.blocks.items() if h.state == "ready" and not self.referenced(k)}
        assert set(self.lru) == free  # every unreferenced ready block is evictable


def test_any_interleaving_of_saves_pins_releases_aborts_and_restarts_agrees_with_the_model() -> None:
    run_state_machine_as_test(
        PoolMachine, settings=settings(max_examples=200, stateful_step_count=50, deadline=None)
    )


def test_only_the_writer_of_a_pending_block_says_its_token_ids() -> None:
    """A fetch reserves blocks before the holder says their tokens; once ready, a block is what it is."""
    pool = PrefixPool(2)
    key = b"\x01" * 32
    pool.reserve("xfer:1", [(key, None, ())])
    assert not pool.describe("xfer:2", key, [5, 6])
    assert pool.describe("xfer:1", key, [5, 6])
    assert pool.info(key) == (None, (5, 6))
    pool.commit("xfer:1", [key])
    assert not pool.describe("xfer:1", key, [7, 8])
    assert pool.info(key) == (None, (5, 6))
