"""The simulated engine core: waiting queue, running batch, KV accounting, the step loop.

HTTP lives in ``sim_engine/engine.py``; this module owns the state a real engine core owns (batch, KV
blocks, prefix cache, blocks held for transfer, metrics) and advances it one step at a time, with
every decision taken by ``perf_model``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any

from vllm_disagg.clock import Clock, wait_event
from vllm_disagg.config import SimEngineConfig
from vllm_disagg.errors import NoCapacity
from vllm_disagg.protocol.kv_pool import pool_handle
from vllm_disagg.protocol.messages import POOL_CONNECTOR
from vllm_disagg.sim_engine import perf_model
from vllm_disagg.sim_engine.kv import PrefixCache, PullOutcome, TransferHolds
from vllm_disagg.sim_engine.metrics import EngineMetrics, GaugeValues
from vllm_disagg.sim_engine.openai_api import SimRequest
from vllm_disagg.sim_engine.prompts import PromptInfo
from vllm_disagg.wire.block_hash import prompt_block_hashes
from vllm_disagg.wire.kv_transfer import producer_handle

ABORTED = -1  # queued to a streaming handler when the engine gives up on its request


class Seq:
    """One request inside the engine (mutable; owned by the core)."""

    __slots__ = (
        "arrival",
        "blocks",
        "cached_tokens",
        "done",
        "external_tokens",
        "first_token",
        "kv_params",
        "last_token",
        "produced",
        "prompt",
        "req",
        "scheduled",
        "tokens",
    )

    def __init__(self, req: SimRequest, prompt: PromptInfo, external_tokens: int, arrival: float) -> None:
        self.req = req
        self.prompt = prompt
        self.external_tokens = external_tokens
        self.arrival = arrival
        self.blocks = 0
        self.cached_tokens = 0  # prompt tokens not computed here: local prefix hits and pulled KV
        self.scheduled = arrival
        self.first_token = arrival
        self.last_token = arrival
        self.produced = 0
        self.kv_params: dict[str, Any] | None = None
        self.done: asyncio.Future[None] | None = None
        self.tokens: asyncio.Queue[int] | None = None  # positions as produced, for streaming

    @property
    def finished(self) -> bool:
        """True once every output token exists (or the engine dropped the request)."""
        return self.done is not None and self.done.done()


class EngineCore:
    """The batch, the KV cache and the step loop of one simulated engine."""

    def __init__(self, config: SimEngineConfig, clock: Clock) -> None:
        self.config = config
        self.timing = config.timing
        self.clock = clock
        self.prefix_cache = PrefixCache(config.timing.num_blocks, config.timing.block_size)
        self.holds = TransferHolds(config.timing.block_size, config.kv_lease_s)
        cache_config = {
            "block_size": str(config.timing.block_size),
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(config.timing.num_blocks),
        }
        self.metrics = EngineMetrics(config.model, self.gauges, cache_config=cache_config)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.reserved_blocks = 0
        self.in_flight_now = 0  # zero-delay requests being written out: "running" for scrapers
        self._wakeup = asyncio.Event()
        # Set by the HTTP layer once the listening port is known; they go into kv_transfer_params.
        self.engine_id = config.engine_id
        self.advertised_host = config.host if config.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        self.advertised_port = config.port
        # The engine's KV connector as its agent says it; "vllm-disagg" answers a prefill leg with the
        # project's connector's handle (the prompt's full blocks by key), and holds nothing for a pull.
        self.kv_connector = ""

    # -- state for scrapers ---------------------------------------------------------------------

    def gauges(self) -> GaugeValues:
        """Running, waiting and KV usage now."""
        self.holds.expire(self.clock.monotonic())
        used = self.reserved_blocks + self.holds.held_blocks
        return GaugeValues(
            running=len(self.running) + self.in_flight_now,
            waiting=len(self.waiting),
            kv_cache_usage=min(1.0, used / self.timing.num_blocks),
        )

    # -- accounting shared by both paths --------------------------------------------------------

    def _account_prompt(self, seq: Seq) -> int:
        """Count the prompt's tokens by source; returns how many must be computed."""
        m = self.metrics
        ids, bs = seq.prompt.token_ids, self.timing.block_size
        n = len(ids)
        cached = 0
        if seq.req.remote_prefill is None:
            limit = perf_model.cacheable_blocks(n, bs)
            cached = self.prefix_cache.match(seq.prompt.block_hashes, limit) * bs
            m.prefix_cache_queries += n
            m.prefix_cache_hits += cached
        sources = perf_model.prompt_sources(n, cached, seq.external_tokens)
        seq.cached_tokens = sources.local_cache_hit + sources.external_kv_transfer
        by_source = m.prompt_tokens_by_source
        by_source["local_compute"] += sources.local_compute
        by_source["local_cache_hit"] += sources.local_cache_hit
        by_source["external_kv_transfer"] += sources.external_kv_transfer
        m.prompt_tokens += n
        m.request_prompt_tokens.observe(n)
        m.max_tokens_param.observe(seq.req.max_tokens)
        self.prefix_cache.insert(seq.prompt.block_hashes, ids)
        return sources.local_compute

    def _finish(self, seq: Seq, now: float) -> None:
        """Book a request that produced all its tokens, and hold its blocks if a decoder will pull them."""
        m = self.metrics
        req = seq.req
        n = req.max_tokens
        if req.remote_decode and self.kv_connector == POOL_CONNECTOR:
            # What the project's connector saved in its agent's pool: the prompt's full blocks.
            bs = self.timing.block_size
            seq.kv_params = pool_handle(bs, prompt_block_hashes(seq.prompt.token_ids, bs))
        elif req.remote_decode:
            # The whole prompt, its partial last block included, as vLLM 0.32's NixlConnector moves it.
            block_ids = self.holds.hold(req.request_id, seq.prompt.token_ids, now)
            seq.kv_params = producer_handle(
                block_ids=list(block_ids),
                engine_id=self.engine_id,
                host=self.advertised_host,
                port=self.advertised_port,
                request_id=req.request_id,
                # vLLM 0.32: P's own prefix-cache hits, which D then reports as its cached tokens.
                prefill_cached_tokens=seq.cached_tokens if self.config.prefill_cache_in_handle else None,
            )
        m.request_success["length"] += 1
        m.request_generation_tokens.observe(n)
        m.e2e.observe(now - seq.arrival)
        m.queue_time.observe(seq.scheduled - seq.arrival)
        m.prefill_time.observe(seq.first_token - seq.scheduled)
        decode = seq.last_token - seq.first_token
        m.decode_time.observe(decode)
        if n > 1:
            m.tpot.observe(decode / (n - 1))

    # -- zero-delay path ------------------------------------------------------------------------

    def complete_now(self, seq: Seq) -> None:
        """Run a request start to finish at once: no queue, no step loop, no sleeping."""
        now = self.clock.monotonic()
        seq.scheduled = seq.first_token = seq.last_token = now
        seq.produced = seq.req.max_tokens
        self._account_prompt(seq)
        m = self.metrics
        m.ttft.observe(now - seq.arrival)
        if seq.produced > 1:
            m.itl.observe(0.0, seq.produced - 1)
        m.generation_tokens += seq.produced
        self._finish(seq, now)

    # -- stepped path ---------------------------------------------------------------------------

    def submit(self, seq: Seq) -> None:
        """Queue a request for the step loop; ``seq.done`` resolves when its last token exists."""
        loop = asyncio.get_running_loop()
        seq.done = loop.create_future()
        if seq.req.stream:
            seq.tokens = asyncio.Queue()
        self.waiting.append(seq)
        self._wakeup.set()

    def abort(self, seq: Seq) -> None:
        """Drop a request whose client went away; frees its blocks."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.reserved_blocks -= seq.blocks
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.metrics.request_success["abort"] += 1
        if seq.done is not None and not seq.done.done():
            seq.done.cancel()
        self._wakeup.set()

    def _fail_all(self, error: BaseException) -> None:
        for seq in (*self.running, *self.waiting):
            if seq.done is not None and not seq.done.done():
                seq.done.set_exception(error)
                seq.done.exception()  # retrieved: a handler that already left must not warn
            if seq.tokens is not None:
                seq.tokens.put_nowait(ABORTED)
        self.running.clear()
        self.waiting.clear()
        self.reserved_blocks = 0

    def _admit(self, now: float) -> int:
        """Move requests from the queue into the batch; returns their uncached prompt tokens."""
        self.holds.expire(now)
        free = self.timing.num_blocks - self.reserved_blocks - self.holds.held_blocks
        bs = self.timing.block_size
        needs: list[int] = []
        for seq in self.waiting:  # the pure admit() stops at the first misfit; look no further ahead
            if len(needs) >= self.timing.max_num_seqs:
                break
            needs.append(perf_model.blocks_needed(len(seq.prompt.token_ids), seq.req.max_tokens, bs))
        count = perf_model.admit(needs, len(self.running), free, self.timing.max_num_seqs)
        prefill_tokens = 0
        for need in needs[:count]:
            seq = self.waiting.popleft()
            seq.blocks = need
            seq.scheduled = now
            self.reserved_blocks += need
            prefill_tokens += self._account_prompt(seq)
            self.running.append(seq)
        return prefill_tokens

    def _emit(self, now: float) -> None:
        """Every running request gets its next token; finished ones leave the batch."""
        m = self.metrics
        still: list[Seq] = []
        for seq in self.running:
            pos = seq.produced
            seq.produced = pos + 1
            if pos == 0:
                seq.first_token = now
                m.ttft.observe(now - seq.arrival)
            else:
                m.itl.observe(now - seq.last_token)
            seq.last_token = now
            m.generation_tokens += 1
            if seq.produced >= seq.req.max_tokens:
                self.reserved_blocks -= seq.blocks
                self._finish(seq, now)
                if seq.done is not None and not seq.done.done():
                    seq.done.set_result(None)
            else:
                still.append(seq)
            if seq.tokens is not None:
                seq.tokens.put_nowait(pos)
        self.running = still

    async def run(self) -> None:
        """The step loop: admit, sleep for the step's modelled duration, hand out one token each."""
        try:
            while True:
                now = self.clock.monotonic()
                prefill_tokens = self._admit(now)
                if not self.running:
                    await self._idle(now)
                    continue
                duration = perf_model.step_duration(self.timing, prefill_tokens, len(self.running))
                # sleep(0) still yields, so a zero-cost step cannot starve the HTTP handlers.
                await self.clock.sleep(duration)
                self._emit(self.clock.monotonic())
        except asyncio.CancelledError:
            self._fail_all(NoCapacity("the engine is shutting down"))
            raise

    async def _idle(self, now: float) -> None:
        """Wait for a new request, a freed block, or the next lease to end while requests wait."""
        self._wakeup.clear()
        timeout: float | None = None
        if self.waiting:
            deadline = self.holds.next_deadline()
            if deadline is not None:
                timeout = max(0.0, deadline - now)
        await wait_event(self.clock, self._wakeup, timeout)

    # -- KV side channel ------------------------------------------------------------------------

    def serve_pull(self, block_ids: Sequence[int], request_id: str | None) -> PullOutcome:
        """A decoder takes held blocks; freed capacity may let waiting requests in."""
        outcome = self.holds.pull(block_ids, request_id, self.clock.monotonic())
        if outcome.token_ids is not None:
            self.metrics.sim_kv_pulls_served += len(block_ids)
            self._wakeup.set()
        return outcome
