"""The byte-for-byte checker: what the simulated engine must have answered, and a verdict on what came.

The simulated engine's output is a pure function of the prompt (``sim.textgen``), and its bytes come
from ``sim.openai_api.ResponseEncoder``; the only things a response carries that the request does not
fix are the engine's request id (``cmpl-<id>``: the gateway's own id of the request, not the client's
``X-Request-Id``, ``gateway/request_ids.py``) and ``created`` (the engine's clock), both read from the
response's first object. So the exact expected body or SSE stream can be rebuilt and compared: every
later event must carry the same id (a resumed leg's are rewritten to the first leg's).

Verdicts: a clean 200 whose bytes differ is *garbled*; a non-200, a transport error, a stream without
``data: [DONE]`` or with an error event is *failed*; the exact bytes are *completed*.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from vllm_disagg import jsonutil
from vllm_disagg.sim_engine.openai_api import DONE, Kind, ResponseEncoder
from vllm_disagg.sim_engine.textgen import apply_chat_template, expected_chat_text, expected_text, tokenize

Outcome = Literal["completed", "failed", "garbled"]
PATHS: dict[Kind, str] = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
_TOKEN = re.compile(r" [^ ]*")  # each simulated output token is one word with a leading space
_CONTEXT = 40  # bytes either side of the first difference, in a garbled verdict


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One generated request: everything its body is made of, and all the checker needs."""

    request_id: str
    kind: Kind
    stream: bool
    max_tokens: int
    prompt: str = ""  # completions
    messages: tuple[tuple[str, str], ...] = ()  # chat: (role, content)
    include_usage: bool = False

    @property
    def path(self) -> str:
        """The route it is sent to."""
        return PATHS[self.kind]

    def message_dicts(self) -> list[dict[str, str]]:
        """The chat messages as the OpenAI API spells them."""
        return [{"role": role, "content": content} for role, content in self.messages]

    def body(self, model: str) -> bytes:
        """The JSON request body."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "stream": self.stream}
        if self.kind == "chat":
            body["messages"] = self.message_dicts()
        else:
            body["prompt"] = self.prompt
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return jsonutil.dumps(body)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The checker's judgement of one response."""

    outcome: Outcome
    reason: str = ""


@dataclass(frozen=True, slots=True)
class _Output:
    token_json: tuple[bytes, ...]  # each output token's text as a JSON string literal
    text: str
    prompt_ids: tuple[int, ...]  # the prompt as the engine runs it (chat: templated)


def split_tokens(text: str, n: int, prefix: Callable[[int], str]) -> list[str]:
    """The texts of the ``n`` output tokens that make ``text``; ``prefix(i)`` is the first ``i`` tokens' text.

    Splitting on the leading spaces is exact for today's word tokens; should that ever stop holding,
    the token boundaries are recovered from the prefixes (slower, still exact).
    """
    parts = _TOKEN.findall(text)
    if len(parts) == n and "".join(parts) == text:
        return parts
    texts, before = [], ""
    for i in range(1, n + 1):
        now = prefix(i)
        texts.append(now[len(before) :])
        before = now
    return texts


class Checker:
    """Rebuilds expected responses (output memoised per prompt) and judges received ones."""

    def __init__(self, model: str, *, memo_size: int = 4096) -> None:
        self.model = model
        self._memo: OrderedDict[tuple[object, ...], _Output] = OrderedDict()
        self._memo_size = memo_size

    def _output(self, spec: RequestSpec) -> _Output:
        key: tuple[object, ...] = (spec.kind, spec.prompt, spec.messages, spec.max_tokens)
        out = self._memo.get(key)
        if out is not None:
            self._memo.move_to_end(key)
            return out
        n = spec.max_tokens
        if spec.kind == "chat":
            messages = spec.message_dicts()
            prompt_text = apply_chat_template(messages)
            text = expected_chat_text(messages, n)
            texts = split_tokens(text, n, lambda i: expected_chat_text(messages, i))
        else:
            prompt_text = spec.prompt
            text = expected_text(spec.prompt, n)
            texts = split_tokens(text, n, lambda i: expected_text(spec.prompt, i))
        out = _Output(tuple(jsonutil.dumps(t) for t in texts), text, tuple(tokenize(prompt_text)))
        self._memo[key] = out
        if len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
        return out

    def _encoder(
        self, spec: RequestSpec, out: _Output, created: int, request_id: str | None
    ) -> ResponseEncoder:
        return ResponseEncoder(
            spec.kind,
            spec.request_id if request_id is None else request_id,
            self.model,
            created,
            include_usage=spec.include_usage,
            prompt_token_ids=out.prompt_ids,
        )

    def expected_stream(self, spec: RequestSpec, created: int, request_id: str | None = None) -> bytes:
        """The exact SSE bytes the engine sends for ``spec`` at wall second ``created`` (``request_id``:
        the engine's, default the spec's)."""
        out = self._output(spec)
        enc = self._encoder(spec, out, created, request_id)
        last = len(out.token_json) - 1
        parts = [enc.role_chunk()]
        parts += [enc.token_chunk(word, i == last, i) for i, word in enumerate(out.token_json)]
        if spec.include_usage:
            parts.append(enc.usage_chunk(len(out.prompt_ids), spec.max_tokens))
        parts.append(DONE)
        return b"".join(parts)

    def expected_body(self, spec: RequestSpec, created: int, request_id: str | None = None) -> bytes:
        """The exact non-streaming body the engine sends for ``spec`` at wall second ``created``."""
        out = self._output(spec)
        return self._encoder(spec, out, created, request_id).full(
            out.text, len(out.prompt_ids), spec.max_tokens, None
        )

    def check(self, spec: RequestSpec, status: int | None, body: bytes, error: str = "") -> Verdict:
        """Judge one response: its status (None when none came), the bytes received, any transport error."""
        if error:
            return Verdict("failed", error)
        if status != 200:
            return Verdict("failed", f"HTTP {status}")
        if spec.stream:
            return self._check_stream(spec, body)
        head = _head(body)
        if head is None:
            return Verdict(
                "garbled", "the body is not a completion object with an id and an integer 'created'"
            )
        want = self.expected_body(spec, head[1], head[0])
        return Verdict("completed") if body == want else Verdict("garbled", difference(body, want))

    def _check_stream(self, spec: RequestSpec, body: bytes) -> Verdict:
        if not body.endswith(DONE):
            return Verdict("failed", "the stream ended without data: [DONE]")
        first = body.split(b"\n\n", 1)[0]
        head = _head(first.removeprefix(b"data: ")) if first.startswith(b"data: ") else None
        want = self.expected_stream(spec, head[1], head[0]) if head is not None else None
        if want is not None and body == want:
            return Verdict("completed")
        error = error_event(body)
        if error is not None:
            return Verdict("failed", f"error event: {error}")
        if want is None:
            return Verdict("garbled", "the first event is not a chunk with an id and an integer 'created'")
        return Verdict("garbled", difference(body, want))


def _head(raw: bytes) -> tuple[str, int] | None:
    """A response object's engine request id (its ``id`` less ``cmpl-``/``chatcmpl-``) and ``created``."""
    try:
        obj = jsonutil.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    created, full_id = obj.get("created"), obj.get("id")
    if not isinstance(created, int) or isinstance(created, bool) or not isinstance(full_id, str):
        return None
    prefix, _, request_id = full_id.partition("-")
    return (request_id, created) if prefix in ("cmpl", "chatcmpl") and request_id else None


def error_event(body: bytes) -> str | None:
    """The message of the first SSE error event in ``body`` (vLLM's ``data: {"error": ...}``), or None."""
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"error"' in event:
            try:
                obj = jsonutil.loads(event[6:])
            except ValueError:
                continue
            if isinstance(obj, dict) and "error" in obj:
                error = obj["error"]
                message = error.get("message") if isinstance(error, dict) else error
                return str(message)
    return None


def difference(got: bytes, want: bytes) -> str:
    """Where ``got`` first departs from ``want``, with a little context of each."""
    at = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )
    lo = max(0, at - _CONTEXT)
    return (
        f"differs at byte {at} of {len(got)} (expected {len(want)}): "
        f"got {got[lo : at + _CONTEXT]!r}, expected {want[lo : at + _CONTEXT]!r}"
    )
