"""The gateway's tokenizer: a request body -> the exact token ids the engine will see.

The orchestrator hashes a prompt's blocks the way the engine's prefix cache does, so the ids must be
the engine's own. The simulated engine's byte tokenizer is exact by construction (its own functions).
For vLLM the model's Hugging Face tokenizer is loaded in a thread on first registration and used the
way vLLM 0.32's OpenAI server uses it (``vllm/renderers/`` and ``entrypoints/openai/``; summary in
docs/scheduler.md "Tokenization"; the chat template's content format in ``content_format``). What
cannot be reproduced exactly (tools, images, a chat template in the request, truncation, a cache salt,
Mistral or Harmony formats) yields None: no answer beats a wrong one. transformers and jinja2 are
imported only in the loading thread: the orchestrator starts without. On the event loop,
``tokenize_nowait`` answers hits and byte tokenizations at once and sends a Hugging Face tokenizer's
misses to a worker thread (``tokenize_worker``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import inspect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

from vllm_disagg import jsonutil
from vllm_disagg.errors import BadRequest
from vllm_disagg.model import sim as sim_model
from vllm_disagg.orchestrator.gateway.content_format import ContentFormat, content_format
from vllm_disagg.orchestrator.gateway.tokenize_worker import (
    DEFAULT_MAX_PENDING,
    TokenizeMetrics,
    TokenizeWorker,
)
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.wire.kv_transfer import reused_prompt_ids
from vllm_disagg.wire.openai import messages_of, prompt_of

log = logging.getLogger(__name__)

Route = Literal["completions", "chat_completions"]
ENGINES = ("sim", "vllm")

# Body fields that can change a prompt's token ids, or make them unknowable here, per route. Only
# these feed the cache key, so a request's max_tokens or stream flag does not defeat the cache.
_FIELDS: Mapping[Route, tuple[str, ...]] = {
    "completions": (
        "prompt", "add_special_tokens", "suffix", "prompt_embeds", "truncate_prompt_tokens", "cache_salt",
    ),
    "chat_completions": (
        "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "echo",
        "chat_template", "chat_template_kwargs", "documents", "reasoning_effort", "tools", "tool_choice",
        "truncate_prompt_tokens", "cache_salt",
    ),
}  # fmt: skip
# Completions fields vLLM would act on in ways not reproduced here (FIM, embeddings, truncation).
# A cache salt keeps the ids but changes every block hash, so it is refused too.
_COMPLETION_REFUSED = ("suffix", "prompt_embeds", "truncate_prompt_tokens", "cache_salt")
_CHAT_REFUSED = ("tools", "chat_template", "truncate_prompt_tokens", "cache_salt")
# vLLM passes these itself (chat_template, tokenize) or they change what apply_chat_template returns.
_KWARGS_ALWAYS_REFUSED = frozenset({"chat_template", "tokenize"})
_KWARGS_OVERRIDDEN = frozenset({"add_generation_prompt", "continue_final_message", "documents"})
# vLLM 0.32 drops a system text part's first line when it starts with this; not reproduced.
_BILLING_HEADER = "x-anthropic-billing-header"
# Model types for which vLLM bypasses AutoTokenizer (tokenizers/registry.py).
_OVERRIDDEN_TOKENIZER_MODEL_TYPES = frozenset(
    {"internlm2", "step3_vl", "step3p7", "unlimited-ocr", "unlimited_ocr"}
)
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


class _Tokenizer(Protocol):
    @property
    def inline(self) -> bool: ...  # cheap enough to run on the event loop: a thread hop would cost more

    def completions(self, body: Mapping[str, Any]) -> list[int] | None: ...

    def chat_completions(self, body: Mapping[str, Any]) -> list[int] | None: ...


class _SimTokenizer:
    """The simulated engine's own parsing and byte tokenizer."""

    inline = True  # microseconds: the hot path of the gateway benchmarks

    def completions(self, body: Mapping[str, Any]) -> list[int] | None:
        try:
            prompt = prompt_of(body)
        except BadRequest:
            return None
        return sim_model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def chat_completions(self, body: Mapping[str, Any]) -> list[int] | None:
        try:
            templated = sim_model.apply_chat_template(messages_of(body))
            params = body.get("kv_transfer_params")
            mapping = params if isinstance(params, dict) else None
            reused = reused_prompt_ids(body, mapping, sim_model.VOCAB_SIZE)
        except BadRequest:
            return None
        # As vLLM 0.32: ids forwarded in kv_transfer_params run instead of the templated messages.
        return list(reused) if reused else sim_model.tokenize(templated)


@dataclass(frozen=True, slots=True)
class _HfTokenizer:
    """A Hugging Face tokenizer used the way vLLM 0.32's OpenAI server uses it."""

    inline = False  # milliseconds of Python (jinja, transformers) for a long prompt

    tok: Any
    template: str | None  # the tokenizer's chat template; None: vLLM would use a fallback
    content_format: ContentFormat
    own_params: frozenset[str]  # apply_chat_template's named parameters
    chat_refusal: str  # why chat is never tokenized for this model; "" when it is

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # vLLM also passes truncation to max_model_len + 1, which only matters for prompts it rejects.
        ids: list[int] = self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def completions(self, body: Mapping[str, Any]) -> list[int] | None:
        add_special_tokens = body.get("add_special_tokens", True)
        if not isinstance(add_special_tokens, bool) or any(
            body.get(k) is not None for k in _COMPLETION_REFUSED
        ):
            return None
        try:
            prompt = prompt_of(body)  # one prompt: text, token ids, or a batch of one
        except BadRequest:
            return None
        return (self._encode(prompt, add_special_tokens) or None) if isinstance(prompt, str) else list(prompt)

    def chat_completions(self, body: Mapping[str, Any]) -> list[int] | None:
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final_message = body.get("continue_final_message", False)
        add_special_tokens = body.get("add_special_tokens", False)
        if (
            self.chat_refusal
            or not all(isinstance(v, bool) for v in (add_generation_prompt, continue_final_message))
            or not isinstance(add_special_tokens, bool)
            or (add_generation_prompt and continue_final_message)  # vLLM: 400
            or any(body.get(k) is not None for k in _CHAT_REFUSED)
            or body.get("tool_choice") not in (None, "none")  # needs a tool parser
        ):
            return None
        conversation = _conversation(body.get("messages"), self.content_format)
        kwargs = self._template_kwargs(body, add_generation_prompt, continue_final_message)
        if conversation is None or kwargs is None:
            return None
        present, reused = _reused_ids(body)
        if present:
            return reused
        text = self.tok.apply_chat_template(
            conversation, tools=None, chat_template=self.template, tokenize=False, return_dict=False, **kwargs
        )
        return (self._encode(text, add_special_tokens) or None) if isinstance(text, str) else None

    def _template_kwargs(
        self, body: Mapping[str, Any], add_generation_prompt: bool, continue_final_message: bool
    ) -> dict[str, Any] | None:
        """The template variables vLLM passes: the request's kwargs under its own fields."""
        requested = body.get("chat_template_kwargs") or {}
        if not isinstance(requested, dict):
            return None
        # vLLM's merge_kwargs drops None and "auto" as "unset".
        kwargs = {k: v for k, v in requested.items() if v is not None and v != "auto"}
        if kwargs.keys() & _KWARGS_ALWAYS_REFUSED or (kwargs.keys() & self.own_params) - _KWARGS_OVERRIDDEN:
            return None
        kwargs["add_generation_prompt"] = add_generation_prompt
        kwargs["continue_final_message"] = continue_final_message
        if (documents := body.get("documents")) is not None:
            kwargs["documents"] = documents
        if (effort := body.get("reasoning_effort")) is not None:
            kwargs["reasoning_effort"] = effort
            if "enable_thinking" not in requested:
                kwargs["enable_thinking"] = effort != "none"
        # Variables the template never reads are passed too: vLLM filters them out, to the same text.
        return kwargs


def _reused_ids(body: Mapping[str, Any]) -> tuple[bool, list[int] | None]:
    """``kv_transfer_params.prompt_token_ids``, which vLLM 0.32 feeds to the engine instead of rendering
    chat messages (decode-side reuse): (present, the ids or None when vLLM would refuse them). A client's
    never arrive here: parsing removes them (``control_fields``), so only a body the gateway built may
    name ids its tokenization and prefix lookup then take as the prompt."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, Mapping) or params.get("prompt_token_ids") is None or body.get("echo"):
        return False, None
    ids = params["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        return True, None
    return True, ids


def _texts(content: object) -> list[str] | None:
    """A message's text parts; None for anything but text (images, audio, unknown fields)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.keys() == {"type", "text"} and part["type"] == "text"):
            return None
        if not isinstance(text := part["text"], str):
            return None
        texts.append(text)
    return texts


def _conversation(messages: object, content_format: ContentFormat) -> list[dict[str, Any]] | None:
    """The messages as vLLM 0.32 hands them to the template (``renderers/chat_utils.py``)."""
    if not isinstance(messages, list) or not messages:
        return None
    conversation: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        texts = _texts(message.get("content"))
        # developer messages may be rewritten to system ones, tool messages carry tool-call state.
        if not isinstance(role, str) or role in ("developer", "tool") or texts is None:
            return None
        if role == "system" and any(t.startswith(_BILLING_HEADER) for t in texts):
            return None
        content: str | list[dict[str, str]]
        if content_format == "openai":
            content = [{"type": "text", "text": t} for t in texts]
        else:
            content = "\n".join(t for t in texts if t)  # vLLM skips empty parts, joins with newlines
        turn: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if message.get("tool_calls"):
                return None
            if (reasoning := message.get("reasoning")) is not None:
                if not isinstance(reasoning, str):
                    return None
                turn["reasoning"] = turn["reasoning_content"] = reasoning
        for key in ("name", "task"):
            if isinstance(value := message.get(key), str):
                turn[key] = value
        conversation.append(turn)
    return conversation


# --- loading -------------------------------------------------------------------------------------


def _model_type(path: Path) -> str:
    try:
        config = jsonutil.loads((path / "config.json").read_bytes())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def preload_tokenizer_libs() -> float | None:
    """Import transformers' tokenizer machinery now, before serving; seconds taken, None if absent.

    ``AutoTokenizer.from_pretrained`` imports torch (through transformers' generation config), whose
    native libraries load while holding the GIL: done lazily on the loading thread mid-traffic, that
    froze this process's event loop for 15 s at a time on a busy 2-core machine, and heartbeats went
    unread long enough for a live instance to be declared dead. Done before the loop starts, it costs
    start-up time and memory only.
    """
    started = time.monotonic()
    try:
        importlib.import_module("transformers.generation.logits_process")
        importlib.import_module("transformers").AutoTokenizer  # noqa: B018 - the lazy attribute loads it
    except Exception as exc:  # not installed, or broken: the loading thread reports it per model
        log.info("tokenizer libraries not preloaded: %s", _reason(exc))
        return None
    took = time.monotonic() - started
    log.info("tokenizer libraries preloaded in %.1fs", took)
    return took


def load_hf_tokenizer(directory: str) -> _HfTokenizer:
    """Load a model directory's tokenizer as vLLM would; raises when vLLM would use another one."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"no such directory: {directory}")
    if any(path.glob("consolidated*.safetensors")) and (
        (path / "tekken.json").exists() or any(path.glob("tokenizer.model.v*"))
    ):
        raise ValueError("a Mistral-format model: vLLM tokenizes it with mistral_common")
    model_type = _model_type(path)
    if model_type in _OVERRIDDEN_TOKENIZER_MODEL_TYPES:
        raise ValueError(f"model type {model_type}: vLLM overrides its tokenizer class")
    transformers = importlib.import_module("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    try:
        template: str | None = tok.get_chat_template(None, tools=None)
    except Exception:  # no template: vLLM falls back to a built-in one per model type
        template = None
    own_params = frozenset(
        name
        for name, p in inspect.signature(tok.apply_chat_template).parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )
    refusal = ""
    if template is None:
        refusal = "the tokenizer has no chat template"
    elif model_type == "gpt_oss":
        refusal = "gpt-oss chat is rendered with Harmony"
    elif any((path / name).exists() for name in _PROCESSOR_FILES):
        refusal = "the model has a processor, whose chat template vLLM prefers"
    return _HfTokenizer(
        tok, template, content_format(template) if template else "string", own_params, refusal
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"transformers is not installed ({exc})"
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."


@dataclass(eq=False, slots=True)
class _Entry:
    engine: str
    source: str
    status: str
    tokenizer: _Tokenizer | None = None


class Tokenizers:
    """Per-model tokenizers, loaded lazily off the event loop and cached."""

    def __init__(
        self,
        *,
        max_cached_prompts: int = 4096,
        executor: concurrent.futures.Executor | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        metrics: TokenizeMetrics | None = None,
    ) -> None:
        """``executor`` loads tokenizers; ``max_pending`` bounds the tokenizations waiting for the worker."""
        if max_cached_prompts < 0:
            raise ValueError("max_cached_prompts must be >= 0")
        self._max_cached = max_cached_prompts
        self._executor = executor
        # Not the loading thread: a load takes seconds, and tokenizations queued behind it would wait
        # that long (with the queue full meanwhile); a tokenization must never wait for a load.
        self._worker = TokenizeWorker(max_pending, metrics)
        self._own_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # entries change from the loading thread too
        self._entries: dict[str, _Entry] = {}
        # (model, route, digest of the prompt fields) -> (tokenizer, ids): a hit counts only for
        # the tokenizer that produced it, so a replaced tokenizer never serves old answers.
        self._cache: OrderedDict[tuple[str, str, bytes], tuple[_Tokenizer, list[int] | None]] = OrderedDict()
        # The KV block sizes of the instances seen: a prompt's block keys for them are hashed with its
        # tokenization (on the worker thread) and cached with its ids (``PromptTokens``).
        self.block_sizes: tuple[int, ...] = ()

    def note_block_size(self, block_size: int) -> None:
        """An instance with this KV block size joined: hash prompts' block keys for it from now on."""
        if block_size > 0 and block_size not in self.block_sizes:
            self.block_sizes = (*self.block_sizes, block_size)  # one assignment: the thread sees old or new

    def register(self, model: str, engine: str, tokenizer: str) -> None:
        """Say how ``model``'s prompts are tokenized: ``sim`` bytes, or vLLM with a tokenizer directory."""
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        with self._lock:
            old = self._entries.get(model)
            if old is not None and (old.engine, old.source) == (engine, tokenizer):
                return
            if old is not None:
                log.warning(
                    "model %s: tokenizer changes from %s %r to %s %r", model, old.engine, old.source,
                    engine, tokenizer,
                )  # fmt: skip
            if engine == "sim":
                entry = _Entry(engine, tokenizer, "bytes", _SimTokenizer())
            elif not tokenizer:
                entry = _Entry(engine, tokenizer, "none")
            else:
                entry = _Entry(engine, tokenizer, "loading")
            self._entries[model] = entry
        if entry.status == "loading":
            try:
                future = self._loader().submit(load_hf_tokenizer, tokenizer)
            except RuntimeError as exc:  # an executor already shut down
                self._loaded(model, entry, exc)
            else:
                future.add_done_callback(partial(self._on_done, model, entry))

    def tokenize(self, model: str, route: Route, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None when they cannot be known exactly.

        Synchronous, on the calling thread: a repeated prompt costs a digest and a dict lookup, a new
        one its whole tokenization (on the event loop, use ``tokenize_nowait``). The list returned may
        be the cached one: do not modify it.
        """
        tok = self._tokenizer(model)
        if tok is None:
            return None
        key = _cache_key(model, route, body)
        hit = self._hit(key, tok)
        return hit[1] if hit is not None else self._remember(key, tok, _run(tok, model, route, body))

    def tokenize_nowait(
        self, model: str, route: Route, body: Mapping[str, Any]
    ) -> list[int] | asyncio.Future[list[int] | None] | None:
        """``tokenize``'s answer at once, or a future of it while the worker thread computes it.

        Call on the event loop. A hit, and a tokenizer cheap enough for the loop (the simulated
        engine's), answer at once; a Hugging Face tokenizer's miss goes to the worker thread, and
        identical misses in flight share one run. With ``max_pending`` already there, None at once:
        the request is scheduled on its estimate rather than delayed. Cancelling the future is safe:
        the worker's answer still fills the cache.
        """
        tok = self._tokenizer(model)
        if tok is None:
            return None
        key = _cache_key(model, route, body)
        hit = self._hit(key, tok)
        if hit is not None:
            return hit[1]
        if tok.inline:
            return self._remember(key, tok, _run(tok, model, route, body))
        # The tokenizer's identity is part of the key: a replaced tokenizer never shares an old run.
        # The body is not copied: its request waits for the answer, and does not change it meanwhile.
        in_flight = (key if key is not None else object(), id(tok))
        future = self._worker.submit(
            in_flight,
            partial(_run, tok, model, route, body, self.block_sizes),
            partial(self._remember, key, tok),
        )
        return future  # None: the queue is full

    async def tokenize_async(self, model: str, route: Route, body: Mapping[str, Any]) -> list[int] | None:
        """``tokenize`` that never runs a Hugging Face tokenizer on the event loop (``tokenize_nowait``)."""
        ids = self.tokenize_nowait(model, route, body)
        return await ids if isinstance(ids, asyncio.Future) else ids

    def pending(self) -> int:
        """Tokenizations waiting for, or running on, the worker thread."""
        return self._worker.pending()

    def _tokenizer(self, model: str) -> _Tokenizer | None:
        entry = self._entries.get(model)
        return entry.tokenizer if entry is not None else None

    def _hit(
        self, key: tuple[str, str, bytes] | None, tok: _Tokenizer
    ) -> tuple[_Tokenizer, list[int] | None] | None:
        if key is None:
            return None
        hit = self._cache.get(key)
        if hit is None or hit[0] is not tok:
            return None
        self._cache.move_to_end(key)
        return hit

    def _remember(
        self, key: tuple[str, str, bytes] | None, tok: _Tokenizer, ids: list[int] | None
    ) -> list[int] | None:
        if key is not None and self._max_cached:
            self._cache[key] = (tok, ids)
            self._cache.move_to_end(key)
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return ids

    def status(self) -> dict[str, str]:
        """model -> "bytes" | "loading" | "ready" | "failed: reason" | "none"."""
        with self._lock:
            return {model: entry.status for model, entry in self._entries.items()}

    def cached_prompts(self) -> int:
        """How many tokenizations the cache holds."""
        return len(self._cache)

    def close(self) -> None:
        """Stop the threads this object started: loading (a load in progress finishes) and tokenizing
        (queued work is dropped, its waiters get None; a tokenization in progress finishes)."""
        self._worker.close()
        if self._own_executor is not None:
            self._own_executor.shutdown(wait=False, cancel_futures=True)

    def _loader(self) -> concurrent.futures.Executor:
        if self._executor is not None:
            return self._executor
        if self._own_executor is None:
            self._own_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
        return self._own_executor

    def _on_done(self, model: str, entry: _Entry, future: concurrent.futures.Future[_HfTokenizer]) -> None:
        try:
            result: _HfTokenizer | BaseException = future.result()
        except BaseException as exc:  # any failure, cancellation included, is reported
            result = exc
        self._loaded(model, entry, result)

    def _loaded(self, model: str, entry: _Entry, result: _HfTokenizer | BaseException) -> None:
        with self._lock:
            if self._entries.get(model) is not entry:
                return  # replaced while loading
            if isinstance(result, BaseException):
                entry.status = f"failed: {_reason(result)}"
            else:
                entry.tokenizer, entry.status = result, "ready"
        if isinstance(result, BaseException):
            log.warning("model %s: cannot load the tokenizer in %s: %s; its prompts are not tokenized",
                        model, entry.source, _reason(result))  # fmt: skip
        elif result.chat_refusal:
            log.info(
                "model %s: tokenizer ready; chat prompts are not tokenized: %s", model, result.chat_refusal
            )
        else:
            log.info("model %s: tokenizer ready (%s content)", model, result.content_format)


def _run(
    tok: _Tokenizer, model: str, route: Route, body: Mapping[str, Any], block_sizes: tuple[int, ...] = ()
) -> PromptTokens | None:
    """The prompt's ids, with their block keys for ``block_sizes`` (the others when first looked up)."""
    try:
        ids = tok.completions(body) if route == "completions" else tok.chat_completions(body)
    except Exception:  # a template or tokenizer refusing the input: vLLM would answer 400
        log.debug("model %s: cannot tokenize a %s body", model, route, exc_info=True)
        return None
    if ids is None:
        return None
    prompt = PromptTokens(ids)
    for size in block_sizes:
        prompt.block_keys(size)
    return prompt


def _cache_key(model: str, route: Route, body: Mapping[str, Any]) -> tuple[str, str, bytes] | None:
    fields: list[Any] = [body.get(name) for name in _FIELDS[route]]
    if route == "chat_completions":
        params = body.get("kv_transfer_params")
        fields.append(params.get("prompt_token_ids") if isinstance(params, Mapping) else None)
    try:
        raw = jsonutil.dumps(fields)
    except TypeError:  # not JSON (orjson's error is a TypeError): tokenize without caching
        return None
    return model, route, hashlib.blake2b(raw, digest_size=16).digest()
