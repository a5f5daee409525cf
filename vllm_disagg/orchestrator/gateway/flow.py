"""One request's engine legs, with recovery: retries, colocated fallback, and the record of each attempt.

- **Prefill fails** (connect, 5xx, timeout, no ``kv_transfer_params``, instance lost): another prefill
  instance is tried, one that has not failed this request, up to ``prefill_attempts`` in all; then the
  request runs colocated on its decode instance. The client gets a normal answer.
- **Decode fails before its first byte**: another decode instance that can take KV from the same
  prefill instance, up to ``decode_attempts``. Unless the first one never connected, it may have pulled
  (and so freed) the prefill's KV, so the prefill runs again (its prefix cache makes that cheap).
- **Decode fails mid-stream**: the client's stream ends with an error event and ``[DONE]``, and the
  request counts as failed (502), never as a 200.
- An engine's own 4xx goes back to the client as it is: another engine would refuse it too.
- **A decode instance the client pinned** is neither retried elsewhere nor resumed on another: the
  client gets its error (a failed leg's 502, or a cut stream's error event).
- **KV pools** (engines of the ``vllm-disagg`` connector): before a decode leg that should load blocks
  another agent's pool holds (the prefill instance's, after its leg; the decision's ``kv_source``, for
  a request sent straight to decode), the gateway has D's agent fetch them (``kv_moves``). A move that
  fails is counted and logged as an event, and the decode leg goes to D all the same: its engine
  computes what it lacks.

Every leg's outcome feeds the registry's breakers (per instance, and per P→D link for decode legs);
every attempt is kept, and the flow's ``outcome`` (``contract.Outcome``) hands them to the gateway with
the rest of what it did, for the request's metrics and record (``/admin/v1/requests/{id}``). The flow
sees the gateway only as ``contract.FlowServices``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from vllm_disagg.errors import EngineRejected, UpstreamError
from vllm_disagg.orchestrator.gateway.contract import FlowServices, Outcome
from vllm_disagg.orchestrator.gateway.handoff import (
    Prefilled,
    cached_tokens,
    decode_body,
    dumps_leg,
    prefill_body,
    run_prefill,
)
from vllm_disagg.orchestrator.gateway.parsing import ParsedRequest, Route
from vllm_disagg.orchestrator.gateway.records import Attempt
from vllm_disagg.orchestrator.gateway.resume import (
    StreamState,
    ids_missing,
    resumable,
    resumable_decode_body,
    stream_state,
)
from vllm_disagg.orchestrator.gateway.server import Answer, ClientRequest, ClientStream
from vllm_disagg.orchestrator.gateway.streaming import (
    LegTiming,
    continue_stream,
    end_stream,
    end_with_error,
    run_decode,
)
from vllm_disagg.orchestrator.gateway.tracing import NO_TRACE, NoTrace
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.recovery import (
    colocated_pick,
    may_resume,
    may_retry_decode,
    may_retry_prefill,
    next_decode,
    resume_pick,
)
from vllm_disagg.orchestrator.state.in_flight import Held
from vllm_disagg.protocol.kv_connectors import handoff_of
from vllm_disagg.protocol.kv_pool import POOL_PARAMS, read_pool_handle
from vllm_disagg.protocol.messages import POOL_CONNECTOR
from vllm_disagg.wire.block_hash import event_hash, prompt_block_hashes

log = logging.getLogger(__name__)


class Flow:
    """The legs of one request after its first scheduling decision; ``outcome`` says what came of them."""

    def __init__(
        self,
        gateway: FlowServices,
        request: ClientRequest,
        route: Route,
        parsed: ParsedRequest,
        raw: bytes,
        scheduling: SchedulingRequest,
        decision: Decision,
        up_headers: dict[str, str],
        out_headers: dict[str, str],
        t0: float,
        trace: NoTrace = NO_TRACE,
    ) -> None:
        self.gw = gateway
        self.trace = trace  # the request's spans (tracing.py); a leg's headers carry its own
        self.request = request
        self.route = route
        self.parsed = parsed
        self.raw = raw
        self.scheduling = scheduling
        self.up_headers = up_headers
        self.out_headers = out_headers
        self.t0 = t0
        self.mode = decision.mode
        self.explanation = decision.explanation
        self.prefill_id = decision.prefill
        self.decode_id = decision.decode
        self.held = Held(gateway.registry, decision.decode)  # D counts it from now: the next pick sees it
        self.pinned = scheduling.pinned_prefill is not None
        self.pinned_decode = scheduling.pinned_decode is not None  # never retried nor resumed elsewhere
        self.stamps: dict[str, float] = {}
        self.admission: dict[str, object] = {}  # priority, tenant, queued_s: set by the gateway
        self.timing = LegTiming()
        self.prefill_s: float | None = None
        self.engine_s = 0.0
        self.attempts: list[Attempt] = []
        self.failed: set[str] = set()  # instances that failed this request: never tried again
        self.prefill_tries = 0
        self.fallback = ""
        self.resumes = 0
        self.prefilled: Prefilled | None = None  # the last successful prefill leg
        # Straight to decode: whose KV pool holds the prompt, and its token ids (for the block keys).
        self.kv_source = decision.kv_source
        self.prompt_tokens: list[int] | None = None
        self._kv_moved: tuple[str, str] | None = None  # (holder, receiver) of the last move asked for
        if decision.kv_source is not None:
            gateway.metrics.kv_pool_direct("own" if decision.kv_source == decision.decode else "peer")
        # A stream that can move to another instance mid-way keeps what that needs (``_stream_state``).
        self.chat = route != "completions"
        may = parsed.stream and gateway.config.max_resumes > 0
        self._resumable = may and resumable(parsed.body, self.chat)
        self.state: StreamState | None = None
        # Why a resumable request's stream could not be: no token ids from its engine or in its events.
        self.not_resumable = ""  # "no_token_ids" | "ids_missing" | ""
        self.not_resumable_why = ""
        options = parsed.body.get("stream_options")
        self._client_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self._set_headers()

    def _set_headers(self) -> None:
        h = self.out_headers
        h["X-Disagg-Mode"] = self.mode
        h["X-Disagg-Prefill"] = self.prefill_id or ""
        h["X-Disagg-Decode"] = self.decode_id

    def _attempt(self, leg: str, instance: str, started: float, outcome: str, error: str = "") -> None:
        now = self.gw.clock.monotonic()
        self.attempts.append(Attempt(leg, instance, started - self.t0, now - self.t0, outcome, error))
        self.trace.attempt(leg, instance, started, now, outcome, error)
        if outcome != "ok":  # what a retry, a fallback or a resume follows: one line each
            log.info("%s: %s on %s ended %s: %s", self.scheduling.request_id, leg, instance, outcome, error)

    def _leg_headers(self, leg: str, instance: str, started: float) -> dict[str, str]:
        return self.trace.leg_headers(leg, instance, started, self.up_headers)  # its span's traceparent

    def _excluding(self) -> SchedulingRequest:
        return dataclasses.replace(self.scheduling, exclude=frozenset(self.failed))

    def _usable(self, agent_id: str) -> bool:
        """May a new leg start on ``agent_id``? Not once it is dead or suspect (a retry's second look)."""
        view = self.gw.registry.get(agent_id)
        return view is not None and view.state not in ("dead", "suspect")

    async def run(self) -> Answer:
        """Prefill (with retries and fallback), then decode (with retries); the client's response."""
        kv = await self._prefill() if self.prefill_id is not None else None
        return await self._decode(kv)

    # --- prefill ------------------------------------------------------------------------------------

    async def _prefill(self) -> Any | None:
        """The prefill's ``kv_transfer_params``; None when the request falls back to colocated."""
        gw = self.gw
        path_cause = ""
        p = self.prefill_id
        while p is not None:
            if not self._usable(p):  # e.g. a re-prefill after a decode failure, on a P lost meanwhile
                self.failed.add(p)
                path_cause = path_cause or "lost"
                p = self.prefill_id = gw.scheduler.pick_prefill(
                    self._excluding(), gw.registry.snapshot(), gw.clock.monotonic(), self.decode_id
                )
                self._set_headers()
                continue
            self.prefill_tries += 1
            try:
                kv = await self._prefill_once(p)
            except UpstreamError as exc:
                path_cause = exc.cause
                gw.registry.leg_failed(p, gw.clock.monotonic())
                self.failed.add(p)
                if not may_retry_prefill(self.prefill_tries, self.pinned, gw.config):
                    break
                p = gw.scheduler.pick_prefill(
                    self._excluding(), gw.registry.snapshot(), gw.clock.monotonic(), self.decode_id
                )
                if p is not None:
                    gw.metrics.retry("prefill", path_cause)
                    self.prefill_id = p
                    self._set_headers()
                continue
            gw.registry.leg_succeeded(p)
            return kv
        # No prefill instance could do it: the decode instance computes the prompt itself.
        gw.metrics.fallback(path_cause)
        gw.events.publish(
            "fallback", request_id=self.scheduling.request_id, cause=path_cause, decode=self.decode_id
        )
        log.info("%s: colocated on %s (%s)", self.scheduling.request_id, self.decode_id, path_cause)
        self.trace.event("fallback", cause=path_cause, decode=self.decode_id)
        self.fallback = path_cause
        self.mode, self.prefill_id = "colocated", None
        self._set_headers()
        return None

    async def _prefill_once(self, p: str) -> Any:
        gw = self.gw
        view = gw.registry.get(p)  # how its connector hands KV over: vLLM's params, or a store both read
        handoff = handoff_of(view.info.kv_connector) if view is not None else None
        body, target = prefill_body(self.parsed.body, handoff), gw.target("prefill", p, self.route)
        gw.registry.acquire(p)
        started = self.stamps["prefill_start"] = gw.clock.monotonic()
        self.stamps.setdefault("dispatched", started)
        # Its own task, shielded: a client that leaves now must not strand the KV the prefill keeps
        # for a decode that will never come (vLLM holds it for its lease, 30 s by default).
        headers = self._leg_headers("prefill", p, started)
        leg = asyncio.ensure_future(
            run_prefill(gw.session_or_fail(), target, body, headers, gw.metrics, handoff)
        )
        try:
            async with gw.watch.leg(p, target.describe()):
                self.prefilled = await asyncio.shield(leg)
        except UpstreamError as exc:
            leg.cancel()
            self._attempt("prefill", p, started, exc.cause, exc.message)
            raise
        except EngineRejected as exc:
            self._attempt("prefill", p, started, "rejected", exc.message)
            raise
        except asyncio.CancelledError:
            gw.release_when_done(leg, self.decode_id, self.route, self.parsed.body, self.up_headers)
            raise
        finally:
            gw.registry.release(p)
            ended = self.stamps["prefill_end"] = gw.clock.monotonic()
            self.prefill_s = (self.prefill_s or 0.0) + ended - started
            self.engine_s += ended - started
        self._attempt("prefill", p, started, "ok")
        return self.prefilled.kv

    # --- decode -------------------------------------------------------------------------------------

    async def _decode(self, kv: Any | None) -> Answer:
        gw = self.gw
        tries = 0
        while True:
            tries += 1
            d = self.decode_id
            if self.kv_source is not None or (kv is not None and POOL_PARAMS in kv):
                await self._pool_move(kv, d)
            self.state = self._stream_state(d)
            body = self._decode_body(kv)
            audit = self._audit_dispatch(d, kv)
            try:
                response = await self._decode_once(d, body)
            except UpstreamError as exc:
                # An engine that answered 5xx after a prefill elsewhere may have failed to pull the KV:
                # that is the link's trouble, not (yet) the instance's.
                fault = self.prefill_id is None or exc.cause != "status"
                gw.registry.leg_failed(d, gw.clock.monotonic(), self.prefill_id, instance_fault=fault)
                self.failed.add(d)
                if not may_retry_decode(tries, self.pinned_decode, gw.config) or not self._next_decode():
                    raise
                gw.metrics.retry("decode", exc.cause)
                if self.prefill_id is None:
                    kv = None
                elif kv is not None and exc.cause != "connect":
                    # The failed instance may have pulled the KV, and the prefill instance freed it.
                    kv = await self._prefill()
                continue
            finally:
                if audit is not None:
                    answered = self.timing.first_byte is not None  # D counted the prompt by then
                    gw.registry.audit_done(d, audit, gw.clock.monotonic(), answered=answered)
            if self.timing.cut:
                gw.registry.leg_failed(d, gw.clock.monotonic(), partner=self.prefill_id)
                self.failed.add(d)
                if not self.timing.client_gone:
                    await self._end_cut(response)
            elif not self._recomputed(d, response):
                # An audited leg's link is judged by the audit, once D's counters include it.
                gw.registry.leg_succeeded(d, partner=self.prefill_id if audit is None else None)
            return response

    async def _pool_move(self, kv: Any | None, d: str) -> None:
        """Have ``d``'s agent fetch the prompt's blocks from the pool that holds them, if another's."""
        gw = self.gw
        view = gw.registry.get(d)
        if view is None or view.info.kv_connector != POOL_CONNECTOR:
            return  # a retry on an instance without the connector: it computes the prompt itself
        if self.prefill_id is not None and kv is not None:
            path, holder = "handoff", self.prefill_id
            if self._kv_moved == (holder, d):
                return
            self._kv_moved = (holder, d)
            try:
                handle = read_pool_handle(kv)
            except ValueError as exc:
                gw.metrics.kv_pool_transfer(path)
                self._pool_failed(path, holder, d, "invalid_handle", str(exc))
                return
            if handle is None or not handle.keys:
                return  # a prompt shorter than a block: nothing was saved
            gw.metrics.kv_pool_transfer(path)
            keys: list[str] | tuple[str, ...] = handle.keys
        elif self.kv_source is not None and self.prefill_id is None:
            path, holder = "direct", self.kv_source
            if holder == d or self.prompt_tokens is None or self._kv_moved == (holder, d):
                return  # its own pool: nothing moves
            self._kv_moved = (holder, d)
            blocks = prompt_block_hashes(self.prompt_tokens, view.info.block_size)
            if not blocks:
                return
            gw.metrics.kv_pool_transfer(path)
            if not gw.kv_index.pool_holds(holder, event_hash(blocks[0])):
                # The holder reported the prompt's blocks under other hashes: vLLM seeds its first
                # block's parent with PYTHONHASHSEED, which must be the same here and in the engines.
                why = f"{holder}'s pool reported the prompt's blocks under other keys than computed here"
                self._pool_failed(path, holder, d, "key_mismatch", f"{why} (is PYTHONHASHSEED the same?)")
                return
            keys = [k.hex() for k in blocks]
        else:
            return
        mover = gw.kv_mover
        if mover is None:
            self._pool_failed(path, holder, d, "unavailable", "this gateway has no control plane to ask")
            return
        started = gw.clock.monotonic()
        result = await mover.move(holder, d, keys)
        if not result.ok:
            self._pool_failed(path, holder, d, result.reason, result.error, started)
            return
        gw.metrics.kv_pool_blocks(result.reserved, result.already_held)
        self._attempt("kv_fetch", d, started, "ok")

    def _pool_failed(
        self, path: str, holder: str, d: str, reason: str, error: str, started: float | None = None
    ) -> None:
        gw = self.gw
        gw.metrics.kv_pool_transfer_failed(path, reason)
        gw.events.publish(
            "kv_pool_transfer_failed",
            request_id=self.scheduling.request_id,
            path=path,
            holder=holder,
            receiver=d,
            reason=reason,
            error=error,
        )
        self._attempt("kv_fetch", d, gw.clock.monotonic() if started is None else started, reason, error)

    def _audit_dispatch(self, d: str, kv: Any | None) -> int | None:
        """Tell the registry the tokens a decode leg pulls from P (``link_rates``, D's uncached ones),
        and start the counter audit of a leg that should load KV (``kv_audit``), where D's own figure
        cannot tell (vLLM 0.32); its key, or None."""
        prefilled, p, gw, req = self.prefilled, self.prefill_id, self.gw, self.scheduling
        if kv is None or p is None or prefilled is None:
            return None
        lacks = (prefilled.prompt_tokens or req.prompt_len) - req.cached_tokens.get(d, 0)
        gw.registry.kv_sent(p, d, lacks, gw.clock.monotonic())
        if prefilled.decode_reports_loading or not prefilled.transfers_kv or not prefilled.prompt_tokens:
            return None
        return gw.registry.audit_dispatch(
            d, self.scheduling.request_id, p, prefilled.prompt_tokens, gw.clock.monotonic()
        )

    def _recomputed(self, d: str, response: Answer) -> bool:
        """Did the decode engine compute the prompt itself instead of loading the prefill's KV?

        vLLM counts KV pulled from a prefill engine as cached prompt tokens (with
        ``--enable-prompt-tokens-details``, which the agent turns on): a decode leg that reports fewer
        than half the prompt as cached, after a prefill that handed over blocks, recomputed it — the
        answer is right, but slow, and the link is suspect. Counted by pair; repeats open the link's
        breaker; the request's record shows it.
        """
        prefilled, p = self.prefilled, self.prefill_id
        if p is None or prefilled is None or not prefilled.transfers_kv or not prefilled.prompt_tokens:
            return False
        if not prefilled.decode_reports_loading:
            return False  # D's figure is P's (vLLM 0.32): no per-request verdict; see the agent's counters
        cached = self.state.cached_tokens if self.state is not None else cached_tokens(response)
        if cached is None or 2 * cached >= prefilled.prompt_tokens:
            return False
        gw = self.gw
        gw.metrics.kv_recomputed(p, d, prefilled.prompt_tokens - cached)
        gw.events.publish(
            "kv_recomputed",
            decode=d,
            prefills=[p],
            tokens=prefilled.prompt_tokens - cached,
            requests=[self.scheduling.request_id],
        )
        gw.registry.leg_failed(d, gw.clock.monotonic(), p, instance_fault=False)
        last = self.attempts[-1]
        self.attempts[-1] = dataclasses.replace(
            last,
            outcome="recomputed",
            error=f"decode instance '{d}' loaded {cached} of {prefilled.prompt_tokens} prompt tokens "
            f"from prefill instance '{p}' and computed the rest",
        )
        return True

    def _stream_state(self, d: str) -> StreamState | None:
        """The relay state of a resumable stream's decode leg on ``d`` (``resume.stream_state``)."""
        if not self._resumable:
            return None
        parsed, view = self.parsed, self.gw.registry.get(d)
        state, self.not_resumable, self.not_resumable_why = stream_state(
            view, d, self.chat, parsed.body, parsed.max_tokens, self._client_usage
        )
        return state

    def outcome(self, status: int, error: str, client_request_id: str = "") -> Outcome:
        """What the request came to, once it ended with ``status`` (``error`` saying why, if it failed);
        ``client_request_id``: the client's ``X-Request-Id``, for its record."""
        timing, stamps, state, parsed = self.timing, self.stamps, self.state, self.parsed
        # Only a stream shows when the first token came; a whole body arrives at the last one.
        if timing.first_byte is not None and parsed.stream:
            stamps["first_token"] = timing.first_byte
        if timing.finished is not None and status < 400:
            stamps["last_token"] = timing.finished
        reason, relay = self.relay_outcome()
        tpot = None
        if state is not None and status == 200 and state.n_ids >= 2:
            first, last = timing.first_byte, timing.finished
            if first is not None and last is not None:
                tpot = (last - first) / (state.n_ids - 1)
        return Outcome(
            self.scheduling.request_id,
            self.route,
            parsed.model,
            parsed.stream,
            status,
            error,
            self.t0,
            self.scheduling,
            self.explanation,
            self.mode,
            self.prefill_id,
            self.decode_id,
            stamps,
            timing.first_byte,
            self.prefill_s,
            self.engine_s,
            tuple(self.attempts),
            self.fallback,
            self.resumes,
            reason,
            relay,
            state.unread if state is not None else 0,
            tpot,
            self.admission,
            client_request_id,
        )

    def relay_outcome(self) -> tuple[str, str]:
        """Why the stream was not resumable (a reason and a sentence), or ("", "") when it was (or the
        request never could be)."""
        missing = ids_missing(self.state, self.decode_id)
        return missing if missing is not None else (self.not_resumable, self.not_resumable_why)

    def _decode_body(self, kv: Any | None) -> bytes:
        """The decode leg's body: the client's bytes when nothing needs to change (``raw``: rebuilt by
        the gateway when parsing removed control fields or pins, ``ParsedRequest.rebuilt``)."""
        if self.state is None:
            return decode_body(self.parsed.body, kv) if kv is not None else self.raw
        # Only where D's figure says what it loaded (not vLLM 0.32's echo of P's cache hits).
        judged = kv is not None and self.prefilled is not None and self.prefilled.decode_reports_loading
        return resumable_decode_body(self.parsed.body, kv, self.state, judged, self._client_usage)

    async def _end_cut(self, out: ClientStream) -> None:
        """A stream its engine cut: complete (only ``[DONE]`` was missing), resumed, or ended honestly."""
        timing = self.timing
        if self.state is not None and self.state.answered():
            await end_stream(out, timing)  # cut after its last content: the client has the whole answer
            timing.cut = timing.cut_cause = ""
        elif not await self._resume(out):
            await end_with_error(out, timing.cut, timing)

    async def _resume(self, out: ClientStream) -> bool:
        """Go on with a cut stream on other instances (``max_resumes`` in all); True once complete."""
        gw, state, timing, pinned = self.gw, self.state, self.timing, self.pinned_decode
        while state is not None and state.can_resume() and may_resume(state.resumes, pinned, gw.config):
            cause = timing.cut_cause
            body = state.resume_body(self.parsed.body)
            if body is None:
                return False
            snapshot, now = gw.registry.snapshot(), gw.clock.monotonic()
            d = resume_pick(gw.scheduler, self._excluding(), snapshot, now)
            if d is None:
                if colocated_pick(gw.scheduler, self._excluding(), snapshot, now) is not None:
                    what = "a streamed chat (chat_prompt_ids)" if self.chat else "a streamed completion"
                    self.not_resumable = "no_resumer"
                    self.not_resumable_why = (
                        f"not resumable: no instance left whose engine can take over {what}"
                    )
                return False
            gw.metrics.resume(cause)
            gw.events.publish("resume", request_id=self.scheduling.request_id, cause=cause, to=d)
            log.info("%s: the stream resumes on %s (%s)", self.scheduling.request_id, d, cause)
            self.trace.event("resume", cause=cause, to=d)
            state.start_leg()
            self.resumes = state.resumes
            self.mode, self.prefill_id, self.decode_id = "colocated", None, d
            target = gw.target("decode", d, self.route)
            gw.registry.acquire(d)
            started = gw.clock.monotonic()
            try:
                await continue_stream(
                    out,
                    gw.session_or_fail(),
                    target,
                    dumps_leg(body),
                    self._leg_headers("resume", d, started),
                    gw.metrics,
                    gw.clock.monotonic,
                    timing,
                    gw.watch,
                    state,
                )
            except UpstreamError as exc:
                timing.cut, timing.cut_cause = exc.message, exc.cause
                self._attempt("resume", d, started, exc.cause, exc.message)
                gw.registry.leg_failed(d, gw.clock.monotonic())
                self.failed.add(d)
                continue
            finally:
                gw.registry.release(d)
                self.engine_s += gw.clock.monotonic() - started
            self._attempt("resume", d, started, "ok")
            gw.registry.leg_succeeded(d)
            timing.cut = timing.cut_cause = ""
            return True
        return False

    def _next_decode(self) -> bool:
        """Pick another decode instance (able to take KV from our prefill instance, else colocated)."""
        gw = self.gw
        snapshot, now = gw.registry.snapshot(), gw.clock.monotonic()
        picked = next_decode(gw.scheduler, self._excluding(), snapshot, now, self.prefill_id)
        if picked is None:
            return False
        self.decode_id, prefill = picked
        if prefill is None:
            self.mode, self.prefill_id = "colocated", None
        self._set_headers()
        return True

    async def _decode_once(self, d: str, body: bytes) -> Answer:
        gw = self.gw
        target = gw.target("decode", d, self.route)
        timing = self.timing
        self.held.end()  # its leg counts itself from here
        gw.registry.acquire(d)
        started = self.stamps["decode_start"] = gw.clock.monotonic()
        self.stamps.setdefault("dispatched", started)
        try:
            response = await run_decode(
                self.request,
                gw.session_or_fail(),
                target,
                body,
                self._leg_headers("decode", d, started),
                self.out_headers,
                self.parsed.stream,
                gw.metrics,
                gw.clock.monotonic,
                timing,
                gw.watch,
                self.state,
            )
        except UpstreamError as exc:
            self._attempt("decode", d, started, exc.cause, exc.message)
            raise
        except asyncio.CancelledError:
            # The client left before D's first byte: D aborts its request, but if it was already
            # pulling the KV, P may keep the blocks for its lease. A one-token decode of the same
            # handle takes them (or finds them gone, which is as good).
            if self.prefilled is not None and self.prefill_id is not None and timing.first_byte is None:
                done: asyncio.Future[Prefilled] = asyncio.get_running_loop().create_future()
                done.set_result(self.prefilled)
                gw.release_when_done(done, d, self.route, self.parsed.body, self.up_headers)
            raise
        finally:
            gw.registry.release(d)
            self.engine_s += (timing.finished or gw.clock.monotonic()) - started
        self._attempt("decode", d, started, timing.cut_cause or "ok", timing.cut)
        return response
