"""The pool's contents as KV events of medium ``pool`` (its disk tier's: ``disk``), so the
orchestrator's index knows them too.

The pool keys blocks by vLLM's chained hash; the events carry it folded to 64 bits as vLLM's own KV
events do (``event_hash``), with the parent's and the block's token ids, so the orchestrator indexes a
pool block exactly as it indexes an engine's cached one. A block whose key covers extra keys (a LoRA
adapter's, multimodal inputs', a salted prompt's) is not reported, as the engine's own such blocks are
not indexed: the same tokens without them would not hit. They travel in the engine events' stream
(``KvEventForwarder.forward``), and each resync of that stream starts the pool over from
``pool_snapshot``.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_disagg.agent.kv.disk import DiskBlock
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey, chain_order
from vllm_disagg.protocol.messages import MEDIUM_DISK, MEDIUM_POOL, KvEvent
from vllm_disagg.wire.block_hash import event_hash


def _info(node: PoolNode, key: BlockKey, medium: str) -> tuple[BlockKey | None, tuple[int, ...]] | None:
    """A block's parent key and token ids, as the pool (or its disk tier) holds it; None for a block
    not held, or one whose key covers extra keys (not indexable by its tokens)."""
    if medium == MEDIUM_DISK:
        block = node.disk.info(key) if node.disk is not None else None
        return None if block is None or block.extra is not None else (block.parent, block.token_ids)
    pool = node.pool
    return None if pool is None or pool.extra_of(key) is not None else pool.info(key)


def stored_events(node: PoolNode, keys: Iterable[BlockKey], medium: str = MEDIUM_POOL) -> list[KvEvent]:
    """One ``stored`` event per block the pool (``MEDIUM_DISK``: its disk tier) holds, in the order given."""
    geometry = node.geometry
    if geometry is None:
        return []
    events = []
    for key in keys:
        info = _info(node, key, medium)
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
                medium=medium,
            )
        )
    return events


def changed_events(
    node: PoolNode, stored: list[BlockKey], removed: list[BlockKey], medium: str = MEDIUM_POOL
) -> list[KvEvent]:
    """What a change says: the blocks removed, then the blocks stored (a key evicted and stored
    again within one change ends stored)."""
    events = []
    if removed:
        events.append(KvEvent(kind="removed", block_hashes=[event_hash(k) for k in removed], medium=medium))
    return events + stored_events(node, stored, medium)


def pool_snapshot(node: PoolNode) -> list[KvEvent]:
    """The whole pool and its disk tier from nothing: ``cleared``, then every ready block, each after
    its parent (the index chains a block to its parent's entry, so a parent must come first)."""
    pool, disk = node.pool, node.disk
    events = [KvEvent(kind="cleared", medium=MEDIUM_POOL), KvEvent(kind="cleared", medium=MEDIUM_DISK)]
    if pool is not None:
        held = [k for k in pool.held_keys() if k in pool]
        events += stored_events(node, chain_order(held, lambda k: (pool.info(k) or (None,))[0]))
    if disk is not None:
        events += stored_events(node, chain_order(disk.keys(), lambda k: _parent(disk.info(k))), MEDIUM_DISK)
    return events


def _parent(block: DiskBlock | None) -> BlockKey | None:
    return None if block is None else block.parent
