"""The node's prefix pool: which KV blocks it holds, in which slot, and who still needs each one.

A pure data structure (no I/O, no clock): the bytes live in a ``SlotArena`` (``arena.py``) at the slot
this pool hands out, and the agent is the pool's one owner. Blocks are keyed by vLLM's chained block
hash (``wire/block_hash.py``), so a key names a whole prefix: a prompt's blocks are useful only from
its first one on, and ``lookup`` counts the leading keys held.

References. A block may be freed only when no one needs it, and "needs" includes more than a running
sequence (the seed PR's leak was a waiting request whose prefix had been freed under it). Every
reference has an *owner*, a string the caller chooses: a request waiting to load (``req:ID``), a
worker filling slots (``save:ID``), an outgoing or incoming transfer (``xfer:ID``). ``release(owner)``
drops all of an owner's references at once, so an aborted request or a dead transfer cannot leave one
behind. A block is *pending* while its owner writes it (``reserve``); ``commit`` makes it *ready*.
A pending block whose owner is released without committing is dropped: nothing half-written is ever
served, and its slot is not reused until the readers that pinned it while pending let go.

Eviction is LRU among blocks with no reference, and only when a slot is needed: the pool never holds
more blocks than ``capacity``. A block re-enters the LRU when its last reference goes, an owner's
blocks last to first, so a prefix's first block is its most recently used and a chain is evicted from
its tail, which keeps what is left a usable (shorter) prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from vllm_disagg.wire.block_hash import Extra

BlockKey = bytes  # vLLM's chained block hash of one full block (32 bytes with sha256_cbor)
BlockState = Literal["pending", "ready"]


def chain_order(keys: list[BlockKey], parent_of: Callable[[BlockKey], BlockKey | None]) -> list[BlockKey]:
    """``keys``, each after its parent where the parent is among them: the orchestrator's index chains
    a block to its parent's entry, so a report of many blocks names parents first. A loop of parents
    (never written by this project, but files can be changed) ends where it meets itself."""
    among = set(keys)
    depth: dict[BlockKey, int] = {}

    def depth_of(key: BlockKey) -> int:
        path: list[BlockKey] = []  # the blocks walked from ``key`` up, to the first whose depth is known
        on_path: set[BlockKey] = set()
        while key not in depth:
            parent = parent_of(key)
            if parent is None or parent not in among or parent in on_path or parent == key:
                depth[key] = 0
                break
            path.append(key)
            on_path.add(key)
            key = parent
        d = depth[key]
        for k in reversed(path):
            d += 1
            depth[k] = d
        return d

    return sorted(keys, key=depth_of)


@dataclass(slots=True)
class _Entry:
    slot: int
    state: BlockState
    writer: str  # the owner filling a pending block; "" once ready
    owners: dict[str, int] = field(default_factory=dict)  # owner -> references it holds
    token_ids: tuple[int, ...] = ()  # what the block holds, for the orchestrator's prefix index
    parent: BlockKey | None = None
    extra: Extra | None = None  # vLLM's extra keys (LoRA, multimodal, cache salt): its key covers them


@dataclass(frozen=True, slots=True)
class Pinned:
    """Blocks an owner now holds, in prompt order: the leading keys found, with their slots."""

    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    ready: tuple[bool, ...]  # False: still being written (a transfer in flight); wait or fail


@dataclass(frozen=True, slots=True)
class PoolStats:
    capacity: int
    used: int  # slots holding a block, pending or ready
    pending: int
    referenced: int  # blocks with at least one reference (never evicted)
    evictions: int  # lifetime
    hits: int  # lifetime blocks found by lookup/pin
    misses: int  # lifetime lookups that stopped short of the whole prompt


class PoolFull(Exception):
    """No free slot and none evictable: every block is referenced."""


# (key, slot, parent key, token ids, extra keys) of a ready block about to be evicted, its bytes still
# in its slot.
Evicting = Callable[[BlockKey, int, "BlockKey | None", tuple[int, ...], "Extra | None"], None]


class PrefixPool:
    """Blocks by key, slots by block, references by owner; capacity never exceeded."""

    def __init__(self, capacity: int, on_evict: Evicting | None = None) -> None:
        """``on_evict``: told of each block evicted for room, before its slot is handed out (the
        node's disk tier keeps it: ``disk.py``)."""
        if capacity < 1:
            raise ValueError(f"a pool needs at least one block of capacity, got {capacity}")
        self.capacity = capacity
        self._on_evict = on_evict
        self._entries: dict[BlockKey, _Entry] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # unreferenced ready blocks, oldest first
        self._held: dict[str, dict[BlockKey, int]] = {}  # owner -> key -> references
        self._orphans: dict[int, set[str]] = {}  # slot of a dropped pending block -> its readers
        self._evictions = 0
        self._hits = 0
        self._misses = 0
        self.removed: list[BlockKey] = []  # evicted or dropped since the last ``take_removed``
        self.stored: list[BlockKey] = []  # committed since the last ``take_stored``

    # --- reads -------------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(key) if isinstance(key, bytes) else None
        return entry is not None and entry.state == "ready"

    def __len__(self) -> int:
        return len(self._entries)

    def held_keys(self) -> list[BlockKey]:
        """Every block held, pending ones too."""
        return list(self._entries)

    def slot_of(self, key: BlockKey) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.slot

    def state_of(self, key: BlockKey) -> BlockState | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def info(self, key: BlockKey) -> tuple[BlockKey | None, tuple[int, ...]] | None:
        """A held block's parent key and token ids (what a KV event says of it)."""
        entry = self._entries.get(key)
        return None if entry is None else (entry.parent, entry.token_ids)

    def extra_of(self, key: BlockKey) -> Extra | None:
        """A held block's extra keys (None: a plain text block's, or not held)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.extra

    def references(self, key: BlockKey) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else sum(entry.owners.values())

    def owners(self) -> list[str]:
        return list(self._held)

    def lookup(self, keys: Sequence[BlockKey], *, pending_ok: bool = True) -> int:
        """How many of ``keys``, from the first, the pool holds (pending ones too unless told not)."""
        n = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or (entry.state == "pending" and not pending_ok):
                break
            n += 1
        return n

    def stats(self) -> PoolStats:
        pending = sum(1 for e in self._entries.values() if e.state == "pending")
        referenced = sum(1 for e in self._entries.values() if e.owners)
        return PoolStats(
            self.capacity,
            len(self._entries),
            pending,
            referenced,
            self._evictions,
            self._hits,
            self._misses,
        )

    # --- references --------------------------------------------------------------------------------
    def pin(self, owner: str, keys: Sequence[BlockKey], *, pending_ok: bool = True) -> Pinned:
        """Reference the leading held blocks of ``keys`` for ``owner``; they stay until released.

        Pinning again for the same owner adds references (each ``pin`` is undone by one
        ``release``, which drops them all): a request the engine asks about twice holds no more
        blocks than it asked for, and frees them all at once.
        """
        n = self.lookup(keys, pending_ok=pending_ok)
        found = keys[:n]
        self._hits += n
        if n < len(keys):
            self._misses += 1
        for key in found:
            self._ref(owner, key)
        return Pinned(
            tuple(found),
            tuple(self._entries[k].slot for k in found),
            tuple(self._entries[k].state == "ready" for k in found),
        )

    def release(self, owner: str) -> list[BlockKey]:
        """Drop every reference ``owner`` holds, and every block it was writing; the keys dropped."""
        for slot, readers in list(self._orphans.items()):
            readers.discard(owner)
            if not readers:
                del self._orphans[slot]
                self._free.append(slot)
        held = self._held.pop(owner, None)
        if not held:
            return []
        dropped: list[BlockKey] = []
        # Last to first: the prompt's first block re-enters the LRU newest, so its tail goes first.
        for key in reversed(held):
            entry = self._entries[key]
            del entry.owners[owner]
            if entry.state == "pending" and entry.writer == owner:
                # Half-written: no reader may ever see it. Readers that pinned it while pending wait
                # on its slot's header word (FAILED, or never complete), so the slot is not handed to
                # another block until they let go: they would read that block's bytes as this one's.
                readers = set(entry.owners)
                self._drop(key, free_slot=not readers)
                if readers:
                    self._orphans[entry.slot] = readers
                dropped.append(key)
            elif not entry.owners and entry.state == "ready":
                self._lru[key] = None
        return dropped

    # --- writes ------------------------------------------------------------------------------------
    def reserve(
        self,
        owner: str,
        blocks: Sequence[tuple[BlockKey, BlockKey | None, Sequence[int]]],
        extras: Mapping[BlockKey, Extra] | None = None,
    ) -> dict[BlockKey, int]:
        """``reserve_chain``'s slots."""
        return self.reserve_chain(owner, blocks, extras)[0]

    def reserve_chain(
        self,
        owner: str,
        blocks: Sequence[tuple[BlockKey, BlockKey | None, Sequence[int]]],
        extras: Mapping[BlockKey, Extra] | None = None,
    ) -> tuple[dict[BlockKey, int], list[BlockKey]]:
        """Slots for the blocks (key, parent, token ids) not yet held, pending and referenced by owner;
        and the *orphans*: blocks whose parent is neither held nor reserved before them here.

        Blocks already held are skipped (someone else wrote or is writing them). An orphan is not
        reserved: a lookup walks a prompt from its first block, so it could never reach it (its
        chain's earlier blocks were evicted since they were saved; the caller sends the chain
        again). Stops at the first block for which no slot can be freed: the caller writes the
        prefix it got, and the rest of the prompt is simply not pooled. Returns key -> slot for what
        to write, in prompt order. ``extras``: the extra keys of the blocks that have some.
        """
        # The chains these blocks continue are not evicted to make room for them: that would leave a
        # hole, and the blocks after it would be written for nothing. They are used by this save, so
        # they re-enter the LRU newest, first block last.
        kept = self._chains_in_lru(blocks)
        for key in kept:
            del self._lru[key]
        got: dict[BlockKey, int] = {}
        orphans: list[BlockKey] = []
        for key, parent, token_ids in blocks:
            if key in self._entries:
                continue
            if parent is not None and parent not in self._entries:
                orphans.append(key)
                continue
            slot = self._take_slot()
            if slot is None:
                break
            extra = extras.get(key) if extras else None
            self._entries[key] = _Entry(slot, "pending", owner, {}, tuple(token_ids), parent, extra)
            self._ref(owner, key)
            got[key] = slot
        for key in kept:
            self._lru[key] = None
        return got, orphans

    def _chains_in_lru(
        self, blocks: Sequence[tuple[BlockKey, BlockKey | None, Sequence[int]]]
    ) -> list[BlockKey]:
        """The evictable blocks among ``blocks`` and up their parents, tail first."""
        parent_in = {key: parent for key, parent, _ in blocks}
        out: list[BlockKey] = []
        seen: set[BlockKey] = set()
        for key, _, _ in reversed(blocks):
            at: BlockKey | None = key
            while at is not None and at not in seen:
                seen.add(at)
                entry = self._entries.get(at)
                if entry is None:
                    at = parent_in.get(at)
                    continue
                if at in self._lru:
                    out.append(at)
                at = entry.parent
        return out

    def describe(
        self, owner: str, key: BlockKey, token_ids: Sequence[int], extra: Extra | None = None
    ) -> bool:
        """Set the token ids (and extra keys) of a block ``owner`` is writing (reserved before they
        were known, as a fetch's blocks are); False if it is not such a block."""
        entry = self._entries.get(key)
        if entry is None or entry.state != "pending" or entry.writer != owner:
            return False
        entry.token_ids, entry.extra = tuple(token_ids), extra
        return True

    def commit(self, owner: str, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Mark blocks ``owner`` reserved as ready (their bytes are written); the keys committed."""
        done: list[BlockKey] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.state != "pending" or entry.writer != owner:
                continue
            entry.state = "ready"
            entry.writer = ""
            done.append(key)
            self.stored.append(key)
        return done

    def clear(self) -> list[BlockKey]:
        """Forget everything (the agent restarted, or the engine's geometry changed); the keys held."""
        keys = list(self._entries)
        self._entries.clear()
        self._held.clear()
        self._lru.clear()
        self._orphans.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self.removed.extend(keys)
        return keys

    def take_removed(self) -> list[BlockKey]:
        out, self.removed = self.removed, []
        return out

    def take_stored(self) -> list[BlockKey]:
        out, self.stored = self.stored, []
        return [k for k in out if k in self]

    # --- inside ------------------------------------------------------------------------------------
    def _ref(self, owner: str, key: BlockKey) -> None:
        entry = self._entries[key]
        entry.owners[owner] = entry.owners.get(owner, 0) + 1
        held = self._held.setdefault(owner, {})
        held[key] = held.get(key, 0) + 1
        self._lru.pop(key, None)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        key, _ = self._lru.popitem(last=False)
        self._evictions += 1
        entry = self._entries[key]
        slot = entry.slot
        if self._on_evict is not None:
            self._on_evict(key, slot, entry.parent, entry.token_ids, entry.extra)
        self._drop(key, free_slot=False)
        return slot

    def _drop(self, key: BlockKey, *, free_slot: bool = True) -> None:
        entry = self._entries.pop(key)
        self._lru.pop(key, None)
        for owner in entry.owners:
            held = self._held.get(owner)
            if held is not None:
                held.pop(key, None)
        if free_slot:
            self._free.append(entry.slot)
        self.removed.append(key)
