"""The project's vLLM KV connector: engines save prompts' full blocks into their agent's prefix pool
and load what the pool holds, so a prefix computed once (here, or on another instance whose agent
sent it over) is never computed again.

vLLM loads it from ``--kv-transfer-config`` (``up --kv-connector vllm-disagg`` writes it)::

    {"kv_connector": "VllmDisaggConnector",
     "kv_connector_module_path": "vllm_disagg.agent.kv.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"agent_endpoint": "ipc://...", "save": true}}

with ``--prefix-caching-hash-algo sha256_cbor``, so that a block's key (vLLM's chained block hash,
``request.block_hashes``) is the same in every engine and agent (``wire/block_hash.py``).

One instance runs in the scheduler's process, one in each worker; they share nothing but the
``ConnectorMeta`` vLLM hands from one to the other each step.

- **Scheduler side.** ``get_num_new_matched_tokens`` asks the agent which of the prompt's next blocks
  the pool holds and pins them for the request (a waiting request holds its prefix: it cannot be
  evicted under it), leaving at least one prompt token to compute. A hit the pool holds whole is
  loaded synchronously, layer by layer in the step that schedules the request; a hit with blocks a
  transfer is still bringing is loaded asynchronously: vLLM parks the request and schedules others
  until the worker says the blocks are in (``inflight.py``). Each step it reserves pool slots for the
  prompt blocks that step completes (``build_connector_meta``): a prompt's chain is sent once, then
  only its new blocks (the pool keeps the chain they continue; one whose head was evicted since is
  sent again whole). Pins go when the worker has loaded them or the request ends, whichever is
  first (``request_finished``), so an aborted request never leaks one. A P leg
  (``kv_transfer_params.do_remote_decode``) answers the blocks its pool holds:
  ``{"vllm_disagg": {"block_size": N, "keys": [hex, ...]}}``.
- **Worker side.** After each attention layer, it copies that layer of each block to save into its
  pool slot (``save_kv_layer``); the step's save is committed to the pool once its copies are done,
  without waiting for them (a request that finishes while they run keeps its KV blocks until then).
  Before each layer it copies that layer of each block to load synchronously out of its slot
  (``wait_for_layer_load``). Each step (``get_finished``) it settles the asynchronous loads whose
  blocks landed (or failed, or are ``load_timeout_s`` late: those are reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes them), copies them in, and reports them.
  The pool is host shared memory (``arena.py``), mapped by the worker: on a GPU each copy crosses
  PCIe, from page-locked memory, on a side stream (``device_copy.py``); CUDA IPC between engines is
  not used.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from vllm_disagg.agent.kv.arena import Geometry, SlotArena
from vllm_disagg.agent.kv.device_copy import BlockCopier
from vllm_disagg.agent.kv.inflight import FINISHED, InFlightSave, Receive, Receiving, Saving
from vllm_disagg.agent.kv.local import LocalClient, LocalError
from vllm_disagg.agent.kv.local_messages import (
    Commit,
    Committed,
    Lookup,
    Open,
    Opened,
    Pinned,
    Release,
    Released,
    Reserve,
    Reserved,
    SaveBlock,
)
from vllm_disagg.protocol.kv_pool import pool_handle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = init_logger("vllm.vllm_disagg.connector")  # under "vllm.": its lines go to the engine's log

LOAD_TIMEOUT_S = 10.0  # a landing block not there by then is recomputed
REOPEN_EVERY_S = 1.0  # at most this often the workers map their agent's pool again


@dataclass(frozen=True, slots=True)
class Load:
    req_id: str
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]  # where each slot goes in the engine's KV cache


@dataclass(frozen=True, slots=True)
class Save:
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    reqs: tuple[str, ...]  # the requests whose blocks these are


@dataclass
class ConnectorMeta(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers for one step."""

    step: int = 0
    loads: list[Load] = field(default_factory=list)  # synchronous: in this step's forward
    receives: list[Load] = field(default_factory=list)  # asynchronous: once their blocks land
    save: Save | None = None
    delayed: list[str] = field(default_factory=list)  # finished, their KV blocks kept until saved
    preempted: bool = False
    reopen: bool = False  # the agent's pool is not the one the workers mapped: map it again


@dataclass
class _Tracked:
    """A request the scheduler side follows: its blocks in the KV cache and how far it was saved."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    sent: int = 0  # prompt blocks before this one were sent to the pool already
    saved: int = 0  # the most prompt blocks sent so far (what a prefill leg's handle names)
    local_blocks: int = 0  # blocks the engine's own prefix cache had when it asked
    pinned: tuple[tuple[int, ...], tuple[bool, ...]] = ((), ())  # slots and readiness of the hit


class VllmDisaggConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector API (v1) over the agent's prefix pool."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        endpoint = extra.get("agent_endpoint") or os.environ.get("VLLM_DISAGG_AGENT_ENDPOINT", "")
        if not endpoint:
            raise ValueError("vllm-disagg connector: kv_connector_extra_config.agent_endpoint is required")
        self._agent = LocalClient(str(endpoint))
        # Several engines may share one node's pool: each names its pins and saves with its own prefix.
        self._engine = str(extra.get("engine_name", "engine"))
        self._block_size: int = vllm_config.cache_config.block_size
        self._save_prompts = bool(extra.get("save", True))
        self._load_timeout_s = float(extra.get("load_timeout_s", LOAD_TIMEOUT_S))
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._step = 0
        # Requests whose loads each recent step carried: their pins go two steps later, once the
        # worker has surely run that step (with async scheduling it may run one step behind).
        self._loaded: deque[list[str]] = deque([[], []])
        self._receives: list[Load] = []  # asynchronous loads for the next step's metadata
        self._receiving: set[str] = set()  # their requests, pinned until the workers report them
        self._saved_reqs: set[str] = set()  # requests with blocks in a save so far
        self._delayed: list[str] = []  # finished ones of those, for the next step's metadata
        self._reopen, self._reopen_at = False, 0.0
        # worker side
        self._arena: SlotArena | None = None
        self._layers: dict[str, int] = {}  # layer name -> index in a slot
        self._caches: list[torch.Tensor] = []
        self._copier = BlockCopier(torch.device("cpu"))  # replaced by the caches' device's
        self._block_dim = 0
        self._geometry = Geometry(1, 1, self._block_size)  # the engine's, once its caches are registered
        self._load_errors: set[int] = set()
        self._in_receive = Receiving()
        self._in_save = Saving()

    # === scheduler side ============================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        keys = list(request.block_hashes)
        first = num_computed_tokens // self._block_size
        # At least one prompt token must be computed here: it is what yields the next token.
        last = (request.num_prompt_tokens - 1) // self._block_size
        if last <= first:
            return 0, False
        try:
            answer = self._agent.call(Lookup(self._req(request.request_id), keys[first:last]), Pinned)
        except LocalError as e:
            self._refused(e, "pool lookup failed, computing the prompt")
            return 0, False
        slots, ready = tuple(answer.slots), tuple(answer.ready)
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.local_blocks = first
        tracked.pinned = (slots, ready)
        # Blocks still landing: vLLM waits for them without holding up its other requests.
        return len(slots) * self._block_size, not all(ready)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        tracked = self._tracked.setdefault(req_id, _Tracked(request))
        slots, ready = tracked.pinned
        if num_external_tokens == 0:
            if slots:  # vLLM took less than the hit (another source covered it): nothing to load from us
                self._release([req_id])
                tracked.pinned = ((), ())
            return
        n = num_external_tokens // self._block_size
        if all(ready):
            tracked.pinned = (slots[:n], ready[:n])
            return
        # Asynchronous (we said so): the request waits, not scheduled, and its blocks are these.
        start = tracked.local_blocks
        ids = tuple(blocks.get_block_ids()[0][start : start + n])
        self._receives.append(Load(req_id, slots[:n], ids))
        self._receiving.add(req_id)
        tracked.pinned = ((), ())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        self._step += 1
        meta = ConnectorMeta(
            step=self._step,
            receives=self._receives,
            delayed=self._delayed,
            preempted=bool(scheduler_output.preempted_req_ids),
            reopen=self._reopen,
        )
        self._receives, self._delayed, self._reopen = [], [], False
        done = self._loaded.popleft()
        if done:
            self._release(done)
        loaded: list[str] = []
        self._loaded.append(loaded)
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            slots, _ = tracked.pinned
            if slots:
                start = tracked.local_blocks
                ids = tuple(tracked.block_ids[start : start + len(slots)])
                meta.loads.append(Load(new.req_id, slots, ids))
                loaded.append(new.req_id)
                tracked.pinned = ((), ())
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            new_ids = cached.new_block_ids[i]
            if tracked is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0])  # after a preemption: all of them, anew
            else:
                tracked.block_ids.extend(new_ids[0])
        if self._save_prompts:
            meta.save = self._reserve_saves(scheduler_output)
        return meta

    def _reserve_saves(self, scheduler_output: SchedulerOutput) -> Save | None:
        """Pool slots for the prompt blocks this step completes that the pool does not hold yet."""
        blocks: list[SaveBlock] = []
        where: dict[bytes, tuple[int, str]] = {}  # key -> (engine block, request)
        for req_id, n_tokens in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            done = min(request.num_computed_tokens + n_tokens, request.num_prompt_tokens)
            full = min(done // self._block_size, len(request.block_hashes), len(tracked.block_ids))
            if full <= tracked.sent:
                continue
            for b in range(tracked.sent, full):
                key = request.block_hashes[b]
                if key not in where:
                    blocks.append(self._save_block(request, b))
                    where[key] = (tracked.block_ids[b], req_id)
            tracked.sent, tracked.saved = full, max(tracked.saved, full)
        if not blocks:
            return None
        try:
            answer = self._agent.call(Reserve(f"{self._engine}:{self._step}", blocks), Reserved)
        except LocalError as e:
            self._refused(e, "pool reserve failed, not saving this step's blocks")
            answer = Reserved([], [key for key, _ in where.items()])
        for key in answer.orphans:  # the chain's head left the pool since: the whole chain, next step
            tracked = self._tracked.get(where[key][1]) if key in where else None
            if tracked is not None:
                tracked.sent = 0
        got = [(key, slot) for key, slot in answer.slots if key in where]
        if not got:
            return None
        reqs = tuple(sorted({where[key][1] for key, _ in got}))
        self._saved_reqs.update(reqs)
        return Save(
            tuple(slot for _, slot in got),
            tuple(where[key][0] for key, _ in got),
            tuple(k for k, _ in got),
            reqs,
        )

    def _save_block(self, request: Request, b: int) -> SaveBlock:
        """Prompt block ``b`` of ``request`` as the pool keeps it: its key and parent's, its tokens, and
        the extra keys vLLM hashed into its key (a LoRA adapter's, multimodal inputs', a cache salt's),
        so that another agent can check the key before it serves the block (``landing.py``)."""
        start, end = b * self._block_size, (b + 1) * self._block_size
        extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
        tokens = list((request.prompt_token_ids or [])[start:end])
        return SaveBlock(request.block_hashes[b], request.block_hashes[b - 1] if b else None, tokens, extra)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        loaded = [r for r in connector_output.finished_recving or () if r in self._receiving]
        if loaded:  # the workers copied them: the pins can go
            self._receiving.difference_update(loaded)
            self._release(loaded)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        tracked = self._tracked.pop(req_id, None)
        if req_id not in self._receiving:  # (else its pins go when the workers report the load)
            self._release([req_id])
        # Its blocks stay until the saves that read them are done (the workers report it).
        delay = req_id in self._saved_reqs and req_id not in self._receiving
        self._saved_reqs.discard(req_id)
        if delay:
            self._delayed.append(req_id)
        params = request.kv_transfer_params
        if tracked is None or not isinstance(params, dict) or not params.get("do_remote_decode"):
            return delay, None  # not a prefill leg (the gateway's says do_remote_decode, as for NIXL)
        # A prefill leg: the gateway moves these blocks to the decode instance's pool.
        return delay, pool_handle(self._block_size, request.block_hashes[: tracked.saved])

    def _refused(self, e: LocalError, what: str) -> None:
        """Log a call the agent refused or never answered; where it says this engine has not mapped
        the pool open now (its agent restarted, or this engine shares another agent's pool that did,
        or started before it), the workers map it again (``ConnectorMeta.reopen``)."""
        if e.code != "not_open":
            log.warning("%s: %s", what, e)
            return
        now = time.monotonic()
        if now >= self._reopen_at:
            self._reopen, self._reopen_at = True, now + REOPEN_EVERY_S
            log.info("%s: the agent's pool is not the one this engine mapped; mapping it again", what)

    def _req(self, req_id: str) -> str:
        return f"{self._engine}:{req_id}"

    def _release(self, req_ids: list[str]) -> None:
        try:
            self._agent.call(Release([self._req(r) for r in req_ids]), Released)
        except LocalError as e:  # the agent restarted: it dropped every pin with its old engine
            log.warning("pool release failed: %s", e)

    # === worker side ===============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._num_blocks(kv_caches)
        first = next(iter(kv_caches.values()))
        # The dimension that indexes blocks: the CPU layout is [blocks, heads, block, 2*head]; some
        # backends put K/V first ([2, blocks, ...]).
        self._block_dim = list(first.shape).index(num_blocks)
        self._layers = {name: i for i, name in enumerate(kv_caches)}
        self._caches = list(kv_caches.values())
        self._copier = BlockCopier.for_caches(self._caches)
        one = first.select(self._block_dim, 0)
        self._geometry = Geometry(len(kv_caches), one.numel() * one.element_size(), self._block_size)
        self._map_pool()

    def _map_pool(self) -> None:
        """Open the agent's pool for this engine's KV geometry and map its arena (None: it computes)."""
        geometry = self._geometry
        try:
            opened = self._agent.call(Open(geometry, self._engine, os.getpid()), Opened)
            self._arena = SlotArena.attach(opened.path, geometry, opened.capacity)
        except (LocalError, OSError, ValueError) as e:
            log.error("no pool for this engine (it computes every prompt): %s", e)
            self._arena = None
            return
        pinned = self._copier.pin(self._arena.buffer)
        log.info(
            "vllm-disagg pool mapped: %s, %d slots, %s, cache on %s%s",
            opened.path,
            opened.capacity,
            geometry,
            self._copier.device,
            " (page-locked)" if pinned else "",
        )

    def _remap_pool(self) -> None:
        """The agent's pool was replaced: let go of the old mapping (what still lands there never will
        for this engine: recomputed) and map the new one."""
        for receive in self._in_receive.abandon():
            self._load_errors.update(receive.block_ids)
            self._in_receive.copying(receive.req_id, FINISHED)
        if self._arena is not None:
            self._copier.unpin()  # once its saves are done: they read from the engine, not the old pool
            self._arena.close()
            self._arena = None
        # Saves still in flight wrote the old pool's slots: committed with no arena, they name no keys
        # (the new pool's slots of those numbers hold other blocks) and only let their reservations go.
        self._commit_saves()
        self._map_pool()

    def _num_blocks(self, kv_caches: dict[str, torch.Tensor]) -> int:
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if isinstance(num_blocks, int) and num_blocks > 0:
            return num_blocks
        return int(next(iter(kv_caches.values())).shape[0])

    def _slot_tensor(self, slot: int, layer: int, like: torch.Tensor) -> torch.Tensor:
        assert self._arena is not None
        raw = torch.frombuffer(self._arena.layer_view(slot, layer), dtype=torch.uint8)
        return raw.view(like.dtype).view(like.shape)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Synchronous loads happen layer by layer in ``wait_for_layer_load`` (vLLM may call this after
        # the forward pass); asynchronous ones are settled in ``get_finished``. Without a pool, every
        # block to load is an error to recompute.
        meta = self._get_connector_metadata()
        self._in_save.finishing(meta.delayed)
        if meta.reopen and self._layers:
            self._remap_pool()
        if self._arena is None:
            for load in (*meta.loads, *meta.receives):
                self._load_errors.update(load.block_ids)
            for load in meta.receives:
                self._in_receive.copying(load.req_id, FINISHED)
            return
        deadline = time.monotonic() + self._load_timeout_s
        for load in meta.receives:
            self._in_receive.add(Receive(load.req_id, load.slots, load.block_ids, deadline))

    def wait_for_layer_load(self, layer_name: str) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads or self._arena is None:
            return
        layer = self._layers[layer_name]
        cache = self._caches[layer]
        pairs = []
        for load in meta.loads:
            for slot, block_id in zip(load.slots, load.block_ids, strict=True):
                if block_id in self._load_errors:
                    continue
                if self._arena.layers_ready(slot) <= layer:  # whole when pinned, so never: but never wrong
                    self._load_errors.add(block_id)
                    continue
                dst = cache.select(self._block_dim, block_id)
                pairs.append((self._slot_tensor(slot, layer, dst), dst))
        self._copier.load(pairs)

    def handle_preemptions(self, kv_connector_metadata: ConnectorMeta) -> None:
        # A preempted request's blocks go to others in this step: its saves must have read them first.
        pending = self._in_save.pending()
        if kv_connector_metadata.preempted and pending:
            self._copier.order_after(pending[-1].done)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        if meta.save is None or self._arena is None:
            return
        layer = self._layers[layer_name]
        pairs = []
        for slot, block_id in zip(meta.save.slots, meta.save.block_ids, strict=True):
            src = kv_layer.select(self._block_dim, block_id)
            pairs.append((src, self._slot_tensor(slot, layer, src)))
        self._copier.save(pairs)

    def wait_for_save(self) -> None:
        # Does not wait: the step's copies are committed once done (``_commit_saves``).
        meta = self._get_connector_metadata()
        if meta.save is not None:
            done = self._copier.saves_done() if self._arena is not None else FINISHED
            save = meta.save
            owner = f"{self._engine}:{meta.step}"
            self._in_save.add(InFlightSave(owner, save.slots, save.keys, frozenset(save.reqs), done))
        self._commit_saves()

    def _commit_saves(self) -> None:
        for save in self._in_save.done():
            keys = list(save.keys)
            if self._arena is None:
                keys = []  # nothing was copied: the commit only lets the reservations go
            else:
                for slot in save.slots:  # every layer's copy is in its slot before the slot says so
                    self._arena.set_layers_ready(slot, len(self._layers))
            try:
                self._agent.call(Commit(save.owner, keys), Committed)
            except LocalError as e:
                log.warning("pool commit failed: %s", e)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._commit_saves()
        self._settle_receives()
        return self._in_save.finished() or None, self._in_receive.finished() or None

    def _settle_receives(self) -> None:
        """Copy in the asynchronous loads whose blocks have landed (or that failed or are late)."""
        arena = self._arena
        if arena is None or not self._in_receive:
            return
        for settled in self._in_receive.decide(arena.layers_ready, len(self._layers), time.monotonic()):
            receive = settled.receive
            if settled.late:
                log.warning(
                    "request %s: %d blocks did not land in %.1f s: recomputing them",
                    receive.req_id,
                    len(settled.failed_blocks),
                    self._load_timeout_s,
                )
            self._load_errors.update(settled.failed_blocks)
            pairs = []
            for layer, cache in enumerate(self._caches):
                for slot, block_id in zip(receive.slots[: settled.loaded], receive.block_ids, strict=False):
                    dst = cache.select(self._block_dim, block_id)
                    pairs.append((self._slot_tensor(slot, layer, dst), dst))
            self._in_receive.copying(receive.req_id, self._copier.load_async(pairs) if pairs else FINISHED)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._agent.close()
        self._copier.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
