"""vLLM's OpenAI request validation and response shapes, for the simulated engine.

Parsing is pure (bytes in, ``SimRequest`` or a ``RequestError`` out); encoders build the exact JSON
and SSE bytes vLLM 0.32 sends (see docs/vllm-resume-facts.md), with per-request byte templates so a
streamed token costs a few concatenations. The engine plays ``vllm serve`` with its defaults except
``--fingerprint-mode none`` (no ``system_fingerprint``; the encoder can add one) and without
``--enable-prompt-tokens-details`` (``prompt_tokens_details`` is null).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vllm_disagg import jsonutil
from vllm_disagg.errors import BadRequest, ModelNotFound
from vllm_disagg.sim_engine import textgen
from vllm_disagg.wire.kv_transfer import RemotePrefill, remote_prefill, reused_prompt_ids
from vllm_disagg.wire.openai import check_vocab, messages_of, prompt_of

Kind = Literal["completion", "chat"]
DONE = b"data: [DONE]\n\n"
FINISH_REASON = "length"  # the sim never emits EOS, so every request runs to max_tokens
_NULL = b"null"


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One validated completion or chat request."""

    kind: Kind
    request_id: str
    prompt: str | tuple[int, ...]  # chat: templated messages, or kv_transfer_params.prompt_token_ids
    max_tokens: int
    stream: bool
    include_usage: bool
    remote_decode: bool  # prefill leg: keep the prompt's blocks for a decoder
    remote_prefill: RemotePrefill | None  # decode leg: pull the prompt's blocks first
    return_token_ids: bool = False  # vLLM's ``return_token_ids``: prompt and output ids in the answer
    continuous_usage: bool = False  # ``stream_options.continuous_usage_stats`` (with include_usage)


def _field(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass; a JSON true is never a valid count.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        raise BadRequest(f"'{name}' has the wrong type: {type(value).__name__}", param=name)
    return value


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def random_request_id() -> str:
    """vLLM's ``random_uuid()``: 16 hex digits, the request id when the client gives none."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


def _body_of(raw: bytes, served_model: str) -> dict[str, Any]:
    """The body as a JSON object for the served model, its priority the default (vLLM's default
    scheduling policy, fcfs, refuses any other, and so do we)."""
    try:
        body = jsonutil.loads(raw)
    except jsonutil.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _field(body, "model", str)
    if model is not None and model != served_model:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    priority = _field(body, "priority", int)
    if priority:
        raise BadRequest(f"Got priority {priority} but Priority scheduling is not enabled.")
    return body


def parse_request(
    kind: Kind, raw: bytes, *, request_id: str | None, served_model: str, default_max_tokens: int
) -> SimRequest:
    """Validate a request body like vLLM: 400 for bad input, 404 for a model this engine does not serve.

    ``request_id`` is the ``X-Request-Id`` header; without one, the body's ``request_id`` or a fresh one.
    """
    body = _body_of(raw, served_model)
    params = _field(body, "kv_transfer_params", dict)
    prompt: str | tuple[int, ...]
    if kind == "completion":
        prompt = prompt_of(body)
        if isinstance(prompt, tuple):
            check_vocab(prompt, textgen.VOCAB_SIZE, None)
    else:
        prompt = textgen.apply_chat_template(messages_of(body))
        prompt = reused_prompt_ids(body, params, textgen.VOCAB_SIZE) or prompt
    max_tokens = _field(body, "max_tokens", int)
    if kind == "chat":
        max_tokens = _field(body, "max_completion_tokens", int, max_tokens)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    n = _field(body, "n", int, 1)
    if n != 1:
        raise BadRequest("the simulated engine supports only n=1", param="n")
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict)
    if options is not None and not stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    continuous_usage = include_usage and bool(options and options.get("continuous_usage_stats"))
    return_token_ids = _field(body, "return_token_ids", bool, False)
    if request_id is None:
        body_id = body.get("request_id")
        request_id = body_id if isinstance(body_id, str) and body_id else random_request_id()
    remote_decode = bool(params and params.get("do_remote_decode"))
    remote = remote_prefill(params) if params and params.get("do_remote_prefill") else None
    return SimRequest(
        kind,
        request_id,
        prompt,
        max_tokens,
        stream,
        include_usage,
        remote_decode,
        remote,
        return_token_ids,
        continuous_usage,
    )


def check_length(prompt_tokens: int, max_tokens: int, max_model_len: int, kv_capacity_tokens: int) -> None:
    """Refuse a request that cannot fit the context window (vLLM's message) or the whole KV cache."""
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    if total > kv_capacity_tokens:
        raise BadRequest(
            f"The request needs {total} tokens of KV cache but the engine holds only {kv_capacity_tokens}.",
            param="max_tokens",
        )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's usage object in a non-streaming answer (``cached_tokens``: --enable-prompt-tokens-details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
        "completion_tokens_details": None,
    }


def _ids_json(ids: Sequence[int]) -> bytes:
    return b"[" + b",".join(b"%d" % t for t in ids) + b"]"


def _completion_choice(text: str, out_ids: list[int] | None, prompt_ids: list[int] | None) -> dict[str, Any]:
    """A completion's one choice, key for key as vLLM sends it."""
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": FINISH_REASON,
        "stop_reason": None,
        "token_ids": out_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "routed_experts": None,
    }


def _chat_choice(text: str, out_ids: list[int] | None) -> dict[str, Any]:
    """A chat completion's one choice (the assistant's message), key for key as vLLM sends it."""
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": FINISH_REASON,
        "stop_reason": None,
        "token_ids": out_ids,
        "routed_experts": None,
    }


class ResponseEncoder:
    """The JSON body or SSE chunks of one response, byte for byte as vLLM 0.32's OpenAI server sends them.

    The keyword options are the request's: ``return_token_ids`` adds the prompt ids (non-streaming
    answer and first chunk) and each chunk's token ids; ``include_usage`` moves the fingerprint from
    the last token chunk to the usage chunk; ``continuous_usage`` gives every chunk a running usage.
    ``prompt_token_ids`` are the prompt's ids as the engine ran them; ``fingerprint`` plays vLLM's
    ``system_fingerprint`` (None: ``--fingerprint-mode none``).
    """

    __slots__ = (
        "_chunk_prefix",
        "_chunk_suffix",
        "_final_suffix",
        "_fingerprint",
        "_fp_tail",
        "_head",
        "_head_bytes",
        "_prompt_ids_json",
        "_prompt_tokens",
        "continuous_usage",
        "include_usage",
        "kind",
        "prompt_token_ids",
        "return_token_ids",
    )

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        created: int,
        *,
        return_token_ids: bool = False,
        include_usage: bool = False,
        continuous_usage: bool = False,
        prompt_token_ids: Sequence[int] = (),
        fingerprint: str | None = None,
    ) -> None:
        self.kind = kind
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.prompt_token_ids = prompt_token_ids
        self._prompt_tokens = len(prompt_token_ids)
        self._prompt_ids_json = _ids_json(prompt_token_ids) if return_token_ids else _NULL
        self._fingerprint = fingerprint
        # vLLM stamps the fingerprint on the last chunk, unless a usage chunk follows to carry it.
        self._fp_tail = (
            b',"system_fingerprint":' + jsonutil.dumps(fingerprint) if fingerprint is not None else b""
        )
        rid = f"cmpl-{request_id}" if kind == "completion" else f"chatcmpl-{request_id}"
        obj = "text_completion" if kind == "completion" else "chat.completion"
        self._head = {"id": rid, "object": obj, "created": created, "model": model}
        chunk_obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        self._head_bytes = (
            b'data: {"id":' + jsonutil.dumps(rid) + b',"object":"' + chunk_obj.encode() + b'","created":'
            + str(created).encode() + b',"model":' + jsonutil.dumps(model) + b',"choices":['
        )  # fmt: skip
        finish = b'"' + FINISH_REASON.encode() + b'"'
        if kind == "completion":
            self._chunk_prefix = self._head_bytes + b'{"index":0,"text":'
            self._chunk_suffix = (
                b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":'
            )
            self._final_suffix = (
                b',"logprobs":null,"finish_reason":' + finish + b',"stop_reason":null,"prompt_token_ids":'
            )
        else:  # chat chunks carry stop_reason only with the finish, and the prompt ids in the role chunk
            self._chunk_prefix = self._head_bytes + b'{"index":0,"delta":{"content":'
            self._chunk_suffix = b'},"logprobs":null,"finish_reason":null,"token_ids":'
            self._final_suffix = (
                b'},"logprobs":null,"finish_reason":' + finish + b',"stop_reason":null,"token_ids":'
            )

    def full(
        self,
        text: str,
        prompt_tokens: int,
        completion_tokens: int,
        kv_params: Any,
        *,
        token_ids: Sequence[int] | None = None,
        cached_tokens: int | None = None,
    ) -> bytes:
        """The non-streaming response body (``token_ids``: the output ids, for ``return_token_ids``;
        ``cached_tokens``: the prompt tokens not computed, shown as vLLM's prompt_tokens_details)."""
        rti = self.return_token_ids
        out_ids = list(token_ids) if rti and token_ids is not None else None
        prompt_ids = list(self.prompt_token_ids) if rti else None
        body: dict[str, Any] = dict(self._head)
        if self.kind == "completion":
            body["choices"] = [_completion_choice(text, out_ids, prompt_ids)]
        else:
            body["choices"] = [_chat_choice(text, out_ids)]
        body["service_tier"] = None
        body["system_fingerprint"] = self._fingerprint
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        if self.kind == "chat":
            body["prompt_logprobs"] = None
            body["prompt_token_ids"] = prompt_ids
            body["prompt_text"] = None
        body["kv_transfer_params"] = kv_params
        body["ec_transfer_params"] = None
        body["metrics"] = None
        return jsonutil.dumps(body)

    def _running_usage(self, completion_tokens: int) -> bytes:
        # Chat's running usage names completion_tokens_details (as null); completions' does not.
        p = self._prompt_tokens
        tail = b',"completion_tokens_details":null}' if self.kind == "chat" else b"}"
        numbers = b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d'
        return numbers % (p, p + completion_tokens, completion_tokens) + tail

    def role_chunk(self) -> bytes:
        """Chat's first chunk: the assistant's role, and the prompt ids (empty for completions)."""
        if self.kind == "completion":
            return b""
        running = self._running_usage(0) if self.continuous_usage else b""
        return (
            self._head_bytes
            + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            + running
            + b',"prompt_token_ids":'
            + self._prompt_ids_json
            + b',"prompt_text":null}\n\n'
        )

    def token_chunk(self, json_word: bytes, last: bool, index: int = 0, token_id: int = -1) -> bytes:
        """Output token ``index``'s chunk (``token_id``: its id); the last one carries the finish reason."""
        parts = [self._chunk_prefix, json_word, self._final_suffix if last else self._chunk_suffix]
        if self.kind == "completion":
            parts.append(self._prompt_ids_json if index == 0 else _NULL)
            parts.append(b',"token_ids":')
        parts.append(b"[%d]" % token_id if self.return_token_ids else _NULL)
        parts.append(b"}]")
        if self.continuous_usage:
            parts.append(self._running_usage(index + 1))
        if last and not self.include_usage:
            parts.append(self._fp_tail)
        parts.append(b"}\n\n")
        return b"".join(parts)

    def chunks(self, json_words: Sequence[bytes], token_ids: Sequence[int] = ()) -> bytes:
        """All token chunks at once (the zero-delay path); ``token_ids`` needed for ``return_token_ids``."""
        n = len(json_words)
        if not n:
            return b""
        if self.return_token_ids or self.continuous_usage:
            ids = token_ids if self.return_token_ids else [-1] * n
            pairs = enumerate(zip(json_words, ids, strict=True))
            return b"".join(self.token_chunk(w, i == n - 1, i, t) for i, (w, t) in pairs)
        # Without per-chunk ids or usage, every chunk but the last has the same bytes around its word.
        ids_null = b'null,"token_ids":null}]' if self.kind == "completion" else b"null}]"
        mid = self._chunk_suffix + ids_null + b"}\n\n" + self._chunk_prefix
        end = self._final_suffix + ids_null + (b"" if self.include_usage else self._fp_tail) + b"}\n\n"
        return self._chunk_prefix + mid.join(json_words) + end

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> bytes:
        """The final chunk when ``stream_options.include_usage`` is true."""
        details = (
            b"" if cached_tokens is None else b',"prompt_tokens_details":{"cached_tokens":%d}' % cached_tokens
        )
        return (
            self._head_bytes
            + b'],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d'
            % (prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)
            + details
            + b"}"
            + self._fp_tail
            + b"}\n\n"
        )
