"""Which instance caches which prompt prefix: the agents' forwarded KV events, indexed.

One ``PrefixIndex`` per block size in use (instances of one model may differ: vLLM picks 16 on a GPU,
128 on a CPU), each instance under exactly one of them. Three media are kept apart, each with its
own indexes: the engines' own prefix caches (``"gpu"`` events, what the scheduler's prefix affinity
reads), the agents' node-level KV pools (``"pool"`` events, protocol 1.3: blocks an engine of the
``vllm-disagg`` connector loads from its agent, or that another agent can fetch) and those pools'
disk tiers (``"disk"`` events: blocks the agent reads back into its pool when asked). The control plane
is the only writer: it applies ``KvEvents`` from live sessions and drops an instance that dies or says
Hello again (a new session may be a new engine with an empty cache). The gateway reads
``cached_tokens`` per request, and ``pooled_tokens`` where pools exist.

The orchestrator's index has a ``KvGate`` (``kv_limits.py``): what one agent may make it hold is
bounded, and events beyond the bounds are dropped before they are applied (``admit``), so that a
journal of what was applied (``gateway/workers/hub.py``) replays to the same index in a worker, whose
own index has no gate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_disagg.orchestrator.state.kv_limits import KvGate
from vllm_disagg.orchestrator.state.prefix_index import PrefixIndex, PromptTokens
from vllm_disagg.protocol.messages import MEDIUM_DISK, MEDIUM_GPU, MEDIUM_POOL, KvEvent

log = logging.getLogger(__name__)


class _Medium:
    """The indexes of one medium: per block size, and the block size each instance is under."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.by_size: dict[int, PrefixIndex] = {}
        self.size_of: dict[str, int] = {}  # instance -> the block size its entries are under
        self.users: dict[int, int] = {}  # block size -> instances under it

    def apply(self, agent_id: str, event: KvEvent) -> bool:
        if event.kind == "stored":
            if event.block_size < 1:
                log.warning(
                    "instance %s stored %s blocks of size %d: ignored", agent_id, self.name, event.block_size
                )
                return False
            index = self._index_for(agent_id, event.block_size)
            index.stored(agent_id, event.block_hashes, event.parent_block_hash, event.token_ids)
        else:
            size = self.size_of.get(agent_id)
            if size is not None:
                index = self.by_size[size]
                if event.kind == "removed":
                    index.removed(agent_id, event.block_hashes)
                else:
                    index.cleared(agent_id)
        return True

    def _index_for(self, agent_id: str, block_size: int) -> PrefixIndex:
        size = self.size_of.get(agent_id)
        if size != block_size:
            if size is not None:
                # Its engine was replaced by one with other blocks; the old entries cannot be kept.
                log.warning(
                    "instance %s now stores %d-token blocks in its %s, was %d: its index entries are dropped",
                    agent_id,
                    block_size,
                    self.name,
                    size,
                )
                self.drop(agent_id)
            self.size_of[agent_id] = block_size
            self.users[block_size] = self.users.get(block_size, 0) + 1
        index = self.by_size.get(block_size)
        if index is None:
            index = self.by_size[block_size] = PrefixIndex(block_size)
        return index

    def drop(self, agent_id: str) -> None:
        size = self.size_of.pop(agent_id, None)
        if size is None:
            return
        self.by_size[size].drop(agent_id)
        self.users[size] -= 1
        if not self.users[size]:  # no instance left with this size: no lookups under it either
            del self.users[size]
            del self.by_size[size]

    def blocks_of(self, agent_id: str) -> int:
        size = self.size_of.get(agent_id)
        return 0 if size is None else self.by_size[size].blocks_of(agent_id)

    def holds(self, agent_id: str, engine_hash: int) -> bool:
        size = self.size_of.get(agent_id)
        return size is not None and self.by_size[size].holds(agent_id, engine_hash)

    def engine_blocks(self, agent_id: str) -> dict[int, int]:
        size = self.size_of.get(agent_id)
        return {} if size is None else self.by_size[size].engine_blocks(agent_id)

    def matched_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        matched: dict[str, int] = {}
        if isinstance(token_ids, PromptTokens):  # keys hashed with the tokenization
            for size, index in self.by_size.items():
                matched.update(index.match(token_ids.block_keys(size), size))
            return matched
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        for size, index in self.by_size.items():
            for agent_id, blocks in index.match_prompt(tokens).items():
                matched[agent_id] = blocks * size
        return matched


class KvIndex:
    """Cached prompt prefixes of every instance's engine, and of every agent's KV pool, fed by
    ``KvEvents``; asked per prompt."""

    def __init__(self, gate: KvGate | None = None) -> None:
        self._gpu = _Medium("prefix cache")
        self._pool = _Medium("KV pool")
        self._disk = _Medium("KV pool's disk tier")  # blocks the agent reads back into its pool when asked
        self._media = self._by_medium()
        self._gate = gate  # None: every event is applied (a worker's replica of the index)

    def __getstate__(self) -> dict[str, Any]:
        # A worker gets the entries, not the gate: it applies only what the orchestrator's admitted.
        return {k: v for k, v in vars(self).items() if k != "_gate"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._gate = None

    def take(self, other: KvIndex) -> None:
        """Hold what ``other`` holds, and drop what this one held: a gateway worker's index on the
        orchestrator's whole state. Its readers keep the same object; ``other`` is not used again."""
        self._gpu, self._pool, self._disk = other._gpu, other._pool, other._disk
        self._media = self._by_medium()

    def _by_medium(self) -> dict[str, _Medium]:
        return {MEDIUM_GPU: self._gpu, MEDIUM_POOL: self._pool, MEDIUM_DISK: self._disk}

    def apply(self, agent_id: str, events: Sequence[KvEvent]) -> int:
        """Apply one agent's events within its limits, in order; how many were applied."""
        return self.apply_gated(agent_id, events)[0]

    def apply_gated(self, agent_id: str, events: Sequence[KvEvent]) -> tuple[int, Sequence[KvEvent]]:
        """``apply``, and the events as applied (those the gate admitted, cut where it cut them;
        all of them without a gate): what a replica applies, ungated, to hold the same."""
        gate = self._gate
        if gate is None:
            return self.apply_admitted(agent_id, events), events
        applied, admitted = 0, []
        for event in gate.admit(agent_id, events, lambda medium: self._indexed(agent_id, medium)):
            applied += self.apply_admitted(agent_id, (event,))
            admitted.append(event)
        return applied, admitted

    def _indexed(self, agent_id: str, medium: str) -> int:
        found = self._media.get(medium)
        return 0 if found is None else found.blocks_of(agent_id)

    def apply_admitted(self, agent_id: str, events: Sequence[KvEvent]) -> int:
        """Apply one agent's events in order, as they are; how many were applied (malformed ones are
        skipped)."""
        applied = 0
        gpu, media = self._gpu, self._media
        for event in events:
            medium = event.medium
            if medium == MEDIUM_GPU:  # the hot path: engines' own events
                applied += gpu.apply(agent_id, event)
            elif (found := media.get(medium)) is not None:
                applied += found.apply(agent_id, event)
            else:  # a medium a later protocol minor added: nothing here reads it
                log.debug("instance %s: a KV event of unknown medium %r ignored", agent_id, medium)
        return applied

    def drop(self, agent_id: str) -> None:
        """Forget everything an instance holds, in its engine and its pool (it died, left, or started
        a new session)."""
        self._gpu.drop(agent_id)
        self._pool.drop(agent_id)
        self._disk.drop(agent_id)
        if self._gate is not None:
            self._gate.forget(agent_id)

    def blocks_of(self, agent_id: str) -> int:
        """How many blocks of its engine's prefix cache the index holds for one instance."""
        return self._gpu.blocks_of(agent_id)

    def pool_blocks_of(self, agent_id: str) -> int:
        """How many blocks of its agent's KV pool the index holds for one instance."""
        return self._pool.blocks_of(agent_id)

    def disk_blocks_of(self, agent_id: str) -> int:
        """How many blocks of its agent's pool's disk tier the index holds for one instance."""
        return self._disk.blocks_of(agent_id)

    def engine_blocks(self, agent_id: str) -> dict[int, int]:
        """An instance's blocks: its engine's hash -> the index key (a copy; for tests and debugging)."""
        return self._gpu.engine_blocks(agent_id)

    def pool_entries(self, agent_id: str) -> dict[int, int]:
        """An instance's pool blocks: the event hash of the pool's key -> the index key (a copy)."""
        return self._pool.engine_blocks(agent_id)

    def pool_holds(self, agent_id: str, event_hash: int) -> bool:
        """Did the instance's agent report this block (its key's ``event_hash``) in its pool?"""
        return self._pool.holds(agent_id, event_hash)

    def total_blocks(self) -> int:
        """Distinct blocks of engines' prefix caches indexed, over every instance and block size."""
        return sum(len(index) for index in self._gpu.by_size.values())

    def pool_total_blocks(self) -> int:
        """Distinct blocks of agents' KV pools indexed, over every instance and block size."""
        return sum(len(index) for index in self._pool.by_size.values())

    def block_sizes(self) -> list[int]:
        """The block sizes of engines' prefix caches in use, ascending."""
        return sorted(self._gpu.by_size)

    @property
    def has_pools(self) -> bool:
        """Does any agent's pool, or its disk tier, hold anything? (Else ``pooled_tokens`` is empty.)"""
        return bool(self._pool.by_size) or bool(self._disk.by_size)

    def cached_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Instance id -> how many leading tokens of this prompt its engine caches (whole blocks;
        absent: none)."""
        return self._gpu.matched_tokens(token_ids)

    def pooled_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Instance id -> how many leading tokens of this prompt its agent's KV pool holds, in memory
        or on its disk tier (whole blocks; absent: none). Of a chain split between the two, the
        longer part counts (an under-estimate: the agent reads the disk's part back after memory's)."""
        pooled = self._pool.matched_tokens(token_ids) if self._pool.by_size else {}
        if self._disk.by_size:
            for agent_id, tokens in self._disk.matched_tokens(token_ids).items():
                if tokens > pooled.get(agent_id, 0):
                    pooled[agent_id] = tokens
        return pooled
