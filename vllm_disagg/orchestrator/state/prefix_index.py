"""Which instance holds the longest cached prefix of a prompt: an index fed by vLLM's KV-cache events.

Keys are the orchestrator's own chained block hashes, ``H(parent, block token ids)``, computed from the
token ids that ``BlockStored`` events carry, so the index does not depend on vLLM's hash algorithm or
seed; each instance's vLLM hashes map to ours so that ``BlockRemoved`` can be honoured. Holders of a
block are a bitmask over instance slots, so a lookup costs one dict get and one AND per prompt block,
whatever the number of instances.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_disagg.errors import KvEventsError
from vllm_disagg.wire.kv_events import BlockRemoved, BlockStored, KvEventBatch

ROOT = 0  # the parent of a prompt's first block


def chain_hash(parent: int, block: Sequence[int]) -> int:
    """The index key of a block: its tokens chained to its parent's key (deterministic in-process)."""
    return hash((parent, tuple(block)))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of a prompt's full blocks (a partial last block is never cached)."""
    tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)  # slices are then tuples
    keys = []
    parent = ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tokens[start : start + block_size]))  # chain_hash, inlined: hot path
        keys.append(parent)
    return keys


class PromptTokens(list[int]):
    """A prompt's token ids that keep their block keys, computed once per block size.

    The gateway's tokenizer hands these out, computes their keys on its worker thread (a vLLM model)
    and caches both, so a lookup in the index is a dict get per block instead of a hash of 16 ids
    and a dict get. Read-only once made: the keys describe the ids at the time.
    """

    __slots__ = ("_keys",)

    def __init__(self, ids: Sequence[int] = ()) -> None:
        super().__init__(ids)
        self._keys: dict[int, list[int]] = {}

    def block_keys(self, block_size: int) -> list[int]:
        """``prompt_block_hashes`` of these ids, computed on first use."""
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = prompt_block_hashes(self, block_size)
        return keys


class PrefixIndex:
    """Per-instance sets of cached blocks, queried for the longest cached prefix of a prompt."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._holders: dict[int, int] = {}  # our key -> bitmask of instance slots
        # One int object per distinct bitmask: the blocks of a shared prefix all point at the same
        # one, so a lookup touches one object fewer in memory per block after the first and the
        # match can tell "no holder lost" by identity (bench scheduler: a 1M-block match is cache-miss
        # bound). Rebuilt from the live masks when it outgrows them.
        self._masks: dict[int, int] = {}
        self._slots: dict[str, int] = {}  # instance id -> slot
        self._free_slots: list[int] = []
        self._ids: dict[int, str] = {}  # slot -> instance id
        self._engine_keys: dict[str, dict[int, int]] = {}  # instance -> {vLLM hash: our key}

    def __len__(self) -> int:
        """Distinct blocks indexed over all instances."""
        return len(self._holders)

    def blocks_of(self, instance_id: str) -> int:
        """How many blocks the index holds for one instance."""
        return len(self._engine_keys.get(instance_id, {}))

    def holds(self, instance_id: str, engine_hash: int) -> bool:
        """Does the instance hold the block its engine names ``engine_hash``?"""
        keys = self._engine_keys.get(instance_id)
        return keys is not None and engine_hash in keys

    def engine_blocks(self, instance_id: str) -> dict[int, int]:
        """An instance's blocks: its engine's hash -> the index key (a copy; for tests and debugging)."""
        return dict(self._engine_keys.get(instance_id, {}))

    def _slot(self, instance_id: str) -> int:
        slot = self._slots.get(instance_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[instance_id] = slot
            self._ids[slot] = instance_id
            self._engine_keys[instance_id] = {}
        return slot

    def stored(
        self,
        instance_id: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
    ) -> None:
        """A ``BlockStored`` event: ``token_ids`` cover one full block per hash, in order."""
        slot = self._slot(instance_id)
        bit = 1 << slot
        keys = self._engine_keys[instance_id]
        # An unknown parent (its event was missed) cannot be chained: skip rather than index wrongly.
        parent = ROOT if parent_engine_hash is None else keys.get(parent_engine_hash)
        if parent is None:
            return
        size = self.block_size
        for i, engine_hash in enumerate(engine_hashes):
            block = token_ids[i * size : (i + 1) * size]
            if len(block) < size:
                return
            parent = chain_hash(parent, block)
            before = keys.get(engine_hash)
            keys[engine_hash] = parent
            if before is not None and before != parent:  # re-stored under another prefix: move it
                self._unhold(before, slot)
            self._holders[parent] = self._mask(self._holders.get(parent, 0) | bit)

    def removed(self, instance_id: str, engine_hashes: Sequence[int]) -> None:
        """A ``BlockRemoved`` event."""
        slot = self._slots.get(instance_id)
        if slot is None:
            return
        keys = self._engine_keys[instance_id]
        for engine_hash in engine_hashes:
            key = keys.pop(engine_hash, None)
            if key is not None:
                self._unhold(key, slot)

    def cleared(self, instance_id: str) -> None:
        """An ``AllBlocksCleared`` event: the instance holds nothing any more."""
        slot = self._slots.get(instance_id)
        if slot is None:
            return
        keys = self._engine_keys[instance_id]
        for key in keys.values():
            self._unhold(key, slot)
        keys.clear()

    def drop(self, instance_id: str) -> None:
        """An instance that died or left: its entries and its slot go."""
        self.cleared(instance_id)
        slot = self._slots.pop(instance_id, None)
        if slot is not None:
            del self._ids[slot]
            del self._engine_keys[instance_id]
            self._free_slots.append(slot)

    def _unhold(self, key: int, slot: int) -> None:
        holders = self._holders.get(key, 0) & ~(1 << slot)
        if holders:
            self._holders[key] = self._mask(holders)
        else:
            self._holders.pop(key, None)

    def _mask(self, mask: int) -> int:
        """The shared int object equal to ``mask``."""
        masks = self._masks
        shared = masks.setdefault(mask, mask)
        if len(masks) > 2 * len(self._holders) + 1024:  # amortized O(1): dead masks are dropped
            self._masks = {m: m for m in self._holders.values()}
            self._masks.setdefault(shared, shared)
        return shared

    def match(self, block_keys: Sequence[int], unit: int = 1) -> dict[str, int]:
        """For each instance holding the first block: how many leading blocks of the prompt it holds,
        times ``unit`` (the block size gives tokens)."""
        matched: dict[str, int] = {}
        get = self._holders.get
        alive = get(block_keys[0], 0) if block_keys else 0
        if not alive:
            return matched
        depth = 1  # blocks held by every instance in ``alive``
        for key in block_keys[1:]:
            nxt = get(key, 0)
            if nxt is not alive:  # the same shared mask: nobody's prefix ended (no big-int work)
                nxt &= alive
                if nxt != alive:
                    self._ended(alive ^ nxt, depth * unit, matched)  # nxt is within alive: what left it
                    if not nxt:
                        return matched
                    alive = nxt
            depth += 1
        self._ended(alive, depth * unit, matched)
        return matched

    def match_prompt(self, token_ids: Sequence[int]) -> dict[str, int]:
        """``match`` of the prompt's full blocks, hashing a block only while someone holds the prefix.

        The same answer as ``match(prompt_block_hashes(token_ids, block_size))``; a prompt nobody
        has cached costs one block hash instead of one per block.
        """
        size = self.block_size
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        last_start = len(tokens) - size
        matched: dict[str, int] = {}
        if last_start < 0:
            return matched
        holders = self._holders
        key = hash((ROOT, tokens[:size]))  # chain_hash, inlined: hot path
        alive = holders.get(key, 0)
        depth, start = 0, size
        while alive:
            depth += 1
            if start <= last_start:
                key = hash((key, tokens[start : start + size]))
                start += size
                nxt = holders.get(key, 0)
                if nxt is alive:  # the same shared mask: nobody's prefix ended (no big-int work)
                    continue
                nxt &= alive
            else:
                nxt = 0
            if nxt != alive:
                self._ended(alive ^ nxt, depth, matched)
            alive = nxt
        return matched

    def _ended(self, gone: int, depth: int, matched: dict[str, int]) -> None:
        """Record ``depth`` for each instance in the bit set ``gone`` (their prefix ends there)."""
        # From the top bit down: each step shrinks the int, where taking the low bit (``gone & -gone``)
        # makes two copies of its full width (at 10,000 slots, 4.8 against 1.6 µs for 8 holders).
        ids = self._ids
        while gone:
            top = gone.bit_length() - 1
            matched[ids[top]] = depth
            gone ^= 1 << top


def apply_batch(index: PrefixIndex, instance_id: str, batch: KvEventBatch) -> None:
    """Feed a batch to the index; ``KvEventsError`` (before any change) on a block size it does not use."""
    for event in batch.events:
        if isinstance(event, BlockStored) and event.block_size != index.block_size:
            raise KvEventsError(
                f"instance {instance_id!r} stores {event.block_size}-token blocks, "
                f"the index uses {index.block_size}"
            )
    for event in batch.events:
        if isinstance(event, BlockStored):
            index.stored(instance_id, event.block_hashes, event.parent_block_hash, event.token_ids)
        elif isinstance(event, BlockRemoved):
            index.removed(instance_id, event.block_hashes)
        else:
            index.cleared(instance_id)
