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
from collections.abc import Callable

from vllm_disagg.agent.kv.arena import Capacity, Geometry, SlotArena
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool

log = logging.getLogger(__name__)

PoolListener = Callable[[list[BlockKey], list[BlockKey]], None]  # (stored, removed) since last call


class PoolNode:
    """``pool`` and ``arena`` (None until ``open``), and who hears about blocks stored and removed."""

    def __init__(self, name: str, capacity: Capacity, *, memory_bytes: int | None = None) -> None:
        self.name = name  # the shared-memory file's name: unique per agent on a host
        self.capacity = capacity
        self._memory_bytes = memory_bytes
        self.pool: PrefixPool | None = None
        self.arena: SlotArena | None = None
        self.listeners: list[PoolListener] = []

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
        self.pool = PrefixPool(blocks)
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

    def close(self) -> None:
        if self.pool is not None:
            self.pool.clear()
            self.changed()
        if self.arena is not None:
            self.arena.close()
        self.pool = None
        self.arena = None
