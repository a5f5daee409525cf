"""The OpenAI-compatible routes: validate, schedule, prefill leg, decode leg, record.

``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models``. Errors leave as
OpenAI-style JSON as ``vllm_disagg.http_errors`` builds them. Every request carries an
``X-Request-Id`` (the client's, or a new one) on both engine legs and back to the client, with
``X-Disagg-Mode``, ``X-Disagg-Prefill`` and ``X-Disagg-Decode`` saying where it went.

Before scheduling, the prompt is tokenized with the model's tokenizer (cached) and its full blocks
are looked up in the KV index, so the scheduler knows how much of it each instance has cached. A
client may pin the prefill instance with the ``X-Disagg-Prefill`` request header or a
``prefill_endpoint`` body field (an agent id, an engine URL, or host:port); the field is removed
before the body goes to an engine.
"""

from __future__ import annotations

import asyncio
import logging
import reprlib
import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from aiohttp import web
from yarl import URL

from vllm_disagg import jsonutil
from vllm_disagg.clock import Clock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import (
    BadRequest,
    PayloadTooLarge,
    RequestError,
    UpstreamError,
)
from vllm_disagg.http_errors import error_response
from vllm_disagg.orchestrator.control.kv_moves import KvMover
from vllm_disagg.orchestrator.gateway.flow import Flow
from vllm_disagg.orchestrator.gateway.handoff import Prefilled, Target, decode_body, one_token_body
from vllm_disagg.orchestrator.gateway.records import STAGES, RequestLog, RequestRecord
from vllm_disagg.orchestrator.gateway.server import (
    Answer,
    ClientRequest,
    FastRequest,
    Handler,
)
from vllm_disagg.orchestrator.gateway.slo import attainment, best_effort, request_slo, slo_class
from vllm_disagg.orchestrator.gateway.streaming import LegTiming
from vllm_disagg.orchestrator.gateway.tokenize import Tokenizers
from vllm_disagg.orchestrator.gateway.upstream import EngineClient, EngineHTTPError
from vllm_disagg.orchestrator.gateway.watch import LegWatch
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.planner.signals import SloWindow
from vllm_disagg.orchestrator.scheduling.framework import (
    NO_CACHE,
    Decision,
    Explanation,
    Scheduler,
    SchedulingRequest,
)
from vllm_disagg.orchestrator.scheduling.routing import route_request
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.kv_audit import Outcome
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.registry import GatewayRegistry
from vllm_disagg.protocol.messages import InstanceInfo

log = logging.getLogger(__name__)

Route = Literal["completions", "chat_completions"]
PIN_FIELD = "prefill_endpoint"  # body field pinning the prefill instance
PIN_HEADER = (
    "X-Disagg-Prefill"  # request header pinning it (the response header of the same name says where it ran)
)
PATHS: dict[Route, str] = {"completions": "/v1/completions", "chat_completions": "/v1/chat/completions"}
_URL_CACHE_MAX = 1024  # (engine url, path) pairs; instances come and go, so keep it bounded
_NO_TIMING = LegTiming()  # for requests that never reached an engine; never written to


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request body: the parsed object and the fields the gateway needs."""

    body: dict[str, Any]
    model: str
    stream: bool
    prompt_len: int  # token estimate for the scheduler
    pinned_prefill: str | None = None  # the body's ``prefill_endpoint``, removed from ``body``
    max_tokens: int | None = None


_MAX_DEPTH = 8  # the estimate stops counting below this depth: a hostile body may nest 1,000 levels
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother = 2, 80, 80


def _quote(value: object) -> str:
    """A bounded ``repr`` for error messages: a client's value is never echoed whole."""
    return _QUOTE.repr(value)[:120]


def _text_len(value: object, depth: int = 0) -> int:
    if isinstance(value, str):
        return len(value)
    if depth >= _MAX_DEPTH:
        return 0
    if isinstance(value, list):
        return sum(_text_len(v, depth + 1) if isinstance(v, str | list | dict) else 4 for v in value)
    if isinstance(value, dict):
        return _text_len(value.get("content", ""), depth + 1) + _text_len(value.get("text", ""), depth + 1)
    return 0


def _check_optional_int(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise BadRequest(f"'{name}' must be an integer >= 1, got {_quote(value)}", param=name)


def parse_request(raw: bytes, route: Route) -> ParsedRequest:
    """Validate a body for ``route``; raises ``BadRequest`` with a reason naming the field."""
    try:
        body = jsonutil.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    if route == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is required", param="prompt")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise BadRequest("'prompt' must be a string or a non-empty list", param="prompt")
        prompt_len = _text_len(prompt) // 4 + 1
    else:
        messages = body.get("messages")
        if messages is None:
            raise BadRequest("'messages' is required", param="messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("every item of 'messages' must be an object", param="messages")
        prompt_len = _text_len(messages) // 4 + 1
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {_quote(stream)}", param="stream")
    _check_optional_int(body, "max_tokens")
    _check_optional_int(body, "max_completion_tokens")
    pinned = body.pop(PIN_FIELD, None)
    if pinned is not None and (not isinstance(pinned, str) or not pinned):
        raise BadRequest(f"'{PIN_FIELD}' must be a non-empty string, got {_quote(pinned)}", param=PIN_FIELD)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    return ParsedRequest(body, model, bool(stream), prompt_len, pinned, max_tokens)


class Gateway:
    """Per-request work of the routes; holds the shared client session and the request log."""

    def __init__(
        self,
        config: OrchestratorConfig,
        registry: GatewayRegistry,
        scheduler: Scheduler,
        metrics: OrchestratorMetrics,
        clock: Clock,
        request_log: RequestLog,
        kv_index: KvIndex | None = None,
        tokenizers: Tokenizers | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.scheduler = scheduler
        self.metrics = metrics
        self.clock = clock
        self.watch = LegWatch()
        self._background: set[asyncio.Future[None]] = set()
        self.request_log = request_log
        self.kv_index = kv_index or KvIndex()
        self.tokenizers = tokenizers or Tokenizers(max_pending=config.tokenize_queue, metrics=metrics)
        self._tokenizer_of: dict[str, tuple[str, str]] = {}  # model -> (engine, tokenizer) registered
        self.session: EngineClient | None = None
        # Moves KV between agents' pools (``kv_moves``): the control plane's, or a worker's link to it.
        self.kv_mover: KvMover | None = None
        self._urls: dict[tuple[str, str], URL] = {}
        self.events = EventLog(clock.wall)  # the app hands in the shared log
        self._live: set[Flow] = set()  # requests in flight, for the admin API
        self.slo_window: SloWindow | None = None  # the planner's signals, fed per finished request
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
        """Cancel background work (KV releases) and close the engine session."""
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
            self.session = None

    def usable(self, agent_id: str) -> bool:
        """May a new leg start on ``agent_id``? Not once it is dead or suspect (a retry's second look)."""
        view = self.registry.get(agent_id)
        return view is not None and view.state not in ("dead", "suspect")

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

    def kv_audited(self, outcome: Outcome) -> None:
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

    async def _read_body(self, request: ClientRequest) -> bytes:
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise PayloadTooLarge(f"the request body of {length} bytes is over the limit of {limit} bytes")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes") from None

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
        )

    async def serve(self, request: ClientRequest, route: Route) -> Answer:
        """One completions or chat request, end to end."""
        clock = self.clock
        t0 = clock.monotonic()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        out_headers = {"X-Request-Id": request_id}
        model, status, error = "", 500, ""
        explanation: Explanation | None = None
        t_decided = t0
        streaming = False
        flow: Flow | None = None
        try:
            raw = await self._read_body(request)
            parsed = parse_request(raw, route)
            model, streaming = parsed.model, parsed.stream
            slo = request_slo(request.headers, self.config.slo_ttft_ms, self.config.slo_tpot_ms)
            scheduling, decision, tokens = await self._decide(
                request_id, route, parsed, _pin(request, parsed), t0, slo
            )
            t_decided = clock.monotonic()
            explanation = decision.explanation
            up_headers = self._upstream_headers(request, request_id)
            flow = Flow(self, request, route, parsed, raw, scheduling, decision, up_headers, out_headers, t0)
            flow.stamps["scheduled"] = t_decided
            if decision.kv_source is not None:
                flow.prompt_tokens = tokens  # the block keys its decode instance fetches
            self._live.add(flow)
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
            if flow is not None:
                self._live.discard(flow)
            self._record(request_id, route, model, streaming, status, error, t0, t_decided, explanation, flow)

    async def _decide(
        self,
        request_id: str,
        route: Route,
        parsed: ParsedRequest,
        pin: str | None,
        now: float,
        slo: tuple[float | None, float | None] = (None, None),
    ) -> tuple[SchedulingRequest, Decision, list[int] | None]:
        """What the scheduler knows of the request, where it goes (a prefill instance serves
        colocated, as a last resort, when no decode instance can), and the prompt's exact token ids."""
        snapshot = self.registry.snapshot()
        population = snapshot.model_ids.get(parsed.model)
        if population and parsed.model not in self._tokenizer_of:
            self.instance_joined(snapshot.by_id[population[0]].info)
        # Exact ids (None: not known) at once, or a future while the tokenize thread works.
        tokens = self.tokenizers.tokenize_nowait(parsed.model, route, parsed.body)
        if isinstance(tokens, asyncio.Future):
            tokens = await tokens
            # The registry and the clock moved on meanwhile.
            snapshot, now = self.registry.snapshot(), self.clock.monotonic()
        scheduling = self.scheduling_request(request_id, route, parsed, tokens, pin, slo)
        decision = route_request(self.scheduler, scheduling, snapshot, now)
        if slo != (None, None) and best_effort(scheduling, decision, snapshot):
            self.metrics.slo_best_effort(slo_class(*slo))
        return scheduling, decision, tokens

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

    def _record(
        self,
        request_id: str,
        route: Route,
        model: str,
        streaming: bool,
        status: int,
        error: str,
        t0: float,
        t_decided: float,
        explanation: Explanation | None,
        flow: Flow | None,
    ) -> None:
        """Metrics and the request log for one finished request."""
        clock = self.clock
        now = clock.monotonic()
        total = now - t0
        timing = flow.timing if flow is not None else _NO_TIMING
        stamps = flow.stamps if flow is not None else {}
        mode = flow.mode if flow is not None else "none"
        ttfb = timing.first_byte - t0 if timing.first_byte is not None else None
        # Only a stream shows when the first token came; a whole body arrives at the last one.
        if timing.first_byte is not None and streaming:
            stamps["first_token"] = timing.first_byte
        if timing.finished is not None and status < 400:
            stamps["last_token"] = timing.finished
        prefill_s = flow.prefill_s if flow is not None else None
        engine_s = flow.engine_s if flow is not None else 0.0
        handoff = None
        if mode == "disaggregated" and "prefill_end" in stamps and "decode_start" in stamps:
            handoff = stamps["decode_start"] - stamps["prefill_end"]
        schedule = t_decided - t0 if flow is not None else None
        queue = stamps["dispatched"] - t0 if "dispatched" in stamps else None
        tpot = _tpot(flow, status)
        relay, unread = "", 0
        if flow is not None:
            reason, relay = flow.relay_outcome()
            if reason:
                self.metrics.stream_not_resumable(reason)
            unread = flow.state.unread if flow.state is not None else 0
            if unread:
                self.metrics.stream_events_unread(unread)
        if flow is not None:
            # The TTFT the gateway sees: a stream's first byte, else the end of a prefill leg.
            prefilled = stamps["prefill_end"] - t0 if "prefill_end" in stamps else None
            self._latency_seen(flow.scheduling, mode, status, ttfb if streaming else prefilled, tpot)
        self.metrics.request_done(
            route,
            "fallback" if flow is not None and flow.fallback else mode,
            status,
            total,
            engine_s,
            prefill_s,
            ttfb,
            schedule_s=schedule,
            handoff_s=handoff,
            queue_s=queue,
            tpot_s=tpot,
        )
        self.request_log.add(
            RequestRecord(
                request_id=request_id,
                route=route,
                model=model,
                mode=mode,
                prefill=flow.prefill_id if flow is not None else None,
                decode=flow.decode_id if flow is not None else None,
                status=status,
                error=error,
                started_wall=clock.wall() - total,
                schedule_s=t_decided - t0,
                prefill_s=prefill_s,
                ttfb_s=ttfb,
                total_s=total,
                explanation=explanation,
                timeline={stage: t - t0 for stage, t in stamps.items()},
                attempts=tuple(flow.attempts) if flow is not None else (),
                fallback=flow.fallback if flow is not None else "",
                resumes=flow.resumes if flow is not None else 0,
                relay=relay,
                unread_events=unread,
            )
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %s -> %s in %.4fs (%s)", request_id, route, mode, status, total, error)

    def _latency_seen(
        self, target: SchedulingRequest, mode: str, status: int, ttft: float | None, tpot: float | None
    ) -> None:
        """A finished request's latency: against its own targets, and into the planner's window."""
        if target.slo_ttft_s is not None or target.slo_tpot_s is not None:
            label = slo_class(target.slo_ttft_s, target.slo_tpot_s)
            self.metrics.slo_request(label, attainment(target, status, ttft, tpot))
        window = self.slo_window
        if window is None or status != 200:
            return
        if mode == "disaggregated" and ttft is not None:  # the prefill pool's figure
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
            },
        }

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` (through aiohttp)."""
        return cast(web.StreamResponse, await self.serve(request, "completions"))  # not a FastStream

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` (through aiohttp)."""
        return cast(web.StreamResponse, await self.serve(request, "chat_completions"))

    def fast_routes(self) -> dict[str, Handler]:
        """The routes the gateway's own server (``server.GatewayServer``) serves: POST path -> handler."""

        def handler(route: Route) -> Handler:
            async def serve(request: FastRequest) -> Answer:
                return await self.serve(request, route)

            return serve

        return {path: handler(route) for route, path in PATHS.items()}

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: models served by at least one ready instance."""
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "vllm-disagg"}
            for m in self.registry.snapshot().ready_models()
        ]
        return web.Response(
            body=jsonutil.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    def add_routes(self, app: web.Application) -> None:
        """Register the OpenAI routes on ``app``."""
        app.router.add_post(PATHS["completions"], self.completions)
        app.router.add_post(PATHS["chat_completions"], self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    def route_directly(self, server: web.Server, app: web.Application) -> None:
        """Hand ``POST /v1/completions`` and ``/v1/chat/completions`` from ``server`` (serving ``app``)
        straight to their handlers, past the application's router: its resolve, match info and
        handler lookup are about a tenth of a plain request's CPU in the gateway. The handlers read
        neither ``request.app`` nor ``match_info``. Anything else (a query string, ``Expect``, another
        method or path) goes through ``app`` as before, and so does everything when ``app`` has
        middlewares (they must see every request)."""
        if app.middlewares:
            return
        through_app = server.request_handler
        direct = {PATHS["completions"]: self.completions, PATHS["chat_completions"]: self.chat_completions}

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            if request.method == "POST" and "Expect" not in request.headers:
                handler = direct.get(request.raw_path)  # a query string makes it another key
                if handler is not None:
                    return await handler(cast(web.Request, request))
            return await through_app(request)

        server.request_handler = handle


def _tpot(flow: Flow | None, status: int) -> float | None:
    """A finished stream's time per output token after the first, where the gateway counted them."""
    if flow is None or flow.state is None or status != 200:
        return None
    first, last, tokens = flow.timing.first_byte, flow.timing.finished, flow.state.n_ids
    if first is None or last is None or tokens < 2:
        return None
    return (last - first) / (tokens - 1)


def _pin(request: ClientRequest, parsed: ParsedRequest) -> str | None:
    """The prefill instance the client pinned, by header or body field (``BadRequest`` if they differ)."""
    pin = request.headers.get(PIN_HEADER) or None
    if pin and parsed.pinned_prefill and pin != parsed.pinned_prefill:
        raise BadRequest(
            f"the {PIN_HEADER} header ({pin!r}) and '{PIN_FIELD}' ({parsed.pinned_prefill!r}) disagree",
            param=PIN_FIELD,
        )
    return pin or parsed.pinned_prefill
