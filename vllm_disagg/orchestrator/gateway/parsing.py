"""What a client sent, validated before anything is scheduled: the body, its model and sizes, the pin.

Everything wrong with a request that the client can fix is found here and raised as the error the
client sees (``vllm_disagg.http_errors`` answers it): a body over ``max_body_bytes`` is a 413; malformed
JSON, a non-object, a missing ``prompt``/``messages``, a wrongly typed field or a pin the header and the
body disagree on is a 400 whose reason names the field. The fields vLLM takes as orders
(``control_fields.py``: ``kv_transfer_params`` and the like) are removed here, before anything reads
the body (the tokenizer included) and before any leg is built from it. (Whether a pinned instance
can serve is the scheduler's 400: ``scheduling/pins.py``.) (An unknown model is the scheduler's 404:
only the registry knows which models are served.) Nothing here reads the gateway's state, so the rules are
tested on bytes alone (``tests/unit/orchestrator/gateway/test_validation.py``).
"""

from __future__ import annotations

import logging
import reprlib
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.errors import BadRequest, PayloadTooLarge
from vllm_disagg.orchestrator.gateway.control_fields import strip_control
from vllm_disagg.orchestrator.gateway.server import ClientRequest

log = logging.getLogger(__name__)

Route = Literal["completions", "chat_completions"]
PATHS: dict[Route, str] = {"completions": "/v1/completions", "chat_completions": "/v1/chat/completions"}
PIN_FIELD = "prefill_endpoint"  # body field pinning the prefill instance
PIN_HEADER = (
    "X-Disagg-Prefill"  # request header pinning it (the response header of the same name says where it ran)
)
DECODE_PIN_FIELD = "decode_endpoint"  # body field pinning the decode instance (both pins: the pair)
DECODE_PIN_HEADER = "X-Disagg-Decode"  # request header pinning it (as the response header says)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request body: the parsed object and the fields the gateway needs."""

    body: dict[str, Any]
    model: str
    stream: bool
    prompt_len: int  # token estimate for the scheduler
    pinned_prefill: str | None = None  # the body's ``prefill_endpoint``, removed from ``body``
    max_tokens: int | None = None
    pinned_decode: str | None = None  # the body's ``decode_endpoint``, removed from ``body``
    stripped: tuple[str, ...] = ()  # the control fields the client sent, removed from ``body``

    @property
    def rebuilt(self) -> bool:
        """Does ``body`` differ from the bytes the client sent (pins or control fields removed)? Then
        no leg may forward those bytes as they came."""
        return bool(self.stripped) or self.pinned_prefill is not None or self.pinned_decode is not None


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


async def read_body(request: ClientRequest, limit: int) -> bytes:
    """The request's body; ``PayloadTooLarge`` when it is (or says it is) over ``limit`` bytes."""
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(f"the request body of {length} bytes is over the limit of {limit} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"the request body is over the limit of {limit} bytes") from None


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
    pinned, pinned_decode = _pop_pin(body, PIN_FIELD), _pop_pin(body, DECODE_PIN_FIELD)
    stripped = strip_control(body)
    if stripped:  # removed, not refused: a client replaying an engine's answer as a body still works
        log.debug("removed the client's control fields %s", ", ".join(stripped))
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    return ParsedRequest(body, model, bool(stream), prompt_len, pinned, max_tokens, pinned_decode, stripped)


def _pop_pin(body: dict[str, Any], name: str) -> str | None:
    """The body's pin field ``name``, removed: an engine would refuse a field it does not know."""
    pinned = body.pop(name, None)
    if pinned is not None and (not isinstance(pinned, str) or not pinned):
        raise BadRequest(f"'{name}' must be a non-empty string, got {_quote(pinned)}", param=name)
    return pinned


def _pin(request: ClientRequest, header: str, name: str, in_body: str | None) -> str | None:
    pin = request.headers.get(header) or None
    if pin and in_body and pin != in_body:
        raise BadRequest(f"the {header} header ({pin!r}) and '{name}' ({in_body!r}) disagree", param=name)
    return pin or in_body


def pinned_prefill(request: ClientRequest, parsed: ParsedRequest) -> str | None:
    """The prefill instance the client pinned, by header or body field (``BadRequest`` if they differ)."""
    return _pin(request, PIN_HEADER, PIN_FIELD, parsed.pinned_prefill)


def pinned_decode(request: ClientRequest, parsed: ParsedRequest) -> str | None:
    """The decode instance the client pinned, by header or body field (``BadRequest`` if they differ)."""
    return _pin(request, DECODE_PIN_HEADER, DECODE_PIN_FIELD, parsed.pinned_decode)
