"""The gateway service: one completions or chat request, end to end: validate, schedule, run its legs, record.

``routes.py`` hands each OpenAI request to ``Gateway.serve``; ``parsing.py`` validates it; ``Flow``
(``flow.py``) runs its engine legs with retries, fallback and resumes and says how they ended
(``contract.Outcome``), which ``serve`` turns into metrics and the request's record. Errors leave as
OpenAI-style JSON as ``vllm_disagg.http_errors`` builds them. Every request gets an id of the gateway's
own, its engine legs' ``X-Request-Id`` and its record's key; the client's ``X-Request-Id`` is only
echoed (``request_ids.py``). The response says where it went: ``X-Disagg-Mode``, ``X-Disagg-Prefill``,
``X-Disagg-Decode``.

Before scheduling, the prompt is tokenized with the model's tokenizer (cached) and its full blocks
are looked up in the KV index, so the scheduler knows how much of it each instance has cached. A
client may pin the prefill instance with the ``X-Disagg-Prefill`` request header or a
``prefill_endpoint`` body field (an agent id, an engine URL, or host:port), the decode instance with
``X-Disagg-Decode`` or ``decode_endpoint``, or both (the pair); the fields are removed before the body
goes to an engine, and a pin that cannot be used is a 400 saying why (``scheduling/pins.py``).

Everything the gateway works with is built by its owner (``app.build_app``, or a gateway worker's
``Worker.build``) and handed to the constructor; the gateway itself makes only its per-request
bookkeeping and, once the event loop runs (``open``), its engine client session.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from yarl import URL

from vllm_disagg import logs
from vllm_disagg.clock import Clock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import NoCapacity, RequestError, UpstreamError
from vllm_disagg.http_errors import error_response
from vllm_disagg.orchestrator.admission.classify import priority_of, tenant_of
from vllm_disagg.orchestrator.admission.room import loaded
from vllm_disagg.orchestrator.control.kv_moves import KvMover
from vllm_disagg.orchestrator.gateway.admit import Admission, Pending, ticket_of
from vllm_disagg.orchestrator.gateway.contract import Outcome
from vllm_disagg.orchestrator.gateway.flow import Flow
from vllm_disagg.orchestrator.gateway.handoff import (
    Prefilled,
    Target,
    decode_body,
    dumps_leg,
    new_session,
    one_token_body,
)
from vllm_disagg.orchestrator.gateway.parsing import (
    PATHS,
    ParsedRequest,
    Route,
    parse_request,
    pinned_decode,
    pinned_prefill,
    read_body,
)
from vllm_disagg.orchestrator.gateway.records import STAGES, RequestLog
from vllm_disagg.orchestrator.gateway.request_ids import OWN_HEADER, client_request_id, new_request_id
from vllm_disagg.orchestrator.gateway.server import Answer, ClientRequest
from vllm_disagg.orchestrator.gateway.slo import attainment, best_effort, request_slo, slo_class
from vllm_disagg.orchestrator.gateway.tokenize import Tokenizers
from vllm_disagg.orchestrator.gateway.tracing import NO_TRACE, NoTrace, Tracing, trace_decision
from vllm_disagg.orchestrator.gateway.upstream import EngineClient, EngineHTTPError
from vllm_disagg.orchestrator.gateway.watch import LegWatch
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.planner.signals import SloWindow
from vllm_disagg.orchestrator.scheduling.framework import (
    NO_CACHE,
    Decision,
    Scheduler,
    SchedulingRequest,
)
from vllm_disagg.orchestrator.scheduling.routing import route_request
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.kv_audit import Outcome as AuditOutcome
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.registry import GatewayRegistry, RegistrySnapshot
from vllm_disagg.protocol.messages import InstanceInfo

log = logging.getLogger(__name__)

_URL_CACHE_MAX = 1024  # (engine url, path) pairs; instances come and go, so keep it bounded


class Gateway:
    """The OpenAI requests' work (``serve``), their flows in progress, the engine client session and
    the request log; what a flow uses of it is ``contract.FlowServices``."""

    def __init__(
        self,
        config: OrchestratorConfig,
        registry: GatewayRegistry,
        scheduler: Scheduler,
        metrics: OrchestratorMetrics,
        clock: Clock,
        *,
        request_log: RequestLog,
        kv_index: KvIndex,
        tokenizers: Tokenizers,
        events: EventLog,
        kv_mover: KvMover | None,
        slo_window: SloWindow | None,
    ) -> None:
        """``registry``: the orchestrator's, or a worker's replica of it; ``events``: the orchestrator's
        event log, or a worker's forwarder to it; ``kv_mover``: moves KV between agents' pools
        (``kv_moves``: the control plane's, or a worker's link to it); ``slo_window``: the planner's
        signals, fed per finished request (None: no planner in this process)."""
        self.config = config
        self.registry = registry
        self.scheduler = scheduler
        self.metrics = metrics
        self.clock = clock
        self.request_log = request_log
        self.kv_index = kv_index
        self.tokenizers = tokenizers
        self.events = events
        self.kv_mover = kv_mover
        self.slo_window = slo_window
        self.watch = LegWatch()
        self.tracing = Tracing(config.tracing) if config.tracing is not None else None
        admission = config.admission
        self.admission = (
            Admission(admission, scheduler, registry, clock, metrics) if admission.enabled else None
        )
        if self.admission is not None and slo_window is not None:
            self.admission.on_held = slo_window.admission_held
        self.session: EngineClient | None = None  # made by ``open``, in the running loop
        self._background: set[asyncio.Future[None]] = set()
        self._tokenizer_of: dict[str, tuple[str, str]] = {}  # model -> (engine, tokenizer) registered
        self._urls: dict[tuple[str, str], URL] = {}
        self._live: dict[Flow, str] = {}  # requests in flight (-> the client's id), for the admin API
        # What engines are sent as Authorization: the gateway's own key for them (vLLM's --api-key),
        # else (if configured) the client's header, else nothing: a client's credentials never reach
        # an engine by default (docs/security.md).
        self._engine_auth = f"Bearer {config.engine_api_key}" if config.engine_api_key else ""

    def target(self, leg: str, agent_id: str, route: Route) -> Target:
        """Where one leg of a ``route`` request to ``agent_id`` goes."""
        view = self.registry.get(agent_id)
        if view is None:
            raise UpstreamError(f"{leg} instance '{agent_id}' is not registered", cause="lost")
        base = view.info.url
        path = PATHS[route]
        key = (base, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) >= _URL_CACHE_MAX:
                self._urls.clear()
            url = self._urls[key] = URL(base.rstrip("/") + path)
        return Target(leg, agent_id, url)

    def open(self) -> None:
        """Make the engine client session; in the running event loop (the application's start)."""
        self.session = new_session(self.config)
        # How much of an engine's answer is read (docs/security.md): past it the leg fails.
        self.session.max_body_bytes = self.config.max_engine_body_bytes
        self.session.max_event_bytes = self.config.max_engine_event_bytes
        if self.admission is not None:
            self.admission.start()

    def session_or_fail(self) -> EngineClient:
        """The engine client session; ``UpstreamError`` before the app has started it."""
        if self.session is None:
            raise UpstreamError("the gateway is not started")
        return self.session

    def release_when_done(
        self,
        prefill: asyncio.Future[Prefilled],
        decode_id: str,
        route: Route,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        """The client left during a prefill: once it ends, hand its KV to the decode instance anyway.

        A prefill that finished keeps the prompt's blocks for the decode that should pull them (for
        vLLM's ``kv_lease_duration``, 30 s by default): a one-token decode pulls and so frees them at
        once. Tracked, and cancelled when the gateway stops.
        """

        async def release() -> None:
            try:
                kv = (await prefill).kv
            except Exception:  # it failed: nothing is held
                return
            if not kv:  # a store connector's: the engine holds nothing for a decode
                return
            released = decode_body(one_token_body(body), kv)
            released_headers = {**headers, "X-Request-Id": headers["X-Request-Id"] + "-release"}
            # Twice: a pooled connection the engine closed just then fails before any answer.
            for last in (False, True):
                cause, detail = await self._release_once(decode_id, route, released, released_headers)
                if not cause:
                    self.metrics.kv_released()
                    return
                if last or cause != "transport":
                    log.warning("freeing the KV of %s failed: %s", headers["X-Request-Id"], detail)
                    self.metrics.kv_release_failed(cause)
                    return

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_once(
        self, decode_id: str, route: Route, body: bytes, headers: dict[str, str]
    ) -> tuple[str, str]:
        """One KV-freeing decode: ("", "") when it answered 200, else a cause and what happened."""
        try:
            target = self.target("decode", decode_id, route)
            async with self.session_or_fail().post(target.url, data=body, headers=headers) as resp:
                await resp.read()
        except UpstreamError as exc:  # the decode instance is gone: its engine cannot pull anything
            return "lost", exc.message
        except (EngineHTTPError, TimeoutError, OSError) as exc:
            return "transport", f"{type(exc).__name__}: {exc}"
        return ("", "") if resp.status == 200 else ("status", f"HTTP {resp.status}")

    async def close(self) -> None:
        """Refuse what waits for admission, cancel background work (KV releases), close the engine
        session."""
        if self.admission is not None:
            await self.admission.close()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.tracing is not None:  # its last spans exported (blocking: off the loop)
            await asyncio.to_thread(self.tracing.shutdown)

    def instance_lost(self, agent_id: str, reason: str) -> None:
        """The registry says an instance is lost: fail its legs now, so they are retried or resumed."""
        n = self.watch.lost(agent_id, reason)
        if n:
            log.warning("instance %s lost (%s): failing over %d in-flight legs", agent_id, reason, n)

    def live_requests(self) -> list[dict[str, Any]]:
        """Requests in flight now: where they are (stage), on which pair, for how long; oldest first."""
        now = self.clock.monotonic()
        out = []
        for flow in sorted(self._live, key=lambda f: f.t0):
            reached = [s for s in STAGES if s in flow.stamps]
            if flow.timing.first_byte is not None:
                reached.append("first_token")
            out.append(
                {
                    "request_id": flow.scheduling.request_id,
                    "client_request_id": self._live.get(flow, ""),
                    "route": flow.route,
                    "model": flow.parsed.model,
                    "stream": flow.parsed.stream,
                    "mode": flow.mode,
                    "prefill": flow.prefill_id,
                    "decode": flow.decode_id,
                    "stage": reached[-1] if reached else "scheduled",
                    "age_s": round(now - flow.t0, 3),
                    "attempts": len(flow.attempts),
                    "resumes": flow.resumes,
                }
            )
        return out

    def kv_audited(self, outcome: AuditOutcome) -> None:
        """The KV audit judged decode legs: count them; where a decode instance computed KV it was
        handed, say so in the records of the requests it may have been."""
        self.metrics.kv_audited(outcome)
        verdict = outcome.recomputed
        if verdict is None:
            return
        note = verdict.note()
        self.events.publish(
            "kv_recomputed",
            decode=verdict.decode,
            prefills=list(verdict.prefills),
            tokens=verdict.tokens,
            requests=[leg.request_id for leg in verdict.legs],
        )
        for leg in verdict.legs:
            self.request_log.note_kv_check(leg.request_id, note)
        log.warning("%s", note)

    def instance_joined(self, info: InstanceInfo) -> None:
        """An instance said Hello: start loading its model's tokenizer now, before its traffic."""
        self.tokenizers.note_block_size(info.block_size)
        wanted = (info.engine, info.tokenizer)
        if self._tokenizer_of.get(info.model) == wanted:
            return
        self._tokenizer_of[info.model] = wanted
        try:
            self.tokenizers.register(info.model, info.engine, info.tokenizer)
        except ValueError as exc:  # an engine kind we cannot tokenize for: estimates only
            log.warning("model %s: no tokenizer (%s)", info.model, exc)

    def scheduling_request(
        self,
        request_id: str,
        route: Route,
        parsed: ParsedRequest,
        tokens: list[int] | None,
        pin: str | None,
        slo: tuple[float | None, float | None] = (None, None),
        pin_decode: str | None = None,
    ) -> SchedulingRequest:
        """What the scheduler needs: the exact prompt tokens (None: the estimate), and the cache maps
        (engines' prefix caches; agents' KV pools, where any holds anything)."""
        index = self.kv_index
        cached = index.cached_tokens(tokens) if tokens else NO_CACHE
        pooled = index.pooled_tokens(tokens) or NO_CACHE if tokens and index.has_pools else NO_CACHE
        return SchedulingRequest(
            request_id,
            parsed.model,
            len(tokens) if tokens is not None else parsed.prompt_len,
            route == "chat_completions",
            parsed.stream,
            cached,
            tokens is not None,
            pin,
            parsed.max_tokens,
            slo_ttft_s=slo[0],
            slo_tpot_s=slo[1],
            pooled_tokens=pooled,
            pinned_decode=pin_decode,
        )

    async def serve(self, request: ClientRequest, route: Route) -> Answer:
        """One completions or chat request, end to end."""
        t0 = self.clock.monotonic()
        # The gateway's own id keys engines and records; the client's is a label (request_ids.py).
        request_id, client_id = new_request_id(), ""
        out_headers = {"X-Request-Id": request_id, OWN_HEADER: request_id}
        model, stream, status, error = "", False, 500, ""
        flow: Flow | None = None
        tracing = self.tracing
        trace = (
            NO_TRACE
            if tracing is None
            else tracing.request(request.method, PATHS[route], request.headers, request_id, t0)
        )
        # Log lines from here on, in this task and the legs' tasks, are about this request.
        ids = logs.bind(request_id, trace.traceparent or request.headers.get("traceparent"))
        try:
            client_id = client_request_id(request.headers.get("X-Request-Id"))
            out_headers["X-Request-Id"] = client_id or request_id
            raw = await read_body(request, self.config.max_body_bytes)
            parsed = parse_request(raw, route)
            model, stream = parsed.model, parsed.stream
            flow = await self._schedule(request, route, parsed, raw, request_id, out_headers, t0, trace)
            self._live[flow] = client_id
            response = await flow.run()
            timing = flow.timing
            status = 499 if timing.client_gone else (502 if timing.cut else response.status)
            error = timing.cut or ("client disconnected" if timing.client_gone else "")
            return response
        except RequestError as exc:
            status, error = exc.status, exc.message
            return error_response(exc, out_headers)
        except asyncio.CancelledError:
            status, error = 499, "client disconnected"
            raise
        finally:
            if flow is None:  # refused before it was scheduled
                outcome = Outcome(request_id, route, model, stream, status, error, t0)
                outcome.client_request_id = client_id
                self._record(outcome)
            else:
                flow.held.end()  # a request that ended before its decode leg
                self._live.pop(flow, None)
                self._record(flow.outcome(status, error, client_id))
                if self.admission is not None:
                    self.admission.kick()
            trace.end(status, error, self.clock.monotonic())
            logs.unbind(ids)

    async def _schedule(
        self,
        request: ClientRequest,
        route: Route,
        parsed: ParsedRequest,
        raw: bytes,
        request_id: str,
        out_headers: dict[str, str],
        t0: float,
        trace: NoTrace,
    ) -> Flow:
        """The request scheduled, as its flow ready to run: what the scheduler knows of it (with the
        prompt's exact token ids where its tokenizer is loaded) and where it goes (a prefill instance
        serves colocated, as a last resort, when no decode instance can)."""
        slo = request_slo(request.headers, self.config.slo_ttft_ms, self.config.slo_tpot_ms)
        pin, pin_decode = pinned_prefill(request, parsed), pinned_decode(request, parsed)
        admission = self.config.admission
        priority = priority_of(parsed.body, request.headers, admission)
        tenant = tenant_of(request.headers, admission) if self.admission is not None else ""
        if "priority" in parsed.body and not admission.forward_priority:
            del parsed.body["priority"]  # vLLM refuses it unless run with --scheduling-policy priority
            raw = dumps_leg(parsed.body)
        elif parsed.rebuilt:  # pins or control fields removed: a colocated leg sends ``raw`` as it is
            raw = dumps_leg(parsed.body)
        snapshot, now = self.registry.snapshot(), t0
        population = snapshot.model_ids.get(parsed.model)
        if population and parsed.model not in self._tokenizer_of:
            self.instance_joined(snapshot.by_id[population[0]].info)
        # Exact ids (None: not known) at once, or a future while the tokenize thread works.
        tokens = self.tokenizers.tokenize_nowait(parsed.model, route, parsed.body)
        if isinstance(tokens, asyncio.Future):
            waited = self.clock.monotonic()
            tokens = await tokens
            # The registry and the clock moved on meanwhile.
            snapshot, now = self.registry.snapshot(), self.clock.monotonic()
            trace.stage("tokenize", waited, now, model=parsed.model)
        scheduling = self.scheduling_request(request_id, route, parsed, tokens, pin, slo, pin_decode)
        decision, snapshot, pending = await self._decide(scheduling, snapshot, now, t0, priority, tenant)
        if slo != (None, None) and best_effort(scheduling, decision, snapshot):
            self.metrics.slo_best_effort(slo_class(*slo))
        t_decided = self.clock.monotonic()
        up_headers = self._upstream_headers(request, request_id)
        flow = Flow(
            self, request, route, parsed, raw, scheduling, decision, up_headers, out_headers, t0, trace
        )
        trace_decision(trace, now, t_decided, decision)
        flow.stamps["scheduled"] = t_decided
        if pending is not None:
            _admitted(flow, pending, priority, tenant, trace)
        if decision.kv_source is not None:
            flow.prompt_tokens = tokens  # the block keys its decode instance fetches
        return flow

    async def _decide(
        self,
        scheduling: SchedulingRequest,
        snapshot: RegistrySnapshot,
        now: float,
        t0: float,
        priority: int,
        tenant: str,
    ) -> tuple[Decision, RegistrySnapshot, Pending | None]:
        """The scheduler's decision, through admission where it is on (the request may wait there):
        the decision, the snapshot it stands on, and the request's admission."""
        if self.admission is None:
            return route_request(self.scheduler, scheduling, snapshot, now), snapshot, None
        try:
            pending = Pending(scheduling, route_request(self.scheduler, scheduling, snapshot, now))
        except NoCapacity as exc:  # instances too loaded to take it are waited for, like any others
            if not loaded(exc, snapshot, scheduling.model):
                raise
            pending = Pending(scheduling, None, exc)
        config = self.config.admission
        ticket = ticket_of(pending, priority=priority, tenant=tenant, arrival=t0, config=config)
        decision = await self.admission.enter(ticket)
        if pending.queued_at is not None:
            snapshot = self.registry.snapshot()  # it waited: judge its pair as it is now
        return decision, snapshot, pending

    def _upstream_headers(self, request: ClientRequest, request_id: str) -> dict[str, str]:
        """The engine legs' headers: the request id, and the engines' key (or, when configured, the
        client's own ``Authorization``; otherwise engines never see it)."""
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if self._engine_auth:
            headers["Authorization"] = self._engine_auth
        elif self.config.forward_client_authorization:
            auth = request.headers.get("Authorization")
            if auth:
                headers["Authorization"] = auth
        return headers

    def _record(self, outcome: Outcome) -> None:
        """Metrics and the request log for one finished request."""
        clock = self.clock
        total = clock.monotonic() - outcome.t0
        ttfb = outcome.ttfb_s
        self._count(outcome, total, ttfb)
        self.request_log.add(outcome.record(total, ttfb, clock.wall() - total))
        if outcome.status >= 500 and outcome.status != 503:  # 503: refused for capacity, said to the client
            log.warning(
                "%s %s %s failed with %s after %.3fs: %s",
                outcome.request_id,
                outcome.route,
                outcome.mode or "unscheduled",
                outcome.status,
                total,
                outcome.error,
            )
        elif log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s %s %s -> %s in %.4fs (%s)",
                outcome.request_id,
                outcome.route,
                outcome.mode,
                outcome.status,
                total,
                outcome.error,
            )

    def _count(self, outcome: Outcome, total: float, ttfb: float | None) -> None:
        """A finished request's metrics, and its latency against its targets and for the planner."""
        metrics = self.metrics
        if outcome.relay_reason:
            metrics.stream_not_resumable(outcome.relay_reason)
        if outcome.unread_events:
            metrics.stream_events_unread(outcome.unread_events)
        if outcome.scheduling is not None:
            ttft = outcome.ttft_seen_s
            self._latency_seen(outcome, ttft, outcome.tpot_s)
        metrics.request_done(
            outcome.route,
            "fallback" if outcome.fallback else outcome.mode,
            outcome.status,
            total,
            outcome.engine_s,
            outcome.prefill_s,
            ttfb,
            schedule_s=outcome.schedule_s,
            handoff_s=outcome.handoff_s,
            queue_s=outcome.queue_s,
            tpot_s=outcome.tpot_s,
            transfer_window_s=outcome.transfer_window_s,
            decode_first_s=outcome.decode_first_s,
        )

    def _latency_seen(self, outcome: Outcome, ttft: float | None, tpot: float | None) -> None:
        """A finished request's latency: against its own targets, and into the planner's window (less
        any wait in admission for its decode stage: not the prefill pool's doing)."""
        target, mode, status = outcome.scheduling, outcome.mode, outcome.status
        assert target is not None
        if target.slo_ttft_s is not None or target.slo_tpot_s is not None:
            label = slo_class(target.slo_ttft_s, target.slo_tpot_s)
            self.metrics.slo_request(label, attainment(target, status, ttft, tpot))
        predicted = outcome.admission.get("predicted_ttft_s")
        if self.admission is not None and status == 200 and ttft is not None and isinstance(predicted, float):
            waited = outcome.admission.get("queued_s", 0.0)
            self.admission.slack.observe(ttft, waited if isinstance(waited, float) else 0.0, predicted)
        window = self.slo_window
        if window is None or status != 200:
            return
        if mode == "disaggregated" and ttft is not None:  # the prefill pool's figure
            waited = outcome.admission.get("queued_s")
            if outcome.admission.get("held_by") == "decode" and isinstance(waited, float):
                ttft -= waited
            window.ttft(ttft)
        if tpot is not None:
            window.tpot(tpot)

    def describe(self) -> dict[str, Any]:
        """Scheduler config, tokenizer status per model, KV index size: for the admin API."""
        index = self.kv_index
        snapshot = self.registry.snapshot()
        config = getattr(self.scheduler, "config", None)
        return {
            "scheduler": getattr(self.scheduler, "name", type(self.scheduler).__name__),
            "config": getattr(config, "source", None),
            "tokenizers": self.tokenizers.status(),
            "kv_index": {
                "blocks": index.total_blocks(),
                "block_sizes": index.block_sizes(),
                "instances": {v.agent_id: index.blocks_of(v.agent_id) for v in snapshot.instances},
                "pool_blocks": index.pool_total_blocks(),
                "pools": {
                    v.agent_id: index.pool_blocks_of(v.agent_id)
                    for v in snapshot.instances
                    if v.info.kv_pool_endpoint
                },
                "disk_tiers": {  # the pools' disk tiers (``"disk"`` KV events)
                    v.agent_id: blocks
                    for v in snapshot.instances
                    if (blocks := index.disk_blocks_of(v.agent_id))
                },
            },
        }


def _admitted(flow: Flow, pending: Pending, priority: int, tenant: str, trace: NoTrace) -> None:
    """What admission did with a request, in its record (and its trace, where it waited)."""
    flow.admission = {
        "priority": priority,
        "tenant": tenant,
        "predicted_ttft_s": round(pending.predicted_s, 6),
    }
    queued, admitted = pending.queued_at, pending.admitted_at
    if queued is not None and admitted is not None:
        flow.stamps["queued"], flow.stamps["admitted"] = queued, admitted
        flow.admission["queued_s"] = round(admitted - queued, 6)
        flow.admission["held_by"] = pending.held_by
        trace.stage("admission", queued, admitted, priority=priority, tenant=tenant)
