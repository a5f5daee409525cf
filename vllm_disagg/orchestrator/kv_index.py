"""Which instance caches which prompt prefix: the agents' forwarded KV-cache events, indexed.

One ``PrefixIndex`` per block size in use (instances of one model may differ: vLLM picks 16 on a GPU,
128 on a CPU), each instance under exactly one of them. The control plane is the only writer: it
applies ``KvEvents`` from live sessions and drops an instance that dies or says Hello again (a new
session may be a new engine with an empty cache). The gateway reads ``cached_tokens`` per request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from vllm_disagg.orchestrator.scheduling.prefix_index import PrefixIndex, PromptTokens
from vllm_disagg.protocol.messages import KvEvent

log = logging.getLogger(__name__)


class KvIndex:
    """Cached prompt prefixes of every instance, fed by ``KvEvents``; asked per prompt."""

    def __init__(self) -> None:
        self._by_size: dict[int, PrefixIndex] = {}
        self._size_of: dict[str, int] = {}  # instance -> the block size its entries are under
        self._users: dict[int, int] = {}  # block size -> instances under it

    def apply(self, agent_id: str, events: Sequence[KvEvent]) -> int:
        """Apply one agent's events in order; how many were applied (malformed ones are skipped)."""
        applied = 0
        for event in events:
            if event.kind == "stored":
                if event.block_size < 1:
                    log.warning("instance %s stored blocks of size %d: ignored", agent_id, event.block_size)
                    continue
                index = self._index_for(agent_id, event.block_size)
                index.stored(agent_id, event.block_hashes, event.parent_block_hash, event.token_ids)
            else:
                size = self._size_of.get(agent_id)
                if size is not None:
                    index = self._by_size[size]
                    if event.kind == "removed":
                        index.removed(agent_id, event.block_hashes)
                    else:
                        index.cleared(agent_id)
            applied += 1
        return applied

    def _index_for(self, agent_id: str, block_size: int) -> PrefixIndex:
        size = self._size_of.get(agent_id)
        if size != block_size:
            if size is not None:
                # Its engine was replaced by one with other blocks; the old entries cannot be kept.
                log.warning(
                    "instance %s now stores %d-token blocks, was %d: its index entries are dropped",
                    agent_id,
                    block_size,
                    size,
                )
                self.drop(agent_id)
            self._size_of[agent_id] = block_size
            self._users[block_size] = self._users.get(block_size, 0) + 1
        index = self._by_size.get(block_size)
        if index is None:
            index = self._by_size[block_size] = PrefixIndex(block_size)
        return index

    def drop(self, agent_id: str) -> None:
        """Forget everything an instance holds (it died, left, or started a new session)."""
        size = self._size_of.pop(agent_id, None)
        if size is None:
            return
        self._by_size[size].drop(agent_id)
        self._users[size] -= 1
        if not self._users[size]:  # no instance left with this size: no lookups under it either
            del self._users[size]
            del self._by_size[size]

    def blocks_of(self, agent_id: str) -> int:
        """How many blocks the index holds for one instance."""
        size = self._size_of.get(agent_id)
        return 0 if size is None else self._by_size[size].blocks_of(agent_id)

    def engine_blocks(self, agent_id: str) -> dict[int, int]:
        """An instance's blocks: its engine's hash -> the index key (a copy; for tests and debugging)."""
        size = self._size_of.get(agent_id)
        return {} if size is None else self._by_size[size].engine_blocks(agent_id)

    def total_blocks(self) -> int:
        """Distinct blocks indexed, over every instance and block size."""
        return sum(len(index) for index in self._by_size.values())

    def block_sizes(self) -> list[int]:
        """The block sizes in use, ascending."""
        return sorted(self._by_size)

    def cached_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Instance id -> how many leading tokens of this prompt it caches (whole blocks; absent: none)."""
        cached: dict[str, int] = {}
        if isinstance(token_ids, PromptTokens):  # keys hashed with the tokenization
            for size, index in self._by_size.items():
                for agent_id, blocks in index.match(token_ids.block_keys(size)).items():
                    cached[agent_id] = blocks * size
            return cached
        tokens = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        for size, index in self._by_size.items():
            for agent_id, blocks in index.match_prompt(tokens).items():
                cached[agent_id] = blocks * size
        return cached
