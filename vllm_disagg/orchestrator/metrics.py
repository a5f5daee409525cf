"""Prometheus metrics of one orchestrator, on its own ``CollectorRegistry`` (never the global one).

Request metrics are recorded by the gateway through pre-bound label children, so the hot path does
one dict lookup per metric. Per-instance gauges are not stored at all: a custom collector
(``state/gauges.py``) reads a registry snapshot at scrape time. Every metric is documented in docs/metrics.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from vllm_disagg.orchestrator.state.gauges import InstanceCollector
from vllm_disagg.orchestrator.state.kv_audit import Outcome
from vllm_disagg.orchestrator.state.views import RegistrySnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST

# LLM requests run from milliseconds (a cached prefill) to minutes (long generations).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# The gateway's own work per request: the target is well under a millisecond.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# A role change: routing alone takes milliseconds, a restart of vLLM seconds to minutes.
_ROLE_CHANGE_BUCKETS = (0.001, 0.01, 0.1, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

Leg = str  # "prefill" | "decode"


class _Bound(dict[tuple[object, ...], Any]):
    """Label children by their label values, bound on first use; every later use is a plain dict hit
    (``labels()`` takes a lock and builds tuples)."""

    def __init__(self, metric: MetricWrapperBase) -> None:
        super().__init__()
        self._metric = metric

    def __missing__(self, key: tuple[object, ...]) -> Any:
        child = self[key] = self._metric.labels(*map(str, key))
        return child


class OrchestratorMetrics:
    """The orchestrator's metrics and the cheap recording calls the gateway and control plane use."""

    def __init__(
        self,
        snapshot: Callable[[], RegistrySnapshot],
        kv_blocks: Callable[[str], int] | None = None,
        *,
        instances: bool = True,
        pool_blocks: Callable[[str], int] | None = None,
    ) -> None:
        """``kv_blocks(agent_id)``: the KV index's blocks of an instance, read at scrape time (and
        ``pool_blocks``, of its agent's pool).
        ``instances``: export the per-instance gauges (a gateway worker leaves them to the
        orchestrator, whose registry they describe)."""
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._declare_requests(r)
        self._declare_overheads(r)
        self._declare_failures(r)
        self._declare_kv_audit(r)
        self._declare_control(r)
        self._declare_kv_events(r)
        self._declare_kv_moves(r)
        self._instances = InstanceCollector(snapshot, kv_blocks, pool_blocks) if instances else None
        self._request_children = _Bound(self._requests)
        self._duration_children = _Bound(self._duration)
        self._refused_children = _Bound(self._refused)
        self._upstream_children = _Bound(self._upstream_errors)
        self._retry_children = _Bound(self._retries)
        self._fallback_children = _Bound(self._fallbacks)
        self._resume_children = _Bound(self._resumes)
        self._not_resumable_children = _Bound(self._not_resumable)
        self._kv_events_children = _Bound(self._kv_events)
        self._kv_missed_children = _Bound(self._kv_missed)

    def _declare_requests(self, r: CollectorRegistry) -> None:
        """Requests, their legs and the latencies their clients saw."""
        self._requests = Counter(
            "vllm_disagg_requests",
            "Client requests finished by the gateway",
            ["route", "mode", "status"],
            registry=r,
        )
        self._duration = Histogram(
            "vllm_disagg_request_duration_seconds",
            "Client request duration, from arrival to the last byte sent",
            ["route", "mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._prefill = Histogram(
            "vllm_disagg_prefill_leg_seconds",
            "Prefill leg duration: POST to the prefill engine until its response is read",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._ttfb = Histogram(
            "vllm_disagg_time_to_first_byte_seconds",
            "From a request's arrival to the first body byte of the decode engine's response",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._transfer_window = Histogram(
            "vllm_disagg_kv_transfer_window_seconds",
            "A streamed disaggregated request: from the end of its prefill leg to D's first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._decode_first = Histogram(
            "vllm_disagg_decode_first_token_seconds",
            "A stream's decode leg alone: from its start to its first token (TTFT of the decode leg)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._tpot = Histogram(
            "vllm_disagg_time_per_output_token_seconds",
            "A stream's time per output token after the first, as its client saw it (resumes included)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )

    def _declare_overheads(self, r: CollectorRegistry) -> None:
        """The gateway's own time: queueing, scheduling, handoff, tokenization, event-loop lag."""
        self._queue = Histogram(
            "vllm_disagg_queue_seconds",
            "From a request's arrival to the start of its first engine leg (the gateway's own wait)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._loop_lag = Histogram(
            "vllm_disagg_event_loop_lag_seconds",
            "How much later than due the orchestrator's event loop woke a task (sampled every 0.1 s)",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self._schedule = Histogram(
            "vllm_disagg_schedule_seconds",
            "From a request's arrival to its scheduling decision (body read, parsed, P and D picked)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._handoff = Histogram(
            "vllm_disagg_kv_handoff_seconds",
            "From the end of a prefill leg to the start of its decode leg (the KV handle's way to D)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._overhead = Histogram(
            "vllm_disagg_gateway_overhead_seconds",
            "Request duration minus time spent waiting on engines (parsing, scheduling, relaying)",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._tokenize = Histogram(
            "vllm_disagg_tokenize_seconds",
            "Tokenizations run on the tokenize worker thread (Hugging Face cache misses), work only",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._tokenize_full = Counter(
            "vllm_disagg_tokenize_queue_full",
            "Requests scheduled on a prompt-length estimate because the tokenize worker's queue was full",
            registry=r,
        )
        self._tokenize_depth = Gauge(
            "vllm_disagg_tokenize_queue_depth",
            "Distinct tokenizations waiting for or running on the tokenize worker thread",
            registry=r,
        )

    def _declare_failures(self, r: CollectorRegistry) -> None:
        """What failed, and how the gateway recovered (retries, fallbacks, resumes)."""
        self._kv_warmups = Counter(
            "vllm_disagg_kv_link_warmups",
            "Warm-up requests over a fresh engine's KV link before it is routed to, by outcome (ok, failed)",
            ["outcome"],
            registry=r,
        )
        self._refused = Counter(
            "vllm_disagg_protocol_refused",
            "Refuse messages sent to agents, by code",
            ["code"],
            registry=r,
        )
        self._upstream_errors = Counter(
            "vllm_disagg_upstream_errors",
            "Failed engine legs, by leg (prefill, decode) and kind (connect, timeout, status, "
            "invalid_response, disconnect, lost, rejected)",
            ["leg", "kind"],
            registry=r,
        )
        self._retries = Counter(
            "vllm_disagg_retries",
            "Engine legs tried again on another instance after a failure, by leg and cause",
            ["leg", "cause"],
            registry=r,
        )
        self._fallbacks = Counter(
            "vllm_disagg_fallbacks",
            "Requests run colocated on their decode instance because no prefill leg succeeded, by cause",
            ["cause"],
            registry=r,
        )
        self._resumes = Counter(
            "vllm_disagg_resumes",
            "Streams resumed on another instance after their decode engine failed mid-stream, by cause",
            ["cause"],
            registry=r,
        )
        self._not_resumable = Counter(
            "vllm_disagg_streams_not_resumable",
            "Resumable streams relayed without a way to resume them: their decode engine says no token "
            "ids (no_token_ids), its events left them out (ids_missing), or, once cut, no instance left "
            "could take them over (no_resumer)",
            ["reason"],
            registry=r,
        )
        self._unread_events = Counter(
            "vllm_disagg_stream_events_unread",
            "Events of a decode engine's stream the gateway could not read (not JSON, not a chunk), "
            "passed on to the client as they came",
            registry=r,
        )
        self._connections_closed = Counter(
            "vllm_disagg_client_connections_closed",
            "Client connections the gateway's server closed on a limit, by reason (head_timeout, "
            "body_timeout, write_timeout, cap)",
            ["reason"],
            registry=r,
        )

    def _declare_kv_audit(self, r: CollectorRegistry) -> None:
        """The KV handoff's audit: prompts decode engines computed although a prefill sent them."""
        self._kv_recomputed = Counter(
            "vllm_disagg_kv_recomputed",
            "Decode legs that computed the prompt themselves instead of loading the prefill's KV, by pair",
            ["prefill", "decode"],
            registry=r,
        )
        self._kv_recomputed_tokens = Counter(
            "vllm_disagg_kv_recomputed_tokens",
            "Prompt tokens decode engines computed although a prefill handed their KV over, by pair "
            "(from the engines' prompt_tokens_by_source counters)",
            ["prefill", "decode"],
            registry=r,
        )
        self._kv_audited = Counter(
            "vllm_disagg_kv_audited_legs",
            "Decode legs the KV audit judged from the engine's prompt_tokens_by_source counters, by "
            "outcome: loaded, or recomputed (a leg among those a shortfall was found in)",
            ["decode", "outcome"],
            registry=r,
        )

    def _declare_control(self, r: CollectorRegistry) -> None:
        """Role changes, SLO outcomes and the planner."""
        self._role_changes = Counter(
            "vllm_disagg_role_changes",
            "Instances that changed role while serving, by instance and the roles from and to",
            ["instance", "from_role", "to_role"],
            registry=r,
        )
        self._role_change_seconds = Histogram(
            "vllm_disagg_role_change_seconds",
            "A role change from its request to the instance serving the new role, by how (routing, restart)",
            ["how"],
            buckets=_ROLE_CHANGE_BUCKETS,
            registry=r,
        )
        self._slo_requests = Counter(
            "vllm_disagg_slo_requests",
            "Requests with latency targets (x-slo-ttft-ms, x-slo-tpot-ms or the defaults), by target "
            "class and outcome (met, missed, unmeasured, failed)",
            ["slo", "outcome"],
            registry=r,
        )
        self._slo_best_effort = Counter(
            "vllm_disagg_slo_best_effort",
            "Requests served although no pair was predicted to meet their targets, by target class",
            ["slo"],
            registry=r,
        )
        self._planner_suggested = Gauge(
            "vllm_disagg_planner_suggested_instances",
            "Instances the planner would give each role for the load of its window (the P:D ratio)",
            ["role"],
            registry=r,
        )
        self._planner_pressure = Gauge(
            "vllm_disagg_planner_pressure",
            "Each pool's p90 over its target (prefill: TTFT, decode: TPOT); NaN with too few requests",
            ["pool"],
            registry=r,
        )
        self._replica = Gauge(
            "vllm_disagg_replica",
            "A replica of many (--etcd): leader (1: it leads), epoch (of the leader it knows), etcd_up "
            "(1: its last etcd call succeeded), leader_actions_paused (1: no leader can act now), peers",
            ["what"],
            registry=r,
        )
        self._planner_shifts = Counter(
            "vllm_disagg_planner_shifts",
            "Role shifts the planner decided, by pools and outcome (done, failed, dry_run)",
            ["from_role", "to_role", "outcome"],
            registry=r,
        )

    def _declare_kv_events(self, r: CollectorRegistry) -> None:
        """KV events from agents: applied, lost, dropped at the index's limits."""
        self._kv_events = Counter(
            "vllm_disagg_kv_events",
            "KV-cache events from the instance's agent applied to the KV index",
            ["instance"],
            registry=r,
        )
        self._kv_missed = Counter(
            "vllm_disagg_kv_events_missed",
            "Engine KV event batches the instance's agent reported lost (sequence gaps, full buffer)",
            ["instance"],
            registry=r,
        )
        help_ = "Blocks of KV events from the instance's agent beyond its limits, not indexed (by reason)"
        self._kv_dropped = Counter(
            "vllm_disagg_kv_events_dropped", help_, ["instance", "medium", "reason"], registry=r
        )

    def _declare_kv_moves(self, r: CollectorRegistry) -> None:
        """KV releases and the moves between the agents' pools."""
        self._kv_released = Counter(
            "vllm_disagg_kv_released",
            "One-token decodes sent to free a prefill's KV after its client left (see docs/operations.md)",
            registry=r,
        )
        self._kv_release_failures = Counter(
            "vllm_disagg_kv_release_failures",
            "One-token KV-freeing decodes that failed: the prefill's KV stays held until its lease ends",
            ["cause"],
            registry=r,
        )
        self._pool_transfers = Counter(
            "vllm_disagg_kv_pool_transfers",
            "Moves of a prompt's KV blocks from one agent's pool to another's that the gateway asked for "
            "(kv_grant, then kv_fetch), by path: handoff (after a prefill leg) or direct (straight to "
            "decode)",
            ["path"],
            registry=r,
        )
        self._pool_failures = Counter(
            "vllm_disagg_kv_pool_transfer_failures",
            "KV pool moves that failed (the decode engine computes what it lacks; the request goes on), "
            "by path and reason",
            ["path", "reason"],
            registry=r,
        )
        self._pool_blocks = Counter(
            "vllm_disagg_kv_pool_transfer_blocks",
            "Blocks of started KV pool moves, by outcome: reserved (the receiving agent fetches them) or "
            "already_held (its pool had them)",
            ["outcome"],
            registry=r,
        )
        self._pool_direct = Counter(
            "vllm_disagg_kv_pool_direct_requests",
            "Requests sent straight to a decode instance because an agent's KV pool held the whole prompt, "
            "by source: own (the decode instance's pool) or peer (fetched from another agent's)",
            ["source"],
            registry=r,
        )

    def request_done(
        self,
        route: str,
        mode: str,
        status: int,
        total_s: float,
        engine_s: float,
        prefill_s: float | None,
        ttfb_s: float | None,
        *,
        schedule_s: float | None = None,
        handoff_s: float | None = None,
        queue_s: float | None = None,
        tpot_s: float | None = None,
        transfer_window_s: float | None = None,
        decode_first_s: float | None = None,
    ) -> None:
        """Record one finished client request (``mode``: disaggregated, colocated, fallback, none)."""
        self._request_children[route, mode, status].inc()
        self._duration_children[route, mode].observe(total_s)
        self._overhead.observe(max(0.0, total_s - engine_s))
        if schedule_s is not None:
            self._schedule.observe(schedule_s)
        if queue_s is not None:
            self._queue.observe(queue_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)
        if handoff_s is not None:
            self._handoff.observe(handoff_s)
        if prefill_s is not None:
            self._prefill.observe(prefill_s)
        if ttfb_s is not None:
            self._ttfb.observe(ttfb_s)
        if transfer_window_s is not None:
            self._transfer_window.observe(transfer_window_s)
        if decode_first_s is not None:
            self._decode_first.observe(decode_first_s)

    def refused(self, code: str) -> None:
        """Count a Refuse sent to an agent."""
        self._refused_children[(code,)].inc()

    def upstream_error(self, leg: Leg, kind: str) -> None:
        """Count a failed engine leg."""
        self._upstream_children[leg, kind].inc()

    def retry(self, leg: Leg, cause: str) -> None:
        """Count a leg tried again elsewhere."""
        self._retry_children[leg, cause].inc()

    def role_changed(self, agent_id: str, old: str, new: str, how: str, seconds: float) -> None:
        """Count an instance's change of role, and how long it took (``how``: routing or restart)."""
        self._role_changes.labels(agent_id, old, new).inc()
        self._role_change_seconds.labels(how).observe(seconds)

    def slo_request(self, slo: str, outcome: str) -> None:
        """Count a request with latency targets by its class and whether it met them."""
        self._slo_requests.labels(slo, outcome).inc()

    def slo_best_effort(self, slo: str) -> None:
        """Count a request no sampled pair was predicted to serve within its targets."""
        self._slo_best_effort.labels(slo).inc()

    def planner_looked(self, ratio: tuple[int, int], pressures: tuple[float | None, float | None]) -> None:
        """The planner's suggested split and the pools' pressures at its last look."""
        self._planner_suggested.labels("prefill").set(ratio[0])
        self._planner_suggested.labels("decode").set(ratio[1])
        for pool, value in zip(("prefill", "decode"), pressures, strict=True):
            self._planner_pressure.labels(pool).set(math.nan if value is None else value)

    def replica(self, *, leader: bool, epoch: int, etcd_up: bool, paused: bool, peers: int) -> None:
        """This replica's view of the election and its links (only replicas set it)."""
        figures = {"leader": leader, "epoch": epoch, "etcd_up": etcd_up, "leader_actions_paused": paused}
        for what, value in {**figures, "peers": peers}.items():
            self._replica.labels(what).set(float(value))

    def planner_shift(self, from_role: str, to_role: str, outcome: str) -> None:
        """Count a shift the planner decided, and what became of it."""
        self._planner_shifts.labels(from_role, to_role, outcome).inc()

    def fallback(self, cause: str) -> None:
        """Count a request run colocated after its prefill legs failed."""
        self._fallback_children[(cause,)].inc()

    def resume(self, cause: str) -> None:
        """Count a stream resumed on another instance."""
        self._resume_children[(cause,)].inc()

    def stream_not_resumable(self, reason: str) -> None:
        """Count a resumable stream that could not have been resumed (``Flow.relay_outcome``)."""
        self._not_resumable_children[(reason,)].inc()

    def stream_events_unread(self, n: int) -> None:
        """Count events passed on unread."""
        self._unread_events.inc(n)

    def client_connection_closed(self, reason: str) -> None:
        """Count a client connection closed on a limit (``listener.GatewayServer``'s deadlines and cap)."""
        self._connections_closed.labels(reason).inc()

    def kv_recomputed(self, prefill: str, decode: str, tokens: int) -> None:
        """Count a decode leg that recomputed ``tokens`` of the prompt instead of loading their KV."""
        self._kv_recomputed.labels(prefill, decode).inc()
        self._kv_recomputed_tokens.labels(prefill, decode).inc(tokens)

    def kv_audited(self, outcome: Outcome) -> None:
        """Count the legs a KV audit judged; a verdict once per pair, its tokens shared by what each
        pair handed over."""
        if outcome.loaded:
            self._kv_audited.labels(outcome.decode, "loaded").inc(len(outcome.loaded))
        verdict = outcome.recomputed
        if verdict is None:
            return
        legs = verdict.legs
        self._kv_audited.labels(verdict.decode, "recomputed").inc(len(legs))
        handed = sum(leg.tokens for leg in legs) or 1
        for prefill in verdict.prefills:
            share = sum(leg.tokens for leg in legs if leg.prefill == prefill) / handed
            self._kv_recomputed.labels(prefill, verdict.decode).inc()
            self._kv_recomputed_tokens.labels(prefill, verdict.decode).inc(round(verdict.tokens * share))

    def kv_released(self) -> None:
        """Count a one-token decode that freed an abandoned prefill's KV."""
        self._kv_released.inc()

    def loop_lag(self, seconds: float) -> None:
        """Record how late the event loop woke a task that was due."""
        self._loop_lag.observe(seconds)

    def tokenize_done(self, seconds: float) -> None:
        """Record one tokenization the worker thread ran."""
        self._tokenize.observe(seconds)

    def tokenize_queue_full(self) -> None:
        """Count a request scheduled without exact tokens: the tokenize worker's queue was full."""
        self._tokenize_full.inc()

    def tokenize_queue_depth(self, depth: int) -> None:
        """Set the tokenize worker's queue depth (waiting and running)."""
        self._tokenize_depth.set(depth)

    def kv_release_failed(self, cause: str) -> None:
        """Count a KV-freeing decode that failed (``status``, ``transport`` or ``lost``)."""
        self._kv_release_failures.labels(cause).inc()

    def kv_pool_transfer(self, path: str) -> None:
        """Count a KV pool move asked for (``path``: handoff or direct)."""
        self._pool_transfers.labels(path).inc()

    def kv_pool_transfer_failed(self, path: str, reason: str) -> None:
        """Count a KV pool move that failed, by ``kv_moves.REASONS``."""
        self._pool_failures.labels(path, reason).inc()

    def kv_pool_blocks(self, reserved: int, already_held: int) -> None:
        """Count the blocks of a started move."""
        self._pool_blocks.labels("reserved").inc(reserved)
        self._pool_blocks.labels("already_held").inc(already_held)

    def kv_pool_direct(self, source: str) -> None:
        """Count a request sent straight to decode from a KV pool (``source``: own or peer)."""
        self._pool_direct.labels(source).inc()

    def kv_events(self, agent_id: str, applied: int, missed: int) -> None:
        """Count one ``KvEvents`` message from an instance's agent (both series appear with the first)."""
        self._kv_events_children[(agent_id,)].inc(applied)
        self._kv_missed_children[(agent_id,)].inc(missed)

    def kv_link_warmup(self, outcome: str) -> None:
        """Count a warm-up request over a fresh engine's KV link (``kv_warmup``): ``ok`` or ``failed``."""
        self._kv_warmups.labels(outcome).inc()

    def kv_events_dropped(self, agent_id: str, medium: str, reason: str, blocks: int) -> None:
        """Count an instance's blocks of KV events the index's limits dropped (``state/kv_limits.py``)."""
        self._kv_dropped.labels(agent_id, medium, reason).inc(blocks)

    def families(self) -> list[Metric]:
        """This process's gateway and control metrics (not the per-instance gauges)."""
        return list(self.registry.collect())

    def render(self, workers: Sequence[tuple[int, list[Metric]]] = ()) -> bytes:
        """The text exposition of every metric. ``workers``: the gateway workers' ``families()``;
        then each gateway metric's series carry a ``worker`` label (this process's are worker 0)."""
        families = merge_families([(0, self.families()), *workers]) if workers else self.families()
        if self._instances is not None:
            families.extend(self._instances.collect())
        return generate_latest(_Families(families))


class _Families:
    """Collected families, in the shape ``generate_latest`` reads."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_families(by_worker: Sequence[tuple[int, list[Metric]]]) -> list[Metric]:
    """One family per name, holding every worker's series under a ``worker`` label."""
    merged: dict[str, Metric] = {}
    for worker, families in by_worker:
        label = str(worker)
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = into
            for sample in family.samples:
                into.samples.append(sample._replace(labels={**sample.labels, "worker": label}))
    return list(merged.values())
