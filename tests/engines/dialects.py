"""The response bytes of several OpenAI-compatible engine versions, rendered from one generation.

A ``Generation`` is what an engine produced for a prompt (its token ids and the text its detokenizer
emitted per output step); a ``Dialect`` writes the exact HTTP body one engine version makes of it for
a request (completions or chat, streamed or not, ``stream_options.include_usage``,
``return_token_ids``), refusals included. Each renderer follows its version's source (file, function
and the class whose field order it copies are named at each shape; ``tests/fixtures/engines/README.md``
says where each comes from) and is checked against the fixtures; vLLM 0.32's against real recordings.

Every engine here serialises with pydantic (``model_dump_json``), Starlette's ``JSONResponse``
(``json.dumps(ensure_ascii=False, separators=(",", ":"))``), orjson or msgspec: for the values these
bodies hold (str, int, None, lists, objects) all four write the same bytes, so one compact encoder over
dicts in the classes' field order renders them all. Which keys are present follows each dump call's
``exclude_unset``/``exclude_none`` and the models' own serializers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SSE = "text/event-stream; charset=utf-8"  # Starlette's StreamingResponse(media_type="text/event-stream")
JSON = "application/json"
DONE = "data: [DONE]\n\n"

# What an engine can do with token ids (the agent probes these at registration).
COMPLETIONS_TOKEN_IDS = "completions_token_ids"  # streamed /v1/completions: prompt ids first, ids per chunk
CHAT_TOKEN_IDS = "chat_token_ids"  # the same for a streamed chat (prompt ids in the first chunk)
CHAT_PROMPT_IDS = "chat_prompt_ids"  # chat runs kv_transfer_params.prompt_token_ids instead of messages

Rendered = tuple[int, str, bytes]  # status, content type, body


@dataclass(frozen=True)
class Step:
    """One engine output step, as the detokenizer emitted it."""

    ids: tuple[int, ...]  # usually one id; vLLM may merge several into one event
    text: str  # "" when the detokenizer held bytes back (a token ending inside a UTF-8 char)


@dataclass(frozen=True)
class Generation:
    """A prompt's ids and what the engine generated for it."""

    prompt_ids: tuple[int, ...]
    steps: tuple[Step, ...]
    finish_reason: str  # "length" | "stop"
    stop_reason: str | int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens when the engine reports it

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for step in self.steps for t in step.ids)

    @property
    def text(self) -> str:
        return "".join(step.text for step in self.steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_ids": list(self.prompt_ids),
            "steps": [[list(s.ids), s.text] for s in self.steps],
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "cached_tokens": self.cached_tokens,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Generation:
        steps = tuple(Step(tuple(ids), text) for ids, text in data["steps"])
        reasons = data["finish_reason"], data["stop_reason"]
        return cls(tuple(data["prompt_ids"]), steps, *reasons, cached_tokens=data["cached_tokens"])


def compact(value: Any) -> str:
    """JSON as pydantic, Starlette's JSONResponse, orjson and msgspec write it (see the module doc)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def event(value: Any) -> str:
    return f"data: {compact(value)}\n\n"


@dataclass(frozen=True)
class Ask:
    """What a renderer reads from a request body."""

    chat: bool
    stream: bool
    usage: bool  # stream_options.include_usage
    ids: bool  # return_token_ids
    model: str

    @classmethod
    def of(cls, path: str, body: Mapping[str, Any]) -> Ask:
        stream = bool(body.get("stream"))
        usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
        return cls(path == CHAT, stream, usage, bool(body.get("return_token_ids")), str(body.get("model")))


def unset(fields: str, **values: Any) -> dict[str, Any]:
    """A model dumped with ``exclude_unset`` (or ``exclude_none``, or a serializer that drops keys):
    ``values`` only, in the class's field order (``fields``, space-separated, inherited ones first)."""
    names = fields.split()
    assert set(values) <= set(names), set(values) - set(names)
    return {name: values[name] for name in names if name in values}


def every(fields: str, **values: Any) -> dict[str, Any]:
    """A model dumped whole (``model_dump()``): every field in class order, None where not given."""
    return {name: values.get(name) for name in fields.split()}


def _counts(gen: Generation) -> dict[str, int]:
    """UsageInfo's counts (its first fields, in this order, in every version here)."""
    prompt, completion = len(gen.prompt_ids), len(gen.token_ids)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def _last(gen: Generation, i: int) -> bool:
    return i == len(gen.steps) - 1


def _chat_finish(gen: Generation, i: int) -> dict[str, Any]:
    """A vLLM chat chunk's finish fields: finish_reason always set, stop_reason only on the last step."""
    if _last(gen, i):
        return {"finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason}
    return {"finish_reason": None}


@dataclass(frozen=True)
class Dialect:
    """One engine version's bytes. Subclasses write the shapes; ``render`` picks one."""

    name: str
    version: str
    capabilities: frozenset[str]

    def response_id(self, path: str, request_id: str) -> str:
        raise NotImplementedError

    def render(
        self,
        path: str,
        body: Mapping[str, Any],
        gen: Generation,
        request_id: str,
        created: int,
        *,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> Rendered:
        """The whole HTTP answer to ``body`` on ``path`` for ``gen``."""
        ask = Ask.of(path, body)
        refused = self.refusal(ask)
        if refused is not None:
            return refused
        if ask.stream:
            return 200, SSE, "".join(self.events(path, body, gen, request_id, created)).encode()
        whole = self.whole(ask, gen, self.response_id(path, request_id), created, kv_transfer_params)
        return 200, JSON, compact(whole).encode()

    def events(
        self, path: str, body: Mapping[str, Any], gen: Generation, request_id: str, created: int
    ) -> list[str]:
        """A streamed answer's SSE events, ``[DONE]`` last (one HTTP chunk each, as the engines write)."""
        ask = Ask.of(path, body)
        rid = self.response_id(path, request_id)
        chunks = (
            self.chat_events(ask, gen, rid, created) if ask.chat else self.text_events(ask, gen, rid, created)
        )
        return [*chunks, DONE]

    def refusal(self, ask: Ask) -> Rendered | None:
        return None

    def text_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        raise NotImplementedError

    def chat_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        raise NotImplementedError

    def whole(
        self, ask: Ask, gen: Generation, rid: str, created: int, kv: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def died_event(self) -> str | None:
        """The event a stream carries (before ``[DONE]``) when the engine core dies mid-way; None when
        the server closes the connection instead."""
        return None

    def error_body(self, message: str, status: int) -> bytes:
        raise NotImplementedError

    def models_body(self, model: str, created: int, max_model_len: int) -> bytes:
        raise NotImplementedError

    def version_body(self) -> bytes | None:
        """``GET /version``; None where the server has no such route (a 404)."""
        return None

    def metrics_text(self, model: str, running: int) -> str:
        raise NotImplementedError


def _prometheus(gauges: Sequence[tuple[str, str]], labels: str, running: int) -> str:
    """Prometheus text: the first gauge says ``running``, the others 0."""
    lines = []
    for i, (name, help_text) in enumerate(gauges):
        value = float(running) if i == 0 else 0.0
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    return "\n".join(lines) + "\n"


# --- vLLM -------------------------------------------------------------------------------------------

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# vllm/entrypoints/openai/protocol.py (0.10) or serve/engine/protocol.py (0.32): ModelCard, ModelPermission.
MODEL_CARD = "id object created owned_by root parent max_model_len permission"
MODEL_PERMISSION = (
    "id object created allow_create_engine allow_sampling allow_logprobs allow_search_indices allow_view "
    "allow_fine_tuning organization group is_blocking"
)


@dataclass(frozen=True)
class _Vllm(Dialect):
    """What the vLLM versions share: ids ``cmpl-``/``chatcmpl-`` + X-Request-Id
    (``serving_engine.py::_base_request_id``), ``/v1/models`` (``serving_models.py``:
    ``show_available_models``), ``/version``, ``ErrorResponse{error: ErrorInfo}``, and the ``vllm:``
    metrics with ``model_name`` and ``engine`` labels (``v1/metrics/loggers.py``)."""

    def response_id(self, path: str, request_id: str) -> str:
        return f"{'chatcmpl' if path == CHAT else 'cmpl'}-{request_id}"

    def error_body(self, message: str, status: int) -> bytes:
        error = {"message": message, "type": "BadRequestError", "param": None, "code": status}
        return compact({"error": error}).encode()

    def models_body(self, model: str, created: int, max_model_len: int) -> bytes:
        permission = every(
            MODEL_PERMISSION, id=f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, model).hex[:16]}",
            object="model_permission", created=created, allow_create_engine=False, allow_sampling=True,
            allow_logprobs=True, allow_search_indices=False, allow_view=True, allow_fine_tuning=False,
            organization="*", is_blocking=False,
        )  # fmt: skip
        card = every(
            MODEL_CARD, id=model, object="model", created=created, owned_by="vllm", root=model,
            max_model_len=max_model_len, permission=[permission],
        )  # fmt: skip
        return compact({"object": "list", "data": [card]}).encode()

    def version_body(self) -> bytes | None:
        return compact({"version": self.version}).encode()

    def metrics_text(self, model: str, running: int) -> str:
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches."),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        ]
        return _prometheus(gauges, f'engine="0",model_name="{model}"', running)


# vLLM 0.32: completion/protocol.py, chat_completion/protocol.py, serve/engine/protocol.py.
V032_TEXT_CHUNK = "id object created model choices usage system_fingerprint metrics"
V032_TEXT_CHUNK_CHOICE = "index text logprobs finish_reason stop_reason prompt_token_ids token_ids"
V032_TEXT = (
    "id object created model choices service_tier system_fingerprint usage kv_transfer_params "
    "ec_transfer_params metrics"
)
V032_TEXT_CHOICE = (
    "index text logprobs finish_reason stop_reason token_ids prompt_logprobs prompt_token_ids routed_experts"
)
V032_CHAT_CHUNK = (
    "id object created model choices usage system_fingerprint prompt_token_ids prompt_text metrics"
)
V032_CHAT_CHUNK_CHOICE = "index delta logprobs finish_reason stop_reason token_ids"
V032_DELTA = "role content reasoning tool_calls"  # generate/base/protocol.py
V032_CHAT = (
    "id object created model choices service_tier system_fingerprint usage prompt_logprobs prompt_token_ids "
    "prompt_text kv_transfer_params ec_transfer_params metrics"
)
V032_CHAT_CHOICE = "index message logprobs finish_reason stop_reason token_ids routed_experts"
V032_MESSAGE = "role content refusal annotations audio function_call reasoning"  # empty tool_calls dropped
V032_USAGE = "prompt_tokens total_tokens completion_tokens prompt_tokens_details completion_tokens_details"
V032_PROMPT_DETAILS = "cached_tokens created_cache_tokens multimodal_tokens"


@dataclass(frozen=True)
class Vllm032(_Vllm):
    """vLLM 0.32 (``vllm/entrypoints/openai/{completion,chat_completion}/serving.py``), as recorded with
    ``--enable-prompt-tokens-details`` (docs/vllm-resume-facts.md shows the bytes)."""

    fingerprint: str = "vllm-0.32.0-0ccec80a"  # vllm-<version>-<config hash>: the recording's config

    def _details(self, gen: Generation, ask: Ask) -> dict[str, Any] | None:
        """PromptTokenUsageInfo when the engine reports cached tokens: chat also sets created_cache_tokens."""
        if gen.cached_tokens is None:
            return None
        if ask.chat:
            return unset(V032_PROMPT_DETAILS, cached_tokens=gen.cached_tokens, created_cache_tokens=0)
        return unset(V032_PROMPT_DETAILS, cached_tokens=gen.cached_tokens)

    def _usage_event(self, ask: Ask, gen: Generation, head: dict[str, Any], fields: str) -> str:
        # The stream generators' last chunk: model_dump_json(exclude_none=True), fingerprint after usage.
        details = self._details(gen, ask)
        usage = unset(V032_USAGE, **_counts(gen), **({"prompt_tokens_details": details} if details else {}))
        return event(unset(fields, **head, choices=[], usage=usage, system_fingerprint=self.fingerprint))

    def text_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        # completion/serving.py::completion_stream_generator, model_dump_json(exclude_unset=True): every
        # choice field is set; prompt ids in the first chunk, both id fields only with return_token_ids;
        # the fingerprint on the finish chunk unless a usage chunk follows.
        head = {"id": rid, "object": "text_completion", "created": created, "model": ask.model}
        events = []
        for i, step in enumerate(gen.steps):
            last = _last(gen, i)
            choice = unset(
                V032_TEXT_CHUNK_CHOICE, index=0, text=step.text, logprobs=None,
                finish_reason=gen.finish_reason if last else None,
                stop_reason=gen.stop_reason if last else None,
                prompt_token_ids=list(gen.prompt_ids) if ask.ids and i == 0 else None,
                token_ids=list(step.ids) if ask.ids else None,
            )  # fmt: skip
            fingerprint = {"system_fingerprint": self.fingerprint} if last and not ask.usage else {}
            events.append(event(unset(V032_TEXT_CHUNK, **head, choices=[choice], **fingerprint)))
        if ask.usage:
            events.append(self._usage_event(ask, gen, head, V032_TEXT_CHUNK))
        return events

    def chat_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        # chat_completion/serving.py::chat_completion_stream_generator, model_dump_json(exclude_unset=True):
        # a role chunk with prompt_token_ids and prompt_text at the top level, then a chunk per step (its
        # token_ids; stop_reason only on the finish chunk, with the fingerprint unless usage follows).
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ask.model}
        delta = unset(V032_DELTA, role="assistant", content="")
        role = unset(V032_CHAT_CHUNK_CHOICE, index=0, delta=delta, logprobs=None, finish_reason=None)
        prompt_ids = list(gen.prompt_ids) if ask.ids else None
        first = unset(V032_CHAT_CHUNK, **head, choices=[role], prompt_token_ids=prompt_ids, prompt_text=None)
        events = [event(first)]
        for i, step in enumerate(gen.steps):
            finish = _chat_finish(gen, i)
            choice = unset(
                V032_CHAT_CHUNK_CHOICE, index=0, delta=unset(V032_DELTA, content=step.text), logprobs=None,
                **finish, token_ids=list(step.ids) if ask.ids else None,
            )  # fmt: skip
            fingerprint = {"system_fingerprint": self.fingerprint} if _last(gen, i) and not ask.usage else {}
            events.append(event(unset(V032_CHAT_CHUNK, **head, choices=[choice], **fingerprint)))
        if ask.usage:
            events.append(self._usage_event(ask, gen, head, V032_CHAT_CHUNK))
        return events

    def whole(
        self, ask: Ask, gen: Generation, rid: str, created: int, kv: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        # {completion,chat_completion}/api_router.py: JSONResponse(content=generator.model_dump()).
        details = self._details(gen, ask)
        details = details and every(V032_PROMPT_DETAILS, **details)  # model_dump(): every field
        usage = every(V032_USAGE, **_counts(gen), prompt_tokens_details=details)
        ids = list(gen.token_ids) if ask.ids else None
        prompt_ids = list(gen.prompt_ids) if ask.ids else None
        common = {"id": rid, "created": created, "model": ask.model, "system_fingerprint": self.fingerprint}
        common.update(usage=usage, kv_transfer_params=dict(kv) if kv else None)
        if ask.chat:
            message = every(V032_MESSAGE, role="assistant", content=gen.text)
            choice = every(
                V032_CHAT_CHOICE, index=0, message=message, finish_reason=gen.finish_reason,
                stop_reason=gen.stop_reason, token_ids=ids,
            )  # fmt: skip
            common.update(object="chat.completion", prompt_token_ids=prompt_ids)
            return every(V032_CHAT, **common, choices=[choice])
        choice = every(
            V032_TEXT_CHOICE, index=0, text=gen.text, finish_reason=gen.finish_reason,
            stop_reason=gen.stop_reason, token_ids=ids, prompt_token_ids=prompt_ids,
        )  # fmt: skip
        return every(V032_TEXT, **common, object="text_completion", choices=[choice])

    def died_event(self) -> str | None:
        # Measured (docs/vllm-resume-facts.md §4): json.dumps spacing, InternalServerError 500.
        error = {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}
        return f"data: {json.dumps({'error': error})}\n\n"


# vLLM 0.10.1.1 / 0.10.2: vllm/entrypoints/openai/protocol.py. "+" marks the fields 0.10.2 added.
V010_TEXT_CHUNK = "id object created model choices usage"
V010_TEXT_CHUNK_CHOICE = "index text logprobs finish_reason stop_reason +prompt_token_ids +token_ids"
V010_TEXT = "id object created model choices service_tier system_fingerprint usage kv_transfer_params"
V010_TEXT_CHOICE = (
    "index text logprobs finish_reason stop_reason +token_ids prompt_logprobs +prompt_token_ids"
)
V010_CHAT_CHUNK = "id object created model choices usage +prompt_token_ids"
V010_CHAT_CHUNK_CHOICE = "index delta logprobs finish_reason stop_reason +token_ids"
V010_DELTA = "role content reasoning_content tool_calls"
V010_CHAT = (
    "id object created model choices service_tier system_fingerprint usage prompt_logprobs +prompt_token_ids "
    "kv_transfer_params"
)
V010_CHAT_CHOICE = "index message logprobs finish_reason stop_reason +token_ids"
V010_MESSAGE = "role content refusal annotations audio function_call tool_calls reasoning_content"
V010_USAGE = "prompt_tokens total_tokens completion_tokens prompt_tokens_details"


@dataclass(frozen=True)
class Vllm010(_Vllm):
    """vLLM 0.10.1.1 and 0.10.2 (``vllm/entrypoints/openai/{serving_completion,serving_chat}.py``).
    ``token_ids``: the fields of ``return_token_ids`` exist (0.10.2, PR #22587). 0.10.1.1 ignores the
    parameter (``OpenAIBaseModel`` has ``extra="allow"``: an unknown request field is only logged)."""

    token_ids: bool = False

    def fields(self, spec: str) -> str:
        """A class's fields in this version: the ``+`` ones exist from 0.10.2 on."""
        return " ".join(f.lstrip("+") for f in spec.split() if self.token_ids or not f.startswith("+"))

    def _usage(self, gen: Generation) -> dict[str, Any]:
        # A cached count is reported only when non-zero (``if self.enable_prompt_tokens_details and
        # num_cached_tokens``); the stream's usage chunk (exclude_none) then leaves the key out.
        details = {"cached_tokens": gen.cached_tokens} if gen.cached_tokens else None
        return unset(V010_USAGE, **_counts(gen), **({"prompt_tokens_details": details} if details else {}))

    def text_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        # serving_completion.py::completion_stream_generator, model_dump_json(exclude_unset=False): every
        # field ("usage":null in each chunk). 0.10.2 puts the prompt ids in the first chunk whether or not
        # return_token_ids is set (``has_echoed`` is reused for them unconditionally); token_ids need it.
        head = {"id": rid, "object": "text_completion", "created": created, "model": ask.model}
        events = []
        for i, step in enumerate(gen.steps):
            last = _last(gen, i)
            choice = every(
                self.fields(V010_TEXT_CHUNK_CHOICE), index=0, text=step.text,
                finish_reason=gen.finish_reason if last else None,
                stop_reason=gen.stop_reason if last else None,
                prompt_token_ids=list(gen.prompt_ids) if i == 0 else None,
                token_ids=list(step.ids) if ask.ids else None,
            )  # fmt: skip
            events.append(event(every(V010_TEXT_CHUNK, **head, choices=[choice])))
        if ask.usage:  # model_dump_json(exclude_unset=False, exclude_none=True)
            events.append(event(unset(V010_TEXT_CHUNK, **head, choices=[], usage=self._usage(gen))))
        return events

    def chat_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        # serving_chat.py::chat_completion_stream_generator, model_dump_json(exclude_unset=True): the role
        # chunk sets prompt_token_ids (0.10.2), token chunks token_ids (0.10.2), the finish chunk
        # stop_reason; no system_fingerprint anywhere. The usage chunk adds exclude_none=True.
        chunk, choice_fields = self.fields(V010_CHAT_CHUNK), self.fields(V010_CHAT_CHUNK_CHOICE)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ask.model}
        delta = unset(V010_DELTA, role="assistant", content="")
        role = unset(choice_fields, index=0, delta=delta, logprobs=None, finish_reason=None)
        prompt_ids = {"prompt_token_ids": list(gen.prompt_ids) if ask.ids else None} if self.token_ids else {}
        events = [event(unset(chunk, **head, choices=[role], **prompt_ids))]
        for i, step in enumerate(gen.steps):
            finish = _chat_finish(gen, i)
            ids = {"token_ids": list(step.ids) if ask.ids else None} if self.token_ids else {}
            delta = unset(V010_DELTA, content=step.text)
            choice = unset(choice_fields, index=0, delta=delta, logprobs=None, **finish, **ids)
            events.append(event(unset(chunk, **head, choices=[choice])))
        if ask.usage:
            events.append(event(unset(chunk, **head, choices=[], usage=self._usage(gen))))
        return events

    def whole(
        self, ask: Ask, gen: Generation, rid: str, created: int, kv: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        # api_server.py: JSONResponse(content=generator.model_dump()).
        usage = every(V010_USAGE, **self._usage(gen))
        ids = list(gen.token_ids) if ask.ids else None
        prompt_ids = list(gen.prompt_ids) if ask.ids else None
        common = {"id": rid, "created": created, "model": ask.model, "usage": usage}
        common["kv_transfer_params"] = dict(kv) if kv else None
        if ask.chat:
            message = every(V010_MESSAGE, role="assistant", content=gen.text, tool_calls=[])
            choice = every(
                self.fields(V010_CHAT_CHOICE), index=0, message=message, finish_reason=gen.finish_reason,
                stop_reason=gen.stop_reason, token_ids=ids,
            )  # fmt: skip
            common.update(object="chat.completion", prompt_token_ids=prompt_ids)
            return every(self.fields(V010_CHAT), **common, choices=[choice])
        choice = every(
            self.fields(V010_TEXT_CHOICE), index=0, text=gen.text, finish_reason=gen.finish_reason,
            stop_reason=gen.stop_reason, token_ids=ids, prompt_token_ids=prompt_ids,
        )  # fmt: skip
        return every(V010_TEXT, **common, object="text_completion", choices=[choice])

    def died_event(self) -> str | None:
        # The stream generators' ``except Exception``: create_streaming_error_response(str(e)) with its
        # defaults (BadRequestError, 400), json.dumps spacing; then [DONE].
        error = {"message": ENGINE_DEAD, "type": "BadRequestError", "param": None, "code": 400}
        return f"data: {json.dumps({'error': error})}\n\n"


# --- SGLang -----------------------------------------------------------------------------------------

SGLANG_STREAM_CHAT_IDS = (
    "return_token_ids is not supported with streaming on /v1/chat/completions. "
    "Please set stream=false when using return_token_ids=true."
)
# sglang/srt/entrypoints/openai/protocol.py; the choices' serializers drop None ids and hidden_states,
# the responses' a None sglext, ChatMessage a None tool_calls.
SGL_TEXT_CHUNK = "id object created model choices usage"
SGL_TEXT_CHOICE = "index text logprobs finish_reason matched_stop token_ids prompt_token_ids"
SGL_TEXT = "id object created model choices usage metadata"
SGL_CHAT_CHOICE = "index message logprobs finish_reason matched_stop prompt_token_ids response_token_ids"
SGL_MESSAGE = "role content reasoning_content"
SGL_USAGE = (
    "prompt_tokens total_tokens completion_tokens prompt_tokens_details reasoning_tokens "
    "completion_tokens_details"
)
# sse_utils.py: the msgspec structs build_sse_content encodes (StreamDelta and StreamChunk omit defaults).
SGL_SSE_CHOICE = "index delta logprobs finish_reason matched_stop"
SGL_SSE_DELTA = "reasoning_content role content"


@dataclass(frozen=True)
class Sglang(Dialect):
    """SGLang 0.5.23 (``sglang/srt/entrypoints/openai/{serving_completions,serving_chat,serving_base,
    sse_utils,usage_processor}.py``, ``entrypoints/http_server.py``), default server arguments except that
    a generation with ``cached_tokens`` stands for ``--enable-cache-report``."""

    weight_version: str = "default"  # ServerArgs.weight_version: the bodies' metadata

    def response_id(self, path: str, request_id: str) -> str:
        # The id is the request's rid (io_struct.py: uuid4().hex unless the body sets ``rid``);
        # X-Request-Id is ignored. Here a uuid5 of the header: the same 32 hex digits, repeatable.
        return uuid.uuid5(uuid.NAMESPACE_URL, request_id).hex

    def refusal(self, ask: Ask) -> Rendered | None:
        # serving_chat.py::_convert_to_internal_request raises ValueError; serving_base.py::handle_request
        # answers create_error_response(str(e), "BadRequest", 400), an ORJSONResponse of ErrorResponse.
        if ask.chat and ask.stream and ask.ids:
            return 400, JSON, self.error_body(SGLANG_STREAM_CHAT_IDS, 400, "BadRequest")
        return None

    def error_body(self, message: str, status: int, kind: str = "BadRequestError") -> bytes:
        error = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
        return compact(error).encode()

    def _usage(self, gen: Generation) -> dict[str, Any]:
        # usage_processor.py::calculate_token_usage; cached tokens only with --enable-cache-report.
        details = None if gen.cached_tokens is None else {"cached_tokens": gen.cached_tokens}
        return every(SGL_USAGE, **_counts(gen), prompt_tokens_details=details, reasoning_tokens=0)

    def text_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        # serving_completions.py::_generate_completion_stream: chunk.model_dump_json() ("usage":null in
        # each chunk; matched_stop after finish_reason; token_ids per chunk and prompt_token_ids in the
        # first, with return_token_ids). The usage chunk: model_dump_json(exclude_none=True).
        head = {"id": rid, "object": "text_completion", "created": created, "model": ask.model}
        events = []
        for i, step in enumerate(gen.steps):
            last = _last(gen, i)
            ids = {"token_ids": list(step.ids)} if ask.ids else {}
            if ask.ids and i == 0:
                ids["prompt_token_ids"] = list(gen.prompt_ids)
            choice = unset(
                SGL_TEXT_CHOICE, index=0, text=step.text, logprobs=None,
                finish_reason=gen.finish_reason if last else None,
                matched_stop=gen.stop_reason if last else None, **ids,
            )  # fmt: skip
            events.append(event(every(SGL_TEXT_CHUNK, **head, choices=[choice])))
        if ask.usage:
            usage = {k: v for k, v in self._usage(gen).items() if v is not None}
            events.append(event(unset(SGL_TEXT_CHUNK, **head, choices=[], usage=usage)))
        return events

    def chat_events(self, ask: Ask, gen: Generation, rid: str, created: int) -> list[str]:
        # serving_chat.py::_generate_chat_stream and sse_utils.build_sse_content: a role chunk, a content
        # chunk per step with text (_generate_stream_content skips an empty delta), then a finish chunk
        # with an empty delta and matched_stop. The usage chunk is ChatCompletionStreamResponse
        # .model_dump_json(): every usage field.
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ask.model}

        def sse(finish: str | None = None, stop: str | int | None = None, **delta: str) -> str:
            delta = unset(SGL_SSE_DELTA, reasoning_content=None, **delta)
            choice = every(SGL_SSE_CHOICE, index=0, delta=delta, finish_reason=finish, matched_stop=stop)
            return event({**head, "choices": [choice]})

        events = [sse(role="assistant", content="")]
        events += [sse(content=step.text) for step in gen.steps if step.text]
        events.append(sse(gen.finish_reason, gen.stop_reason))
        if ask.usage:
            events.append(event(every(SGL_TEXT_CHUNK, **head, choices=[], usage=self._usage(gen))))
        return events

    def whole(
        self, ask: Ask, gen: Generation, rid: str, created: int, kv: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        # http_server.py: model_json_response -> model_dump_json(by_alias=True); metadata from
        # build_endpoint_weight_version_metadata.
        finish = {"finish_reason": gen.finish_reason, "matched_stop": gen.stop_reason, "logprobs": None}
        prompt_ids, ids = list(gen.prompt_ids), list(gen.token_ids)
        if ask.chat:  # serving_chat.py::_build_chat_response
            ids_of = {"prompt_token_ids": prompt_ids, "response_token_ids": ids} if ask.ids else {}
            message = every(SGL_MESSAGE, role="assistant", content=gen.text)
            choice = unset(SGL_CHAT_CHOICE, index=0, message=message, **finish, **ids_of)
        else:  # serving_completions.py::_build_completion_response
            ids_of = {"token_ids": ids, "prompt_token_ids": prompt_ids} if ask.ids else {}
            choice = unset(SGL_TEXT_CHOICE, index=0, text=gen.text, **finish, **ids_of)
        body = every(
            SGL_TEXT, id=rid, object="chat.completion" if ask.chat else "text_completion", created=created,
            model=ask.model, choices=[choice], usage=self._usage(gen),
            metadata={"weight_version": self.weight_version},
        )  # fmt: skip
        if kv:  # not SGLang's (its PD handoff is bootstrap_* fields): added for the gateway's prefill leg
            body["kv_transfer_params"] = dict(kv)
        return body

    def models_body(self, model: str, created: int, max_model_len: int) -> bytes:
        # http_server.py::available_models: ModelCard(id, root=served name, max_model_len), no permission.
        card = every(
            "id object created owned_by root parent max_model_len", id=model, object="model", created=created,
            owned_by="sglang", root=model, max_model_len=max_model_len,
        )  # fmt: skip
        return compact({"object": "list", "data": [card]}).encode()

    def metrics_text(self, model: str, running: int) -> str:
        # observability/metrics_collector.py: SchedulerMetricsCollector's gauges and labels.
        gauges = [
            ("sglang:num_running_reqs", "The number of running requests."),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
            ("sglang:token_usage", "The token usage."),
        ]
        labels = f'engine_type="unified",model_name="{model}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
        return _prometheus(gauges, labels, running)


ALL_IDS = frozenset({COMPLETIONS_TOKEN_IDS, CHAT_TOKEN_IDS, CHAT_PROMPT_IDS})
DIALECTS: dict[str, Dialect] = {
    "vllm-0.10.1.1": Vllm010("vllm-0.10.1.1", "0.10.1.1", frozenset()),
    "vllm-0.10.2": Vllm010("vllm-0.10.2", "0.10.2", ALL_IDS - {CHAT_PROMPT_IDS}, token_ids=True),
    "vllm-0.32": Vllm032("vllm-0.32", "0.32.0", ALL_IDS),
    "sglang": Sglang("sglang", "0.5.23", frozenset({COMPLETIONS_TOKEN_IDS})),
}
