"""The P -> D handoff: building each leg's body, calling engines, and naming what went wrong.

Prefill leg (docs/architecture.md, "A request's way"): the client's body with ``max_tokens=1``,
``stream=false``, no ``stream_options`` and ``kv_transfer_params.do_remote_decode=true``; its
response's ``kv_transfer_params`` go unchanged into the decode body. Each body is serialised exactly once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from yarl import URL

from vllm_disagg import jsonutil
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import BadRequest, EngineRejected, UpstreamError, UpstreamTimeout
from vllm_disagg.orchestrator.gateway.upstream import EngineClient, EngineConnectError, EngineHTTPError
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.protocol.kv_connectors import Handoff
from vllm_disagg.wire.kv_transfer import PREFILL_LEG

# Longest engine error text quoted back to a client.
_MAX_QUOTE = 300
_CACHED = re.compile(rb'"cached_tokens":(\d+)')


def cached_tokens(response: web.StreamResponse | object) -> int | None:
    """A whole (non-streamed) answer's ``usage.prompt_tokens_details.cached_tokens``, if it has one."""
    body = response.body if isinstance(response, web.Response) else None
    if not isinstance(body, bytes):
        return None
    m = _CACHED.search(body)
    if m:
        return int(m.group(1))
    if b"cached_tokens" not in body:
        return None
    try:  # spelled otherwise (spaces, escapes): read it from the JSON
        usage = jsonutil.loads(body).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError):
        return None
    return cached if type(cached) is int else None


@dataclass(frozen=True, slots=True)
class Target:
    """One engine leg's destination: which instance, for messages, and the full URL."""

    leg: str  # "prefill" | "decode"
    agent_id: str
    url: URL

    def describe(self) -> str:
        """How error messages name the engine."""
        return f"{self.leg} instance '{self.agent_id}' ({self.url.origin()})"


def one_token_body(request: dict[str, Any]) -> dict[str, Any]:
    """The client's body for one token, not streamed (a prefill leg, or a decode that only frees KV)."""
    body = dict(request)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    # vLLM refuses min_tokens > max_tokens; the decode leg still honours the client's value.
    body.pop("min_tokens", None)
    body["stream"] = False
    body.pop("stream_options", None)  # vLLM refuses stream options without a stream
    return body


def prefill_body(request: dict[str, Any], handoff: Handoff | None = "params") -> bytes:
    """The prefill leg's body: one token, no stream, asking the engine to keep the KV for a remote
    decode; a store connector (``protocol/kv_connectors.py``) needs no asking: it saves every prompt."""
    body = one_token_body(request)
    if handoff == "store":
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = dict(PREFILL_LEG)
    return dumps_leg(body)


def decode_body(request: dict[str, Any], kv_transfer_params: Any) -> bytes:
    """The decode leg's body: the client's, plus the prefill engine's ``kv_transfer_params`` as they
    came (none after a store connector's prefill: its decode engine finds the prompt in the store)."""
    if kv_transfer_params == {}:
        request.pop("kv_transfer_params", None)
    else:
        request["kv_transfer_params"] = kv_transfer_params
    return dumps_leg(request)


def dumps_leg(body: dict[str, Any]) -> bytes:
    """A leg's body as JSON bytes; ``BadRequest`` for a body too deeply nested to forward."""
    # orjson reads 1,024 levels of nesting but writes only 255: a deeper body cannot be forwarded.
    try:
        return jsonutil.dumps(body)
    except TypeError as exc:
        raise BadRequest(f"the request body is nested too deeply to forward ({exc})") from None


ENGINE_KEEPALIVE_S = 4.0  # below vLLM's 5 s server-side keep-alive


def new_session(config: OrchestratorConfig) -> EngineClient:
    """The one client for every engine call (keep-alive, no connection cap, no compression)."""
    # vLLM (uvicorn) closes a keep-alive connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). Reusing
    # one it is closing at that moment fails the request with a reset (seen: a decode leg, and the
    # decode that frees an abandoned prefill's KV, lost that way); dropping them at 4 s never races.
    # Connect and idle-read limits, never a total: a healthy stream may run for hours, and a dead or
    # partitioned engine is cut off by the registry (``LegWatch``) long before a timeout.
    return EngineClient(
        connect_timeout_s=config.connect_timeout_s,
        idle_timeout_s=config.idle_timeout_s,
        keepalive_s=ENGINE_KEEPALIVE_S,
    )


def upstream_failure(target: Target, exc: BaseException, metrics: OrchestratorMetrics) -> UpstreamError:
    """The error for an engine call that raised, with its cause, counted by leg and kind."""
    if isinstance(exc, UpstreamError):  # already classified (an instance declared lost)
        metrics.upstream_error(target.leg, exc.cause)
        return exc
    if isinstance(exc, TimeoutError):
        metrics.upstream_error(target.leg, "timeout")
        return UpstreamTimeout(f"{target.describe()} did not answer in time ({type(exc).__name__})")
    if isinstance(exc, EngineConnectError):
        metrics.upstream_error(target.leg, "connect")
        return UpstreamError(
            f"{target.describe()} is unreachable: {exc.os_error.strerror or exc}", cause="connect"
        )
    metrics.upstream_error(target.leg, "disconnect")
    return UpstreamError(f"{target.describe()} failed: {type(exc).__name__}: {exc}", cause="disconnect")


def status_failure(target: Target, status: int, body: bytes, metrics: OrchestratorMetrics) -> Exception:
    """The error for an engine's non-2xx answer: its own 4xx goes back to the client as it is (another
    engine would refuse the request too); a 5xx, 408 or 429 is the engine's trouble and worth a retry."""
    message = f"{target.describe()} answered HTTP {status}: {_quote_error(body)}"
    if 400 <= status < 500 and status not in (408, 429):
        metrics.upstream_error(target.leg, "rejected")
        return EngineRejected(status, message, body)
    metrics.upstream_error(target.leg, "status")
    return UpstreamError(message, cause="status")


def _quote_error(body: bytes) -> str:
    try:
        parsed = jsonutil.loads(body)
        message = parsed["error"]["message"] if isinstance(parsed.get("error"), dict) else parsed
    except (ValueError, TypeError, KeyError, AttributeError):
        message = body[:_MAX_QUOTE].decode("utf-8", errors="replace")
    return str(message)[:_MAX_QUOTE]


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prefill leg's outcome: the KV handle for the decode leg, and how much of the prompt it holds."""

    kv: dict[str, Any]  # ``kv_transfer_params``, passed to the decode leg unchanged
    prompt_tokens: int | None  # the engine's count, from its usage

    @property
    def transfers_kv(self) -> bool:
        """Does the handle name blocks for the decode engine to pull (vLLM 0.32: any non-empty prompt)?"""
        return bool(self.kv.get("remote_block_ids"))

    @property
    def decode_reports_loading(self) -> bool:
        """Will the decode engine's ``cached_tokens`` tell how much KV it loaded?

        Not with vLLM 0.32: P adds ``remote_prefill_cached_tokens`` (its own prefix-cache hits) to the
        handle, and D then reports that figure as its cached tokens, whatever it loaded or recomputed.
        """
        return "remote_prefill_cached_tokens" not in self.kv


async def run_prefill(
    session: EngineClient,
    target: Target,
    body: bytes,
    headers: dict[str, str],
    metrics: OrchestratorMetrics,
    handoff: Handoff | None = "params",
) -> Prefilled:
    """POST the prefill leg; its ``kv_transfer_params`` (none from a store connector's engine), or an
    ``UpstreamError`` (retry elsewhere) or ``EngineRejected`` (the engine's own 4xx: the request is at
    fault)."""
    try:
        async with session.post(target.url, data=body, headers=headers) as resp:
            data = await resp.read()
            status = resp.status
    except (EngineHTTPError, TimeoutError, OSError, UpstreamError) as exc:
        raise upstream_failure(target, exc, metrics) from None
    if not 200 <= status < 300:
        raise status_failure(target, status, data, metrics)
    try:
        parsed = jsonutil.loads(data)
    except ValueError:
        metrics.upstream_error(target.leg, "invalid_response")
        raise UpstreamError(
            f"{target.describe()} answered a body that is not JSON", cause="invalid_response"
        ) from None
    kv = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    if kv is None and handoff == "store" and isinstance(parsed, dict):
        kv = {}  # the prompt's KV is in the store: nothing to hand over
    if not isinstance(kv, dict):
        metrics.upstream_error(target.leg, "invalid_response")
        raise UpstreamError(
            f"{target.describe()} returned no kv_transfer_params (is its engine a KV producer?)",
            cause="invalid_response",
        )
    usage = parsed.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return Prefilled(kv, tokens if isinstance(tokens, int) else None)
