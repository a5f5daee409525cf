"""A simulated vLLM server: vLLM's OpenAI API, metric names and P/D KV handoff, deterministic output.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``GET /version``, and the sim's KV side channel ``POST /sim/kv/pull``. See docs/sim.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.clock import Clock, SystemClock
from vllm_disagg.config import SimEngineConfig
from vllm_disagg.errors import BadRequest, NotFound, RequestError
from vllm_disagg.http_errors import error_response
from vllm_disagg.sim_engine import perf_model
from vllm_disagg.sim_engine.core import ABORTED, EngineCore, Seq
from vllm_disagg.sim_engine.kv_publisher import KvEventPublisher, publisher_endpoint
from vllm_disagg.sim_engine.metrics import CONTENT_TYPE
from vllm_disagg.sim_engine.openai_api import (
    DONE,
    Kind,
    ResponseEncoder,
    check_length,
    parse_request,
    random_request_id,
)
from vllm_disagg.sim_engine.prompts import PromptInfo, PromptTable
from vllm_disagg.wire.kv_transfer import RemotePrefill

SIM_VERSION = "0.32.0+sim"
KV_PULL_PATH = "/sim/kv/pull"
# With ``kv_bytes_per_token``, a pull's answer is its JSON (this header says how many bytes) and then
# that many zero bytes per token: what a real KV transfer would move over the same link.
KV_JSON_BYTES = "X-Sim-KV-JSON-Bytes"
_ZEROS = memoryview(bytes(1 << 20))  # the payload, written in slices of one buffer
_READ_CHUNK = 1 << 20
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class SimEngine:
    """One simulated engine: its core, its prompt memo, and the HTTP client it pulls KV with."""

    def __init__(self, config: SimEngineConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.core = EngineCore(config, clock)
        self.prompts = PromptTable(config.timing.block_size)
        self.session: aiohttp.ClientSession | None = None
        self.loop_task: asyncio.Task[None] | None = None
        self.kv_events: KvEventPublisher | None = None
        if config.port:
            self.advertise(config.port)

    def advertise(self, port: int) -> None:
        """Record the port this engine listens on; it names the engine in ``kv_transfer_params``."""
        core = self.core
        core.advertised_port = port
        core.engine_id = self.config.engine_id or f"{core.advertised_host}:{port}"

    @property
    def alive(self) -> bool:
        """False once the step loop has died: ``/health`` then answers 503, as vLLM does."""
        return self.loop_task is None or not self.loop_task.done()

    async def pull_kv(self, remote: RemotePrefill, prompt: PromptInfo) -> int:
        """Pull a prompt's blocks from the prefill engine; returns the tokens received, or raises 500."""
        if not remote.block_ids:
            return 0  # a handle naming no blocks: nothing to pull, everything is computed here
        m = self.core.metrics
        where = f"remote engine {remote.engine_id!r} at {remote.host}:{remote.port}"
        started = self.clock.monotonic()
        body = {
            "remote_block_ids": list(remote.block_ids),
            "remote_engine_id": remote.engine_id,
            "remote_request_id": remote.request_id,
        }
        reason = ""
        tokens: list[int] = []
        moved: int | None = None
        assert self.session is not None, "the KV client session is created on startup"
        try:
            async with self.session.post(
                f"http://{remote.host}:{remote.port}{KV_PULL_PATH}",
                data=jsonutil.dumps(body),
                headers={"Content-Type": "application/json"},
            ) as resp:
                payload, moved = await _read_pull(resp)
            if resp.status != 200:
                reason = f"HTTP {resp.status}: {_error_message(payload)}"
            else:
                tokens = jsonutil.loads(payload)["token_ids"]
                if not isinstance(tokens, list):
                    reason = "the answer carries no token_ids list"
        except (aiohttp.ClientError, TimeoutError, EOFError, ValueError, KeyError, TypeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"  # EOFError: a body cut short of its JSON
        finished = self.clock.monotonic()  # the last byte: the perf model's delay below is not the link's
        if not reason:
            n = len(tokens)
            if n > len(prompt.token_ids) or tokens != list(prompt.token_ids[:n]):
                reason = f"the {n} pulled tokens are not this request's prompt prefix"
        if reason:
            m.nixl_num_failed_transfers += 1
            if self.config.kv_load_failure_policy == "recompute":
                return 0  # vLLM's "recompute" policy: the prompt is computed here instead
            raise RequestError(f"KV transfer failed from {where}: {reason}")
        # The payload that moved; without one, the 4 bytes of each token id (the sim's old figure).
        m.nixl_bytes_transferred.observe(4 * len(tokens) if moved is None else moved)
        m.nixl_xfer_time.observe(finished - started)
        delay = perf_model.kv_transfer_duration(self.config.timing, len(tokens))
        if delay > 0:
            await self.clock.sleep(delay)
        return len(tokens)


ENGINE_KEY = web.AppKey("sim_engine", SimEngine)


async def _read_pull(resp: aiohttp.ClientResponse) -> tuple[bytes, int | None]:
    """A pull's JSON, and how many payload bytes came after it (read and dropped); None: no payload."""
    json_bytes = resp.headers.get(KV_JSON_BYTES)
    if resp.status != 200 or json_bytes is None:
        return await resp.read(), None
    head = await resp.content.readexactly(int(json_bytes))
    moved = 0
    while chunk := await resp.content.read(_READ_CHUNK):
        moved += len(chunk)
    return head, moved


def _error_message(payload: bytes) -> str:
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        return str(jsonutil.loads(payload)["error"]["message"])
    return payload[:200].decode("utf-8", "replace")


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    config = engine.config
    arrival = engine.clock.monotonic()
    header_id = request.headers.get("X-Request-Id")
    headers = {"X-Request-Id": header_id or random_request_id()}
    if not engine.core.advertised_port:
        # build_app() served by someone else's runner on port 0: learn the port from the socket.
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        if sock:
            engine.advertise(int(sock[1]))
    try:
        req = parse_request(
            kind,
            await request.read(),
            request_id=header_id,
            served_model=config.model,
            default_max_tokens=config.default_max_tokens,
        )
        headers["X-Request-Id"] = req.request_id  # vLLM's --enable-request-id-headers
        prompt = engine.prompts.resolve(req.prompt)
        timing = config.timing
        check_length(
            len(prompt.token_ids), req.max_tokens, config.max_model_len, timing.num_blocks * timing.block_size
        )
        external = await engine.pull_kv(req.remote_prefill, prompt) if req.remote_prefill else 0
    except RequestError as exc:
        return error_response(exc, headers)
    seq = Seq(req, prompt, external, arrival)
    encoder = ResponseEncoder(
        kind,
        req.request_id,
        config.model,
        int(engine.clock.wall()),
        return_token_ids=req.return_token_ids,
        include_usage=req.include_usage,
        continuous_usage=req.continuous_usage,
        prompt_token_ids=prompt.token_ids,
    )
    if config.timing.zero_delay:
        return await _respond_now(request, engine, seq, encoder, headers)
    return await _respond_stepped(request, engine, seq, encoder, headers)


def _cached(engine: SimEngine, seq: Seq) -> int | None:
    """The usage's cached prompt tokens, when the engine reports them (``prompt_tokens_details``): as
    vLLM 0.32, the prefill's own figure when its handle carries one, else what this engine did not compute."""
    if not engine.config.prompt_tokens_details:
        return None
    remote = seq.req.remote_prefill
    if remote is not None and remote.prefill_cached_tokens is not None:
        return remote.prefill_cached_tokens
    return seq.cached_tokens


def _full_response(
    engine: SimEngine, seq: Seq, encoder: ResponseEncoder, headers: dict[str, str]
) -> web.Response:
    """The non-streaming answer for a finished request."""
    req = seq.req
    text = engine.prompts.text(seq.prompt, req.max_tokens)
    ids = engine.prompts.output_ids(seq.prompt, req.max_tokens) if req.return_token_ids else None
    body = encoder.full(
        text,
        len(seq.prompt.token_ids),
        req.max_tokens,
        seq.kv_params,
        token_ids=ids,
        cached_tokens=_cached(engine, seq),
    )
    return web.Response(body=body, content_type="application/json", headers=headers)


async def _respond_now(
    request: web.Request, engine: SimEngine, seq: Seq, encoder: ResponseEncoder, headers: dict[str, str]
) -> web.StreamResponse:
    core = engine.core
    req = seq.req
    core.complete_now(seq)
    n_prompt = len(seq.prompt.token_ids)
    if not req.stream:
        return _full_response(engine, seq, encoder, headers)
    words = engine.prompts.json_words(seq.prompt, req.max_tokens)
    ids = engine.prompts.output_ids(seq.prompt, req.max_tokens) if req.return_token_ids else ()
    parts = [encoder.role_chunk(), encoder.chunks(words, ids)]
    if req.include_usage:
        parts.append(encoder.usage_chunk(n_prompt, req.max_tokens, _cached(engine, seq)))
    parts.append(DONE)
    resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
    core.in_flight_now += 1
    try:
        await resp.prepare(request)
        await resp.write(b"".join(parts))
        await resp.write_eof()
    except ConnectionError:
        pass  # the client left; its request already finished
    finally:
        core.in_flight_now -= 1
    return resp


async def _respond_stepped(
    request: web.Request, engine: SimEngine, seq: Seq, encoder: ResponseEncoder, headers: dict[str, str]
) -> web.StreamResponse:
    core = engine.core
    req = seq.req
    n_prompt = len(seq.prompt.token_ids)
    core.submit(seq)
    assert seq.done is not None
    try:
        if not req.stream:
            try:
                await seq.done
            except RequestError as exc:
                return error_response(exc, headers)
            return _full_response(engine, seq, encoder, headers)
        assert seq.tokens is not None
        words = engine.prompts.json_words(seq.prompt, req.max_tokens)
        ids = engine.prompts.output_ids(seq.prompt, req.max_tokens)
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        try:
            await resp.prepare(request)
            last = req.max_tokens - 1
            pending = [encoder.role_chunk()]
            while True:
                pos = await seq.tokens.get()
                if pos == ABORTED:
                    return resp  # engine shut down: end the stream without [DONE]
                pending.append(encoder.token_chunk(words[pos], pos == last, pos, ids[pos]))
                # Tokens produced while we were writing go out in one write. vLLM would merge them into
                # one chunk; one chunk per token keeps every byte predictable for checkers.
                while not seq.tokens.empty() and pos != last:
                    pos = seq.tokens.get_nowait()
                    if pos == ABORTED:
                        break
                    pending.append(encoder.token_chunk(words[pos], pos == last, pos, ids[pos]))
                if pos == last:
                    if req.include_usage:
                        pending.append(encoder.usage_chunk(n_prompt, req.max_tokens, _cached(engine, seq)))
                    pending.append(DONE)
                    await resp.write(b"".join(pending))
                    await resp.write_eof()
                    return resp
                await resp.write(b"".join(pending))
                pending = []
        except ConnectionError:
            return resp  # the client left; finally aborts the request
    finally:
        core.abort(seq)  # no-op when it finished


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, "chat")


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one served model."""
    config = request.app[ENGINE_KEY].config
    created = int(request.app[ENGINE_KEY].clock.wall())
    card = {
        "id": config.model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
    }
    return web.Response(
        body=jsonutil.dumps({"object": "list", "data": [card]}), content_type="application/json"
    )


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 with an empty body, 503 once the engine loop has died."""
    return web.Response(status=200 if request.app[ENGINE_KEY].alive else 503)


async def version(request: web.Request) -> web.Response:
    """``GET /version``."""
    return web.Response(body=jsonutil.dumps({"version": SIM_VERSION}), content_type="application/json")


async def kv_event_sources(request: web.Request) -> web.Response:
    """``GET /kv_event_sources``: vLLM's KV-events config per data-parallel rank ({} without events)."""
    config = request.app[ENGINE_KEY].config
    sources: dict[str, object] = {}
    if config.kv_events_port:
        sources["0"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # What it binds (loopback), not vLLM's usual "tcp://*": an agent follows what it is told.
            "endpoint": publisher_endpoint(config.kv_events_port),
            "topic": "",
        }
    return web.Response(body=jsonutil.dumps(sources), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text with vLLM's v1 names."""
    body = request.app[ENGINE_KEY].core.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def kv_pull(request: web.Request) -> web.StreamResponse:
    """``POST /sim/kv/pull``: a decoder takes held blocks (200 ``{"token_ids"}``) or learns why not (404)."""
    engine = request.app[ENGINE_KEY]
    try:
        body = jsonutil.loads(await request.read())
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        block_ids = body.get("remote_block_ids")
        if not isinstance(block_ids, list) or not all(isinstance(b, int) for b in block_ids):
            raise BadRequest("remote_block_ids must be a list of ints")
        request_id = body.get("remote_request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise BadRequest("remote_request_id must be a string")
    except jsonutil.JSONDecodeError:
        return error_response(BadRequest("malformed JSON body"), {})
    except BadRequest as exc:
        return error_response(exc, {})
    own = engine.core.engine_id
    if body.get("remote_engine_id") != own:
        return error_response(NotFound(f"engine id {body.get('remote_engine_id')!r} is not {own!r}"), {})
    outcome = engine.core.serve_pull(block_ids, request_id)
    if outcome.token_ids is None:
        return error_response(NotFound(outcome.reason), {})
    answer = jsonutil.dumps({"token_ids": outcome.token_ids})
    per_token = engine.config.timing.kv_bytes_per_token
    if not per_token:
        return web.Response(body=answer, content_type="application/json")
    return await _send_pull(request, answer, per_token * len(outcome.token_ids))


async def _send_pull(request: web.Request, answer: bytes, payload: int) -> web.StreamResponse:
    """The pull's JSON and then ``payload`` zero bytes, streamed: a long prompt's KV is never in memory."""
    resp = web.StreamResponse(headers={KV_JSON_BYTES: str(len(answer))})
    resp.content_type = "application/octet-stream"
    resp.content_length = len(answer) + payload
    await resp.prepare(request)
    await resp.write(answer)
    for offset in range(0, payload, len(_ZEROS)):
        await resp.write(_ZEROS[: min(len(_ZEROS), payload - offset)])
    await resp.write_eof()
    return resp


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE_KEY]
    config = engine.config
    if config.kv_events_port:  # first: a port in use fails startup before anything else is opened
        engine.kv_events = KvEventPublisher(config.kv_events_port, config.timing.block_size, engine.clock)
        engine.core.prefix_cache.listener = engine.kv_events
    engine.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30, connect=5))
    if not config.timing.zero_delay:
        engine.loop_task = asyncio.create_task(engine.core.run(), name="sim-engine-steps")
    try:
        yield
    finally:
        if engine.loop_task is not None:
            engine.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await engine.loop_task
        await engine.session.close()
        if engine.kv_events is not None:
            engine.core.prefix_cache.listener = None
            engine.kv_events.close()
            engine.kv_events = None


def build_app(
    config: SimEngineConfig, *, clock: Clock | None = None, kv_connector: str = ""
) -> web.Application:
    """The simulated engine as an aiohttp application (its step loop runs while the app does).

    ``kv_connector="vllm-disagg"``: a prefill leg is answered with the project's connector's handle
    (``protocol.kv_pool``), as an engine that saved the prompt's full blocks in its agent's pool."""
    app = web.Application(client_max_size=64 << 20)
    app[ENGINE_KEY] = SimEngine(config, clock or SystemClock())
    app[ENGINE_KEY].core.kv_connector = kv_connector
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_post(KV_PULL_PATH, kv_pull)
    return app


class SimServer:
    """A running simulated engine on a real port."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"

    @property
    def app(self) -> web.Application:
        """The served application (tests reach the engine through ``app[ENGINE_KEY]``)."""
        return self._runner.app

    async def close(self) -> None:
        """Stop serving; in-flight requests get a few seconds to finish."""
        await self._runner.cleanup()


async def start_engine(
    config: SimEngineConfig, *, clock: Clock | None = None, kv_connector: str = ""
) -> SimServer:
    """Serve a simulated engine on ``config.host:config.port`` (port 0: any free port)."""
    app = build_app(config, clock=clock, kv_connector=kv_connector)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = int(runner.addresses[0][1])
    except BaseException:
        await runner.cleanup()
        raise
    app[ENGINE_KEY].advertise(port)
    host = app[ENGINE_KEY].core.advertised_host
    return SimServer(runner, host, port)
