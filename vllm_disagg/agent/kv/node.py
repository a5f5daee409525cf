"""The agent's pool and the arena that holds its bytes: one owner for both, opened once the engine
says the shape of its KV blocks.

The agent starts before its engine, but a pool's slots are sized by the engine's KV geometry (layers
and bytes per layer's block), which only the engine's worker knows once its KV cache exists. So the
pool opens when the worker first says hello (``connector.py`` -> ``service.py``), and opens again,
empty, if a restarted engine brings another geometry. Everything the agent does with pool blocks (the
engine's saves and loads, transfers to and from other agents) goes through this one object, on the
agent's event loop.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.agent.kv.arena import Capacity, Geometry, SlotArena
from vllm_disagg.agent.kv.disk import DiskTier
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool
from vllm_disagg.wire.block_hash import Extra

log = logging.getLogger(__name__)

PoolListener = Callable[[list[BlockKey], list[BlockKey]], None]  # (stored, removed) since last call


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """Where the pool's disk tier keeps its files, and how many bytes of them (``disk.py``)."""

    directory: Path
    capacity_bytes: int


PROMOTER = "disk:promote"  # the pool owner writing blocks read back from disk


class PoolNode:
    """``pool`` and ``arena`` (None until ``open``), the disk tier under them where configured, and who
    hears about blocks stored and removed."""

    def __init__(
        self,
        name: str,
        capacity: Capacity,
        *,
        memory_bytes: int | None = None,
        disk: DiskConfig | None = None,
    ) -> None:
        self.name = name  # the shared-memory file's name: unique per agent on a host
        self.capacity = capacity
        self._memory_bytes = memory_bytes
        self._disk_config = disk
        self.pool: PrefixPool | None = None
        self.arena: SlotArena | None = None
        self.disk: DiskTier | None = None
        self.listeners: list[PoolListener] = []
        self.disk_listeners: list[PoolListener] = []  # the same, of the disk tier's blocks

    @property
    def geometry(self) -> Geometry | None:
        return None if self.arena is None else self.arena.geometry

    def open(self, geometry: Geometry) -> SlotArena:
        """The arena for ``geometry``: the one open if it matches, else a new, empty one."""
        if self.arena is not None and self.arena.geometry == geometry:
            return self.arena
        if self.arena is not None:
            log.warning("engine KV geometry changed to %s: the pool starts empty", geometry)
            self.close()
        blocks = self.capacity.blocks(geometry, self._memory_bytes)
        # A random part: a name others can predict is one they can create first (the agent's O_EXCL
        # then fails) or watch for.
        self.arena = SlotArena.create(f"{self.name}-{os.getpid()}-{secrets.token_hex(8)}", geometry, blocks)
        disk = self._disk_config
        if disk is not None:
            self.disk = DiskTier.open(disk.directory, geometry, disk.capacity_bytes)
        self.pool = PrefixPool(blocks, on_evict=self._spill if disk is not None else None)
        log.info(
            "kv pool open: %d blocks of %d bytes (%s) at %s",
            blocks,
            geometry.block_bytes,
            self.capacity,
            self.arena.path,
        )
        return self.arena

    def changed(self) -> None:
        """Tell the listeners what was stored and removed since the last call (after any change)."""
        if self.pool is None:
            return
        stored, removed = self.pool.take_stored(), self.pool.take_removed()
        if stored or removed:
            for listener in self.listeners:
                listener(stored, removed)
        if self.disk is not None:
            stored, removed = self.disk.take_stored(), self.disk.take_removed()
            if stored or removed:
                for listener in self.disk_listeners:
                    listener(stored, removed)

    def _spill(
        self,
        key: BlockKey,
        slot: int,
        parent: BlockKey | None,
        token_ids: tuple[int, ...],
        extra: Extra | None,
    ) -> None:
        """A block evicted from memory goes to disk, from its slot, before the slot is reused."""
        assert self.disk is not None and self.arena is not None
        self.disk.spill(key, parent, token_ids, self.arena.block_view(slot), extra)

    def promote(self, keys: Sequence[BlockKey]) -> int:
        """Read back from disk, into the pool, the blocks of ``keys`` that follow the pool's leading
        run and that the disk tier holds, in order, up to the first it cannot load; how many. A block
        whose file is torn or corrupt is not loaded (its engine computes it and the rest)."""
        pool, disk, arena = self.pool, self.disk, self.arena
        if pool is None or disk is None or arena is None:
            return 0
        start = pool.lookup(keys)
        wanted = list(keys[start : start + disk.leading(list(keys[start:]))])
        if not wanted:
            return 0
        # The prefix in memory goes in too: ``reserve`` skips what is held, but never evicts it to make
        # room for the rest of the same chain.
        blocks: list[tuple[BlockKey, BlockKey | None, tuple[int, ...]]] = []
        extras: dict[BlockKey, Extra] = {}
        for key in keys[:start]:
            held = pool.info(key)
            assert held is not None
            blocks.append((key, *held))
        for key in wanted:
            info = disk.info(key)
            assert info is not None
            blocks.append((key, info.parent, info.token_ids))
            if info.extra is not None:
                extras[key] = info.extra
        got = pool.reserve(PROMOTER, blocks, extras)
        loaded = []
        for key in wanted:
            slot = got.get(key)
            if slot is None or not disk.load(key, arena.block_view(slot)):
                break
            arena.set_layers_ready(slot, arena.geometry.num_layers)
            loaded.append(key)
        pool.commit(PROMOTER, loaded)
        pool.release(PROMOTER)  # and the reserved blocks not loaded: dropped, never served
        return len(loaded)

    def spill_all(self) -> int:
        """Write every ready block memory holds to the disk tier (those it has already stay); how many
        it holds of them after. Memory keeps them too: the caller clears it if it must."""
        pool, disk, arena = self.pool, self.disk, self.arena
        if pool is None or disk is None or arena is None:
            return 0
        kept = 0
        for key in pool.held_keys():
            slot, info = pool.slot_of(key), pool.info(key)
            if key in pool and slot is not None and info is not None:
                kept += disk.spill(key, info[0], info[1], arena.block_view(slot), pool.extra_of(key))
        return kept

    def close(self) -> None:
        disk = self.disk
        if disk is not None:
            # A graceful stop keeps what memory held: the next agent finds it on disk. This one serves
            # none of it any more: the disk tier's blocks are reported gone with the pool's.
            self.spill_all()
            disk.take_stored()
            disk.removed = disk.keys()
        if self.pool is not None:
            self.pool.clear()
            self.changed()
        if self.arena is not None:
            self.arena.close()
        self.pool = None
        self.arena = None
        self.disk = None
