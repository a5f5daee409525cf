"""Between the gateway service and a request's flow: what the flow uses, and what it hands back.

``Flow`` (``flow.py``) runs one request's engine legs. It sees the gateway only as ``FlowServices``, the
members it really uses, so that ``flow.py`` never imports the service that creates it (the two used to
import each other) and a test or another host can run a flow on anything shaped alike. When the request
has ended, the flow gives an ``Outcome``: where its legs ran, when each stage began, every attempt, what
its stream came to. The service turns that value into metrics and the request's record, and builds one
for a request refused before it had a flow (a 400, 404, 413 or 503), so both end the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_disagg.clock import Clock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.control.kv_moves import KvMover
from vllm_disagg.orchestrator.gateway.handoff import Prefilled, Target
from vllm_disagg.orchestrator.gateway.parsing import Route
from vllm_disagg.orchestrator.gateway.records import Attempt, RequestRecord
from vllm_disagg.orchestrator.gateway.upstream import EngineClient
from vllm_disagg.orchestrator.gateway.watch import LegWatch
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.scheduling.framework import Explanation, Scheduler, SchedulingRequest
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.registry import GatewayRegistry


class FlowServices(Protocol):
    """What a request's flow uses of the gateway running it (``service.Gateway`` is one)."""

    config: OrchestratorConfig  # retry, fallback and resume limits
    clock: Clock
    registry: GatewayRegistry  # snapshots to pick from; leg outcomes for the breakers; in-flight counts
    scheduler: Scheduler  # another prefill or decode instance, after a failure
    metrics: OrchestratorMetrics
    events: EventLog
    kv_index: KvIndex  # which agent's KV pool holds a block
    kv_mover: KvMover | None  # moves blocks between agents' pools (None: nothing can)
    watch: LegWatch  # fails the legs running on an instance the registry says is lost

    def target(self, leg: str, agent_id: str, route: Route) -> Target:
        """Where one leg of a ``route`` request to ``agent_id`` goes."""
        ...

    def session_or_fail(self) -> EngineClient:
        """The engine client session."""
        ...

    def release_when_done(
        self,
        prefill: asyncio.Future[Prefilled],
        decode_id: str,
        route: Route,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        """Once ``prefill`` ends, free the KV it holds for a decode that will not come."""
        ...


@dataclass(slots=True)  # not frozen: that __init__ (object.__setattr__ per field) costs 8 times as much
class Outcome:
    """What became of one request: the answer's status, and where and when its legs ran. A value:
    nothing changes it once made.

    Times are the gateway clock's monotonic seconds; the defaults describe a request refused before
    it was scheduled (``scheduling`` None: no flow ran)."""

    request_id: str  # the gateway's own (``request_ids.py``)
    route: Route
    model: str  # "" when the body had none that could be read
    stream: bool
    status: int  # what the client got; 499 when it went away
    error: str
    t0: float  # arrival
    scheduling: SchedulingRequest | None = None  # the request as scheduled (its SLO targets)
    explanation: Explanation | None = None  # why the scheduler picked what it picked
    mode: str = "none"  # "disaggregated" or "colocated" as it ended
    prefill: str | None = None
    decode: str | None = None
    # Stage (``records.STAGES``, and ``dispatched``: its first engine leg) -> when it was reached.
    stamps: Mapping[str, float] = field(default_factory=dict)
    first_byte: float | None = None  # the first byte of the decode leg's body
    prefill_s: float | None = None  # in prefill legs, all of them
    engine_s: float = 0.0  # in engine legs, all of them
    attempts: tuple[Attempt, ...] = ()
    fallback: str = ""  # why it ran colocated after its prefill legs failed
    resumes: int = 0
    relay_reason: str = ""  # why its stream could not have been resumed ("" when it could, or no stream)
    relay: str = ""  # the same, in a sentence
    unread_events: int = 0  # events of its stream passed on unread
    tpot_s: float | None = None  # a stream's time per output token after the first, where counted
    # Its admission: priority, tenant and the seconds it waited in the queue (empty: admission off).
    admission: Mapping[str, object] = field(default_factory=dict)
    client_request_id: str = ""  # the client's ``X-Request-Id`` ("" when it sent none)

    @property
    def ttfb_s(self) -> float | None:
        """Arrival to the decode leg's first body byte."""
        return self.first_byte - self.t0 if self.first_byte is not None else None

    @property
    def schedule_s(self) -> float | None:
        """Arrival to the scheduler's decision (body read, parse, tokenize, schedule)."""
        scheduled = self.stamps.get("scheduled")
        return scheduled - self.t0 if scheduled is not None else None

    @property
    def queue_s(self) -> float | None:
        """Arrival to its first engine leg."""
        dispatched = self.stamps.get("dispatched")
        return dispatched - self.t0 if dispatched is not None else None

    @property
    def handoff_s(self) -> float | None:
        """From the end of the prefill leg to the start of the decode leg that took its KV."""
        stamps = self.stamps
        if self.mode == "disaggregated" and "prefill_end" in stamps and "decode_start" in stamps:
            return stamps["decode_start"] - stamps["prefill_end"]
        return None

    @property
    def transfer_window_s(self) -> float | None:
        """A streamed disaggregated request: from its prefill leg's end to D's first token (the KV's
        way to D, D's pull of it, and D's first step)."""
        first, stamps = self.first_byte, self.stamps
        if self.stream and self.mode == "disaggregated" and first is not None and "prefill_end" in stamps:
            return first - stamps["prefill_end"]
        return None

    @property
    def decode_first_s(self) -> float | None:
        """A stream's decode leg alone, from its start to its first token."""
        if self.stream and self.first_byte is not None and "decode_start" in self.stamps:
            return self.first_byte - self.stamps["decode_start"]
        return None

    @property
    def ttft_seen_s(self) -> float | None:
        """The TTFT the gateway sees: a stream's first byte, else the end of a prefill leg."""
        if self.stream:
            return self.ttfb_s
        prefill_end = self.stamps.get("prefill_end")
        return prefill_end - self.t0 if prefill_end is not None else None

    def record(self, total: float, ttfb: float | None, started_wall: float) -> RequestRecord:
        """The request log's record of it (``/admin/v1/requests/{id}``)."""
        t0 = self.t0
        return RequestRecord(
            request_id=self.request_id,
            route=self.route,
            model=self.model,
            mode=self.mode,
            prefill=self.prefill,
            decode=self.decode,
            status=self.status,
            error=self.error,
            started_wall=started_wall,
            schedule_s=self.schedule_s or 0.0,
            prefill_s=self.prefill_s,
            ttfb_s=ttfb,
            total_s=total,
            explanation=self.explanation,
            timeline={stage: t - t0 for stage, t in self.stamps.items()},
            attempts=self.attempts,
            fallback=self.fallback,
            resumes=self.resumes,
            relay=self.relay,
            unread_events=self.unread_events,
            admission=self.admission,
            gateway_s=max(0.0, total - self.engine_s),
            client_request_id=self.client_request_id,
        )
