"""The simulated engine's KV state: a prefix cache of chained block hashes, and blocks held for transfer.

Only bookkeeping lives here (no I/O, time passed in), so expiry and pulls are tested without waiting.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


def chain_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One hash per full block, each over (parent hash, the block's token ids), as vLLM chains them."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        # Tuples of ints hash the same in every process (no hash randomisation), and fast.
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


class CacheListener(Protocol):
    """Told what enters and leaves the prefix cache (the KV-events publisher)."""

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int]) -> None:
        """Blocks entered the cache; ``parent`` is the hash of the block before the first, if any."""

    def removed(self, hashes: Sequence[int]) -> None:
        """Blocks were evicted."""

    def cleared(self) -> None:
        """Everything was forgotten."""


class PrefixCache:
    """An LRU set of block hashes of recently computed prompts, bounded by the KV capacity."""

    def __init__(self, capacity_blocks: int, block_size: int = 1) -> None:
        self._capacity = capacity_blocks
        self._block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.listener: CacheListener | None = None  # None: no event work at all

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Leading blocks of ``hashes`` (at most ``limit``) already cached; marks them recently used."""
        hit = 0
        for h in hashes[:limit]:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hit += 1
        return hit

    def insert(self, hashes: Sequence[int], token_ids: Sequence[int] = ()) -> None:
        """Remember a computed prompt's blocks, evicting the least recently used beyond capacity.

        ``token_ids`` (the prompt's) are only read when a listener is set.
        """
        if self.listener is not None:
            self._insert_told(self.listener, hashes, token_ids)
            return
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)

    def _insert_told(self, listener: CacheListener, hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        # As vLLM: the prompt's cached blocks are touched, room is made (BlockRemoved) and only then are
        # the new blocks stored (BlockStored), so a reader never sees the cache above its capacity.
        blocks = self._blocks
        new = 0
        for cached in hashes:
            if cached in blocks:
                blocks.move_to_end(cached)
            else:
                new += 1
        evicted: list[int] = []
        while blocks and len(blocks) + new > self._capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if evicted:
            listener.removed(evicted)
        bs = self._block_size
        start = -1  # first block of the current run of new blocks
        for i, h in enumerate((*hashes, None)):
            if h is not None and h not in blocks:
                if start < 0:
                    start = i
                continue
            if start >= 0:  # a run of new blocks ended: one BlockStored per run, chained to its parent
                parent = hashes[start - 1] if start else None
                listener.stored(hashes[start:i], parent, token_ids[start * bs : i * bs])
                start = -1
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        overflow = []
        while len(blocks) > self._capacity:  # a prompt longer than the whole cache keeps its tail
            overflow.append(blocks.popitem(last=False)[0])
        if overflow:
            listener.removed(overflow)

    def clear(self) -> None:
        """Forget everything (vLLM's reset_prefix_cache)."""
        self._blocks.clear()
        if self.listener is not None:
            self.listener.cleared()


@dataclass(frozen=True, slots=True)
class _HeldBlock:
    request_id: str
    token_ids: tuple[int, ...]
    deadline: float


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """The answer to a decoder's pull: the blocks' token ids in the order asked, or why not."""

    token_ids: tuple[int, ...] | None
    reason: str = ""


class TransferHolds:
    """Prompt blocks a prefill engine keeps for a decoder, until pulled or until the lease ends.

    Every block of the prompt is held, the partial last one included, as vLLM's NixlConnector hands
    them over; the prefix cache (``PrefixCache``) still knows full blocks only.
    """

    def __init__(self, block_size: int, lease_s: float) -> None:
        self._block_size = block_size
        self._lease_s = lease_s
        self._blocks: dict[int, _HeldBlock] = {}
        # Every lease is equally long, so deadlines arrive in insertion order: expiry pops the left end.
        self._deadlines: deque[tuple[float, tuple[int, ...]]] = deque()
        self._next_id = 1

    @property
    def held_blocks(self) -> int:
        """Blocks held now (they count in KV cache usage)."""
        return len(self._blocks)

    def hold(self, request_id: str, token_ids: Sequence[int], now: float) -> tuple[int, ...]:
        """Hold every block of ``token_ids`` for ``request_id``, the partial last one included
        (``ceil(len / block_size)`` blocks); returns their new block ids."""
        bs = self._block_size
        deadline = now + self._lease_s
        ids: list[int] = []
        for start in range(0, len(token_ids), bs):
            block_id = self._next_id
            self._next_id += 1
            self._blocks[block_id] = _HeldBlock(request_id, tuple(token_ids[start : start + bs]), deadline)
            ids.append(block_id)
        if ids:
            self._deadlines.append((deadline, tuple(ids)))
        return tuple(ids)

    def pull(self, block_ids: Sequence[int], request_id: str | None, now: float) -> PullOutcome:
        """Hand over and free the blocks ``block_ids`` (all or nothing)."""
        self.expire(now)
        if not block_ids:
            return PullOutcome(None, "no block ids given")
        if len(set(block_ids)) != len(block_ids):
            return PullOutcome(None, "duplicate block ids")
        missing = [b for b in block_ids if b not in self._blocks]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            return PullOutcome(
                None, f"no KV blocks held under ids [{shown}] (never held, already pulled, or lease expired)"
            )
        blocks = [self._blocks[b] for b in block_ids]
        if request_id is not None:
            strangers = {blk.request_id for blk in blocks if blk.request_id != request_id}
            if strangers:
                return PullOutcome(
                    None, f"blocks belong to request(s) {sorted(strangers)}, not {request_id!r}"
                )
        tokens: list[int] = []
        for b, blk in zip(block_ids, blocks, strict=True):
            tokens.extend(blk.token_ids)
            del self._blocks[b]
        return PullOutcome(tuple(tokens))

    def expire(self, now: float) -> int:
        """Free the blocks whose lease ended at or before ``now``; returns how many were freed."""
        freed = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, ids = self._deadlines.popleft()
            for b in ids:
                if self._blocks.pop(b, None) is not None:
                    freed += 1
        return freed

    def next_deadline(self) -> float | None:
        """When the oldest lease still pending ends, if any."""
        while self._deadlines and not any(b in self._blocks for b in self._deadlines[0][1]):
            self._deadlines.popleft()  # all pulled already: nothing to wait for
        return self._deadlines[0][0] if self._deadlines else None
