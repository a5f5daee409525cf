"""A test engine on a real loopback port that answers as one recorded engine version does.

``ReplayEngine("vllm-0.10.2")`` serves ``/v1/completions`` and ``/v1/chat/completions`` with the
dialect's exact bytes (``dialects.py``) for the generations recorded in
``tests/fixtures/engines/<dialect>.jsonl``: a request whose prompt was recorded gets that generation, a
prompt of token ids that extends a recorded prompt by the ids of its first k steps gets the rest of it
(a resume), and any other prompt a deterministic synthetic generation. A prefill leg
(``kv_transfer_params.do_remote_decode``) gets the one-token whole body with a producer handle. A test
can cut a stream after some events (``cut``), as an engine that dies mid-way does.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.engines.dialects import (
    CHAT,
    CHAT_PROMPT_IDS,
    COMPLETIONS,
    DIALECTS,
    DONE,
    JSON,
    SSE,
    Ask,
    Dialect,
    Generation,
    Step,
)
from vllm_disagg.wire.kv_transfer import producer_handle

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engines"
VOCAB = 2048  # the tiny model's vocabulary: synthetic ids stay below it, prompts beyond it are refused
SYNTHETIC_STEPS = 16  # a synthetic generation's length when the request sets no max_tokens
BLOCK = 128
MAX_MODEL_LEN = 512
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
NOT_FOUND = b'{"detail":"Not Found"}'  # Starlette's 404, in vLLM and SGLang alike

Cut = Callable[[str, dict[str, Any]], tuple[int, str] | None]


def truncated(gen: Generation, max_tokens: int) -> Generation:
    """``gen`` cut to at most ``max_tokens`` ids; a cut generation finishes by length."""
    steps: list[Step] = []
    n = 0
    for step in gen.steps:
        if n >= max_tokens:
            break
        steps.append(step if n + len(step.ids) <= max_tokens else Step(step.ids[: max_tokens - n], step.text))
        n += len(steps[-1].ids)
    if steps == list(gen.steps):
        return gen
    return replace(gen, steps=tuple(steps), finish_reason="length", stop_reason=None)


def continued(gen: Generation, prompt_ids: Sequence[int]) -> Generation | None:
    """The rest of ``gen`` for a prompt that is its prompt plus the ids of its first k steps (a resume:
    the usage then counts the longer prompt); None when ``prompt_ids`` is no such prompt. The steps keep
    their recorded texts: real vLLM, resumed right after a step whose text was held back (""), writes
    the whole decoded context into its first chunk instead (docs/vllm-resume-facts.md §3)."""
    ids = tuple(prompt_ids)
    at = len(gen.prompt_ids)
    if ids[:at] != gen.prompt_ids:
        return None
    for k, step in enumerate(gen.steps):
        if at == len(ids):
            return replace(gen, prompt_ids=ids, steps=gen.steps[k:])
        if ids[at : at + len(step.ids)] != step.ids:
            return None
        at += len(step.ids)
    return None  # every step already given: nothing left to answer


def synthetic(prompt_ids: Sequence[int], n: int) -> Generation:
    """A generation that is a pure function of the prompt: each id hashes the whole context before it
    (so a resume from the prompt plus its first k ids continues it), its text an ASCII word."""
    context = list(prompt_ids)
    steps = []
    for _ in range(n):
        digest = hashlib.blake2b(json.dumps(context).encode(), digest_size=4).digest()
        token = 256 + int.from_bytes(digest, "big") % (VOCAB - 256)
        steps.append(Step((token,), " " + WORDS[token % len(WORDS)]))
        context.append(token)
    return Generation(tuple(prompt_ids), tuple(steps), "length")


def template_ids(messages: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """Unrecorded chat messages as token ids: the tiny model's chat template over UTF-8 bytes."""
    text = "".join(f"<|{m.get('role')}|>\n{m.get('content')}\n" for m in messages) + "<|assistant|>\n"
    return tuple(text.encode())


def _text_prompt(body: Mapping[str, Any]) -> Any:
    """A completion's prompt, a list of one prompt taken as that prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        return prompt[0]
    return prompt


def _stops(stop: Any) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


class BadRequest(Exception):
    """A request the engine answers with 400."""


class Library:
    """The recorded generations of a fixture file, by prompt."""

    def __init__(self, lines: Sequence[Mapping[str, Any]]) -> None:
        self.by_prompt: dict[tuple[str, str, tuple[str, ...]], Generation] = {}
        self.by_ids: list[tuple[tuple[str, ...], Generation]] = []
        for line in lines:
            gen = Generation.from_json(line["generation"])
            key = self.key(line["path"], line["request"])
            if key not in self.by_prompt:
                self.by_prompt[key] = gen
                self.by_ids.append((key[2], gen))

    @classmethod
    def load(cls, dialect: str) -> Library:
        text = (FIXTURES / f"{dialect}.jsonl").read_text(encoding="utf-8")
        return cls([json.loads(line) for line in text.splitlines() if line])

    @staticmethod
    def key(path: str, body: Mapping[str, Any]) -> tuple[str, str, tuple[str, ...]]:
        prompt = body.get("messages") if path == CHAT else _text_prompt(body)
        return path, json.dumps(prompt, sort_keys=True, ensure_ascii=False), _stops(body.get("stop"))

    def generation(
        self, path: str, body: Mapping[str, Any], ids: tuple[int, ...] | None
    ) -> Generation | None:
        """The recorded generation (or its rest, for ``ids``) that answers ``body``; None if unrecorded."""
        stops = _stops(body.get("stop"))
        if ids is None:
            return self.by_prompt.get(self.key(path, body))
        for recorded_stops, gen in self.by_ids:
            rest = continued(gen, ids) if recorded_stops == stops else None
            if rest is not None:
                return rest
        return None


class ReplayEngine:
    """One dialect's engine on 127.0.0.1 (a free port): ``url`` once started."""

    def __init__(self, dialect: str, *, model: str = "tiny", prefill_cache_in_handle: bool = True) -> None:
        self.dialect: Dialect = DIALECTS[dialect]
        self.model = model
        self.prefill_cache_in_handle = prefill_cache_in_handle
        self.library = Library.load(dialect)
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (path, body) received, in order
        self.cut: Cut | None = None  # (events, "disconnect" | "engine-core-died") to cut a stream
        self.clock: Callable[[], int] = lambda: int(time.time())  # each answer's ``created``
        self.url = ""
        self.running = 0
        self._port = 0
        self._counter = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> ReplayEngine:
        app = web.Application()
        app.router.add_post(COMPLETIONS, self._generate)
        app.router.add_post(CHAT, self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self._port}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- what a request gets ---------------------------------------------------------------------

    def prompt_ids(self, path: str, body: Mapping[str, Any]) -> tuple[int, ...] | None:
        """A prompt given as token ids (completions; chat's kv_transfer_params.prompt_token_ids where the
        dialect runs them), checked against the vocabulary; None for text and messages."""
        ids: Any = None
        if path == COMPLETIONS:
            prompt = _text_prompt(body)
            if isinstance(prompt, list):
                ids = prompt
            elif not isinstance(prompt, str):
                raise BadRequest("prompt must be a string, a list of token ids or a list of one of them")
        elif CHAT_PROMPT_IDS in self.dialect.capabilities:
            ids = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
            raise BadRequest("prompt token ids must be a non-empty list of non-negative integers")
        for t in ids:
            if t >= VOCAB:
                raise BadRequest(f"Token id {t} is out of vocabulary")
        return tuple(ids)

    def generation(self, path: str, body: Mapping[str, Any]) -> Generation:
        """What the engine generates for ``body``: recorded, a recorded one's rest, or synthetic; cut to
        max_tokens (chat: max_completion_tokens first)."""
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        ids = self.prompt_ids(path, body)
        gen = self.library.generation(path, body, ids)
        if gen is None:
            if ids is None:
                text = _text_prompt(body)
                ids = template_ids(body.get("messages") or []) if path == CHAT else tuple(text.encode())
            gen = synthetic(ids, limit or SYNTHETIC_STEPS)
        return truncated(gen, limit) if isinstance(limit, int) else gen

    def _request_id(self, request: web.Request, body: Mapping[str, Any]) -> str:
        """X-Request-Id, else the body's request_id (vLLM reads it), else a counter: never random."""
        self._counter += 1
        header = request.headers.get("X-Request-Id")
        return header or str(body.get("request_id") or f"replay-{self._counter}")

    def _handle(self, gen: Generation, path: str, request_id: str) -> dict[str, Any]:
        """The producer handle a prefill engine answers with (vllm_disagg.wire.kv_transfer)."""
        blocks = -(-len(gen.prompt_ids) // BLOCK)
        return producer_handle(
            block_ids=list(range(blocks)), engine_id=f"replay-{self._port}", host="127.0.0.1",
            port=self._port + 1000, request_id=f"{self.dialect.response_id(path, request_id)}-0",
            prefill_cached_tokens=0 if self.prefill_cache_in_handle else None,
        )  # fmt: skip

    # --- handlers --------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return self._json(400, self.dialect.error_body("the body must be a JSON object", 400))
        self.requests.append((path, body))
        body = {"model": self.model, **body}
        request_id = self._request_id(request, body)
        created = self.clock()
        kv = body.get("kv_transfer_params") or {}
        try:
            if kv.get("do_remote_decode"):  # a prefill leg: one token and the handle, never streamed
                leg = {**body, "stream": False}
                gen = truncated(self.generation(path, leg), 1)
                handle = self._handle(gen, path, request_id)
                status, ctype, payload = self.dialect.render(
                    path, leg, gen, request_id, created, kv_transfer_params=handle
                )
                return self._json(status, payload, ctype)
            ask = Ask.of(path, body)
            refused = self.dialect.refusal(ask)
            if refused is not None:
                return self._json(refused[0], refused[2], refused[1])
            gen = self.generation(path, body)
        except BadRequest as err:
            return self._json(400, self.dialect.error_body(str(err), 400))
        if not ask.stream:
            status, ctype, payload = self.dialect.render(path, body, gen, request_id, created)
            return self._json(status, payload, ctype)
        return await self._stream(request, path, body, gen, request_id, created)

    async def _stream(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        gen: Generation,
        request_id: str,
        created: int,
    ) -> web.StreamResponse:
        events = self.dialect.events(path, body, gen, request_id, created)
        cut = self.cut(path, body) if self.cut is not None else None
        died = self.dialect.died_event() if cut and cut[1] == "engine-core-died" else None
        if cut is not None:
            events = [*events[: cut[0]], died, DONE] if died else events[: cut[0]]
        resp = web.StreamResponse(headers={"Content-Type": SSE})
        self.running += 1
        try:
            await resp.prepare(request)
            for one in events:
                await resp.write(one.encode())  # one HTTP chunk per event, as vLLM writes
            if cut is not None and died is None:  # the server went away: no [DONE], no last chunk
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write_eof()
        finally:
            self.running -= 1
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return self._json(200, self.dialect.models_body(self.model, self.clock(), MAX_MODEL_LEN))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        version = self.dialect.version_body()
        return self._json(404, NOT_FOUND) if version is None else self._json(200, version)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.dialect.metrics_text(self.model, self.running)
        return web.Response(
            body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def _not_found(self, request: web.Request) -> web.Response:
        return self._json(404, NOT_FOUND)

    @staticmethod
    def _json(status: int, payload: bytes, content_type: str = JSON) -> web.Response:
        return web.Response(status=status, body=payload, headers={"Content-Type": content_type})
