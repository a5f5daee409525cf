"""The pool's contents as KV events of medium ``pool``, so the orchestrator's index knows them too.

The pool keys blocks by vLLM's chained hash; the events carry it folded to 64 bits as vLLM's own KV
events do (``event_hash``), with the parent's and the block's token ids, so the orchestrator indexes a
pool block exactly as it indexes an engine's cached one. They travel in the engine events' stream
(``KvEventForwarder.forward``), and each resync of that stream starts the pool over from
``pool_snapshot``.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey
from vllm_disagg.protocol.messages import MEDIUM_POOL, KvEvent
from vllm_disagg.wire.block_hash import event_hash


def stored_events(node: PoolNode, keys: Iterable[BlockKey]) -> list[KvEvent]:
    """One ``stored`` event per block the pool holds, in the order given."""
    pool, geometry = node.pool, node.geometry
    if pool is None or geometry is None:
        return []
    events = []
    for key in keys:
        info = pool.info(key)
        if info is None:
            continue
        parent, tokens = info
        events.append(
            KvEvent(
                kind="stored",
                block_hashes=[event_hash(key)],
                parent_block_hash=None if parent is None else event_hash(parent),
                token_ids=list(tokens),
                block_size=geometry.block_size,
                medium=MEDIUM_POOL,
            )
        )
    return events


def changed_events(node: PoolNode, stored: list[BlockKey], removed: list[BlockKey]) -> list[KvEvent]:
    """What a pool change says: the blocks removed, then the blocks stored (a key evicted and stored
    again within one change ends stored)."""
    events = []
    if removed:
        events.append(
            KvEvent(kind="removed", block_hashes=[event_hash(k) for k in removed], medium=MEDIUM_POOL)
        )
    return events + stored_events(node, stored)


def pool_snapshot(node: PoolNode) -> list[KvEvent]:
    """The whole pool from nothing: ``cleared``, then every ready block, each after its parent (the
    index chains a block to its parent's entry, so a parent must come first)."""
    pool = node.pool
    if pool is None:
        return [KvEvent(kind="cleared", medium=MEDIUM_POOL)]
    held = [k for k in pool.held_keys() if k in pool]
    depth: dict[BlockKey, int] = {}

    def depth_of(key: BlockKey) -> int:
        path = []  # the blocks walked from ``key`` up, to the first whose depth is known
        while key not in depth:
            info = pool.info(key)
            parent = None if info is None else info[0]
            if parent is None or parent not in pool:
                depth[key] = 0
                break
            path.append(key)
            key = parent
        d = depth[key]
        for k in reversed(path):
            d += 1
            depth[k] = d
        return d

    held.sort(key=depth_of)
    return [KvEvent(kind="cleared", medium=MEDIUM_POOL), *stored_events(node, held)]
