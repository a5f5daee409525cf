"""vLLM's OpenAI request validation and response shapes, for the simulated engine.

Parsing is pure (bytes in, ``SimRequest`` or a ``RequestError`` out); encoders build the exact JSON
and SSE bytes vLLM sends, with per-request byte templates so a streamed token costs one concatenation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vllm_disagg import jsonutil
from vllm_disagg.errors import BadRequest, ModelNotFound
from vllm_disagg.sim import textgen

Kind = Literal["completion", "chat"]
DONE = b"data: [DONE]\n\n"
FINISH_REASON = "length"  # the sim never emits EOS, so every request runs to max_tokens


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request's KV waits: the prefill engine's ``kv_transfer_params``."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    request_id: str | None


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One validated completion or chat request."""

    kind: Kind
    request_id: str
    prompt: str | tuple[int, ...]  # chat messages arrive here already templated
    max_tokens: int
    stream: bool
    include_usage: bool
    remote_decode: bool  # prefill leg: keep the prompt's blocks for a decoder
    remote_prefill: RemotePrefill | None  # decode leg: pull the prompt's blocks first


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


def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one is the same request
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt cannot be empty", param="prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt cannot be empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return tuple(prompt)
        if all(isinstance(p, str | list) for p in prompt):
            raise BadRequest("batched prompts are not supported by the simulated engine", param="prompt")
        raise BadRequest("'prompt' must be a string or a list of non-negative token ids", param="prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")


def _messages(body: Mapping[str, Any]) -> str:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a 'role'", param="messages")
    return textgen.apply_chat_template(messages)


def _remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    host = params.get("remote_host")
    port = params.get("remote_port")
    block_ids = params.get("remote_block_ids") or []
    engine_id = params.get("remote_engine_id")
    request_id = params.get("remote_request_id")
    if not isinstance(host, str) or not host:
        raise BadRequest("kv_transfer_params.remote_host is required to pull KV", param="kv_transfer_params")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BadRequest("kv_transfer_params.remote_port must be a TCP port", param="kv_transfer_params")
    if not isinstance(block_ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in block_ids
    ):
        raise BadRequest(
            "kv_transfer_params.remote_block_ids must be a list of ints", param="kv_transfer_params"
        )
    if not isinstance(engine_id, str):
        raise BadRequest("kv_transfer_params.remote_engine_id must be a string", param="kv_transfer_params")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("kv_transfer_params.remote_request_id must be a string", param="kv_transfer_params")
    return RemotePrefill(engine_id, host, port, tuple(block_ids), request_id)


def parse_request(
    kind: Kind, raw: bytes, *, request_id: str, served_model: str, default_max_tokens: int
) -> SimRequest:
    """Validate a request body like vLLM: 400 for bad input, 404 for a model this engine does not serve."""
    try:
        body = jsonutil.loads(raw)
    except jsonutil.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _field(body, "model", str)
    if model is not None and model != served_model:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    prompt: str | tuple[int, ...] = _prompt(body) if kind == "completion" else _messages(body)
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
    params = _field(body, "kv_transfer_params", dict)
    remote_decode = bool(params and params.get("do_remote_decode"))
    remote_prefill = _remote_prefill(params) if params and params.get("do_remote_prefill") else None
    return SimRequest(
        kind, request_id, prompt, max_tokens, stream, include_usage, remote_decode, remote_prefill
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


class ResponseEncoder:
    """The JSON body or SSE chunks of one response, shaped like vLLM's OpenAI server."""

    __slots__ = ("_chunk_prefix", "_chunk_suffix", "_final_suffix", "_head", "kind")

    def __init__(self, kind: Kind, request_id: str, model: str, created: int) -> None:
        self.kind = kind
        rid = f"cmpl-{request_id}" if kind == "completion" else f"chatcmpl-{request_id}"
        obj = "text_completion" if kind == "completion" else "chat.completion"
        self._head = {"id": rid, "object": obj, "created": created, "model": model}
        chunk_obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        head = (
            b'data: {"id":' + jsonutil.dumps(rid) + b',"object":"' + chunk_obj.encode() + b'","created":'
            + str(created).encode() + b',"model":' + jsonutil.dumps(model) + b',"choices":[{"index":0,'
        )  # fmt: skip
        if kind == "completion":
            self._chunk_prefix = head + b'"text":'
            close = b""
        else:
            self._chunk_prefix = head + b'"delta":{"content":'
            close = b"}"
        self._chunk_suffix = close + b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        self._final_suffix = (
            close
            + b',"logprobs":null,"finish_reason":"'
            + FINISH_REASON.encode()
            + b'","stop_reason":null}]}\n\n'
        )

    def full(self, text: str, prompt_tokens: int, completion_tokens: int, kv_params: Any) -> bytes:
        """The non-streaming response body."""
        choice: dict[str, Any]
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
            }
        choice["finish_reason"] = FINISH_REASON
        choice["stop_reason"] = None
        return jsonutil.dumps(
            {
                **self._head,
                "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens),
                "prompt_logprobs": None,
                "kv_transfer_params": kv_params,
            }
        )

    def role_chunk(self) -> bytes:
        """Chat's first chunk, announcing the assistant (empty for completions)."""
        if self.kind == "completion":
            return b""
        return (
            self._chunk_prefix.removesuffix(b'"content":')
            + b'"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def token_chunk(self, json_word: bytes, last: bool) -> bytes:
        """One token's chunk; the last one carries the finish reason."""
        return self._chunk_prefix + json_word + (self._final_suffix if last else self._chunk_suffix)

    def chunks(self, json_words: list[bytes]) -> bytes:
        """All token chunks at once (the zero-delay path)."""
        if not json_words:
            return b""
        prefix, mid = self._chunk_prefix, self._chunk_suffix + self._chunk_prefix
        return prefix + mid.join([*json_words[:-1], json_words[-1] + self._final_suffix])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The final chunk when ``stream_options.include_usage`` is true."""
        head = {
            **self._head,
            "object": "text_completion" if self.kind == "completion" else "chat.completion.chunk",
        }
        body = {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
        return b"data: " + jsonutil.dumps(body) + b"\n\n"
