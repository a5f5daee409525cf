"""One simulated vLLM engine on virtual time: a waiting queue, continuous batching, KV blocks, a prefix
cache, and KV held for decode engines.

It follows the real-time simulated engine (``vllm_disagg.sim_engine.core``) step for step, so that the two
agree (``tests/integration/cluster_sim/test_fidelity.py``): a step admits what fits (FCFS, blocks for
prompt and output reserved), prefills, and ends with one token for every request whose prompt is
done; a request leaves with its last token. Beyond it: chunked prefill (``max_batched_tokens``) and
context-dependent step costs (``EngineProfile``).

Cost is per step and per request, never per token: a request's finishing step is known when its
first token appears, so the batch is a heap of finishing steps.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_disagg.cluster_sim.profile import EngineProfile
from vllm_disagg.cluster_sim.virtual_clock import EventLoop
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.protocol.messages import KvEvent, MetricsSnapshot
from vllm_disagg.sim_engine import perf_model
from vllm_disagg.sim_engine.kv import PrefixCache

KvSink = Callable[[str, list[KvEvent]], None]  # (agent id, events): what the agent would forward
_LEASE_S = 30.0  # vLLM's kv_lease_duration: held KV no decode engine pulled is freed after this
_legs = itertools.count()


class Leg:
    """One request on one engine (owned by the engine while it is there)."""

    __slots__ = (
        "admitted_at",
        "arrived_at",
        "blocks",
        "cached",
        "compute_left",
        "external",
        "first_at",
        "first_step",
        "hold",
        "max_tokens",
        "no",
        "on_done",
        "on_fail",
        "on_first",
        "prompt_len",
        "request_id",
        "tokens",
    )

    def __init__(
        self,
        request_id: str,
        tokens: PromptTokens,
        max_tokens: int,
        *,
        external: int = 0,
        hold: bool = False,
        on_first: Callable[[Leg, float], None] | None = None,
        on_done: Callable[[Leg, float], None] | None = None,
        on_fail: Callable[[Leg, int], None] | None = None,
    ) -> None:
        self.no = next(_legs)
        self.request_id = request_id
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.max_tokens = max_tokens
        self.external = external  # prompt tokens whose KV arrived from a prefill engine
        self.hold = hold  # a prefill leg: keep the prompt's KV for a decode engine
        self.on_first, self.on_done, self.on_fail = on_first, on_done, on_fail
        self.arrived_at = self.admitted_at = self.first_at = 0.0
        self.blocks = self.cached = self.compute_left = 0
        self.first_step = -1  # the step at whose end its first token appears; -1: prefilling


@dataclass(slots=True)
class _Window:
    """Running sums of what finished over the last ``window_s`` (the agent's scrape window)."""

    window_s: float
    items: deque[tuple[float, float, float, float, int, int, float]]
    sums: list[float]

    def add(
        self, at: float, ttft: float, tpot: float, queue: float, prompt: int, computed: int, prefill: float
    ) -> None:
        row = (at, ttft, tpot, queue, prompt, computed, prefill)
        self.items.append(row)
        for i in range(1, 7):
            self.sums[i] += row[i]

    def prune(self, now: float) -> int:
        items, sums = self.items, self.sums
        while items and items[0][0] < now - self.window_s:
            row = items.popleft()
            for i in range(1, 7):
                sums[i] -= row[i]
        return len(items)


class Engine:
    """A simulated engine; ``submit`` legs, read ``snapshot`` for heartbeats, ``kill`` and ``revive``."""

    def __init__(
        self, agent_id: str, profile: EngineProfile, loop: EventLoop, kv_sink: KvSink | None = None
    ) -> None:
        self.agent_id = agent_id
        self.profile = profile
        self.loop = loop
        self.alive = True
        self.epoch = 0  # bumped by kill: events of an older epoch are stale
        self.waiting: deque[Leg] = deque()
        self.running: dict[int, Leg] = {}
        self._prefilling: deque[Leg] = deque()
        self._decoding: list[tuple[int, int, Leg]] = []  # (finishing step, leg no, leg)
        self._starting: list[Leg] = []  # first token at the end of the step under way
        self.steps = 0  # steps ended
        self._stepping = False
        self.reserved = 0
        self.held: dict[str, int] = {}  # request id -> blocks kept for its decode engine
        self.held_blocks = 0
        self._context = 0  # context tokens of the batch (prompt + output so far)
        self._sink = kv_sink
        self.cache = PrefixCache(profile.num_blocks, profile.block_size)
        if kv_sink is not None:
            self.cache.listener = _Forwarder(agent_id, profile.block_size, kv_sink)
        self._window = _Window(10.0, deque(), [0.0] * 7)
        # Lifetime counters, as vLLM's /metrics has them.
        self.finished = 0
        self.generated = 0
        self.prompt_tokens = 0
        self.computed_tokens = 0
        self.cached_tokens = 0
        self.external_tokens = 0
        self.busy_s = 0.0
        # KV pulled in (NIXL's counters): None where not modelled (``network.Network.start``).
        self.kv_in_bytes: float | None = None
        self.kv_in_seconds: float | None = None

    # --- requests --------------------------------------------------------------------------------

    def submit(self, leg: Leg) -> None:
        """Queue a leg; it is admitted at the next step's start."""
        leg.arrived_at = self.loop.clock.now
        self.waiting.append(leg)
        if not self._stepping:
            self._stepping = True
            self.loop.at(self.loop.clock.now, self._step_starter(self.epoch))

    def release_hold(self, request_id: str) -> None:
        """The decode engine pulled (or will never pull) the KV kept for ``request_id``."""
        blocks = self.held.pop(request_id, 0)
        self.held_blocks -= blocks
        if blocks and self.waiting and not self._stepping:  # freed room may let a waiting leg in
            self._stepping = True
            self.loop.at(self.loop.clock.now, self._step_starter(self.epoch))

    def produced(self, leg: Leg) -> int:
        """Output tokens ``leg`` has so far."""
        return 0 if leg.first_step < 0 else max(0, self.steps - leg.first_step)

    # --- the step loop ---------------------------------------------------------------------------

    def _step_starter(self, epoch: int) -> Callable[[], None]:
        return lambda: self._start_step() if epoch == self.epoch else None

    def _start_step(self) -> None:
        now = self.loop.clock.now
        self._admit(now)
        if not self.running:
            self._stepping = False
            return
        prefill_tokens, prefill_context = self._prefill()
        p = self.profile
        duration = p.step_s(prefill_tokens, prefill_context, len(self.running), self._context)
        self.busy_s += duration
        epoch = self.epoch
        self.loop.at(now + duration, lambda: self._end_step() if epoch == self.epoch else None)

    def _admit(self, now: float) -> None:
        p = self.profile
        bs = p.block_size
        free = p.num_blocks - self.reserved - self.held_blocks
        while self.waiting and len(self.running) < p.max_num_seqs:
            leg = self.waiting[0]
            need = perf_model.blocks_needed(leg.prompt_len, leg.max_tokens, bs)
            if need > free:
                break  # FCFS: the head blocks the rest, as in vLLM
            self.waiting.popleft()
            free -= need
            leg.blocks, leg.admitted_at = need, now
            self.reserved += need
            self.running[leg.no] = leg
            self._context += leg.prompt_len
            self._account(leg)
            if leg.compute_left:
                self._prefilling.append(leg)
            else:
                self._starting.append(leg)

    def _account(self, leg: Leg) -> None:
        """Split the prompt into KV pulled, found in the prefix cache, and to compute (``sim.core``)."""
        n, bs = leg.prompt_len, self.profile.block_size
        cached = 0
        keys = leg.tokens.block_keys(bs)
        if not leg.external:
            cached = self.cache.match(keys, perf_model.cacheable_blocks(n, bs)) * bs
        leg.cached = cached
        leg.compute_left = n - cached - leg.external
        self.cache.insert(keys, leg.tokens)
        self.prompt_tokens += n
        self.cached_tokens += cached
        self.external_tokens += leg.external
        self.computed_tokens += leg.compute_left

    def _prefill(self) -> tuple[int, int]:
        """Prompt tokens computed this step (within the chunk budget) and the context they attend to."""
        budget = self.profile.max_batched_tokens or 1 << 62
        tokens = context = 0
        while self._prefilling and budget > 0:
            leg = self._prefilling[0]
            chunk = min(leg.compute_left, budget)
            done = leg.prompt_len - leg.compute_left
            context += chunk * (done + done + chunk) // 2
            tokens += chunk
            budget -= chunk
            leg.compute_left -= chunk
            if leg.compute_left:
                break  # the budget ran out inside this prompt
            self._prefilling.popleft()
            self._starting.append(leg)
        return tokens, context

    def _end_step(self) -> None:
        now = self.loop.clock.now
        k = self.steps
        self.steps = k + 1
        emitting = len(self._decoding) + len(self._starting)
        self._context += emitting
        self.generated += emitting
        firsts, self._starting = self._starting, []
        for leg in firsts:
            leg.first_step, leg.first_at = k, now
            heapq.heappush(self._decoding, (k + leg.max_tokens - 1, leg.no, leg))
        done: list[Leg] = []
        while self._decoding and self._decoding[0][0] <= k:
            done.append(heapq.heappop(self._decoding)[2])
        for leg in done:
            self._finish(leg, now)
        if self.running or self.waiting:
            self._start_step()
        else:
            self._stepping = False
        for leg in firsts:
            if leg.on_first is not None:
                leg.on_first(leg, now)
        for leg in done:
            if leg.on_done is not None:
                leg.on_done(leg, now)

    def _finish(self, leg: Leg, now: float) -> None:
        del self.running[leg.no]
        self.reserved -= leg.blocks
        self._context -= leg.prompt_len + leg.max_tokens
        self.finished += 1
        n = leg.max_tokens
        tpot = (now - leg.first_at) / (n - 1) if n > 1 else 0.0
        self._window.add(
            now,
            leg.first_at - leg.arrived_at,
            tpot,
            leg.admitted_at - leg.arrived_at,
            leg.prompt_len,
            leg.prompt_len - leg.cached - leg.external,
            leg.first_at - leg.admitted_at,
        )
        if leg.hold:
            blocks = -(-leg.prompt_len // self.profile.block_size)
            self.held[leg.request_id] = self.held.get(leg.request_id, 0) + blocks
            self.held_blocks += blocks
            rid, epoch = leg.request_id, self.epoch
            self.loop.after(_LEASE_S, lambda: self.release_hold(rid) if epoch == self.epoch else None)

    # --- faults ----------------------------------------------------------------------------------

    def kill(self) -> None:
        """The engine dies: every leg on it fails (with the tokens it had produced), its cache is gone."""
        self.alive = False
        self.epoch += 1
        legs = [*self.running.values(), *self.waiting]
        produced = {leg.no: self.produced(leg) for leg in legs}
        self.waiting.clear()
        self.running.clear()
        self._prefilling.clear()
        self._decoding.clear()
        self._starting.clear()
        self.held.clear()
        self.reserved = self.held_blocks = self._context = 0
        self._stepping = False
        self.cache = PrefixCache(self.profile.num_blocks, self.profile.block_size)
        for leg in legs:
            if leg.on_fail is not None:
                leg.on_fail(leg, produced[leg.no])

    def revive(self) -> None:
        """A new engine in its place: empty, listening again."""
        self.alive = True
        self.epoch += 1
        if self._sink is not None:
            self.cache.listener = _Forwarder(self.agent_id, self.profile.block_size, self._sink)

    # --- what the agent would scrape -------------------------------------------------------------

    def snapshot(self, now: float) -> MetricsSnapshot:
        """The heartbeat's metrics: gauges now, averages over the window, lifetime counters."""
        w = self._window
        n = w.prune(now)
        s = w.sums
        return MetricsSnapshot(
            scraped_at=now,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=min(1.0, (self.reserved + self.held_blocks) / self.profile.num_blocks),
            ttft_s=s[1] / n if n else None,
            tpot_s=s[2] / n if n else None,
            queue_s=s[3] / n if n else None,
            mean_prompt_tokens=s[4] / n if n else None,
            prefill_tokens_per_s=s[5] / s[6] if n and s[6] > 0 else None,
            window_s=w.window_s,
            requests_finished=self.finished,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generated,
            prompt_tokens_computed=self.computed_tokens,
            prompt_tokens_cached=self.cached_tokens,
            prompt_tokens_transferred=self.external_tokens,
            kv_in_bytes=self.kv_in_bytes,
            kv_in_seconds=self.kv_in_seconds,
        )


class _Forwarder:
    """The prefix cache's listener: its changes as the agent would forward them (``KvEvents``)."""

    __slots__ = ("_agent_id", "_block_size", "_sink")

    def __init__(self, agent_id: str, block_size: int, sink: KvSink) -> None:
        self._agent_id, self._block_size, self._sink = agent_id, block_size, sink

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int]) -> None:
        event = KvEvent("stored", list(hashes), parent, list(token_ids), self._block_size)
        self._sink(self._agent_id, [event])

    def removed(self, hashes: Sequence[int]) -> None:
        self._sink(self._agent_id, [KvEvent("removed", list(hashes))])

    def cleared(self) -> None:
        self._sink(self._agent_id, [KvEvent("cleared")])
