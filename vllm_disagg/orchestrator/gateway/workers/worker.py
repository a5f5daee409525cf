"""One gateway worker process: ``python -m vllm_disagg.orchestrator.gateway.workers.worker LINK INDEX``.

Started by the orchestrator's ``WorkerHub``, never by hand. It says Hello on the link, gets the config
and the whole state, then serves ``POST /v1/completions``, ``/v1/chat/completions`` and
``GET /v1/models`` on the orchestrator's port (``SO_REUSEPORT``) with the same ``Gateway`` as the
orchestrator, and proxies every other path there. It exits when told to stop, on SIGTERM, and when
the orchestrator process dies (the kernel sends it SIGTERM then: ``die_with_parent``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from vllm_disagg import logs, runtime
from vllm_disagg.clock import SystemClock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import OrchestratorUnreachable
from vllm_disagg.http_errors import answering
from vllm_disagg.orchestrator.control.kv_moves import MoveResult, failed
from vllm_disagg.orchestrator.gateway.deadlines import ClientLimits
from vllm_disagg.orchestrator.gateway.listener import GatewayServer, gateway_runner
from vllm_disagg.orchestrator.gateway.records import REQUEST_LOG_CAPACITY, RequestLog
from vllm_disagg.orchestrator.gateway.routes import OpenAIRoutes
from vllm_disagg.orchestrator.gateway.service import Gateway
from vllm_disagg.orchestrator.gateway.tokenize import Tokenizers, preload_tokenizer_libs
from vllm_disagg.orchestrator.gateway.workers.messages import (
    Answer,
    Ask,
    Batch,
    Counts,
    Event,
    Hello,
    Joined,
    KvMove,
    KvMoved,
    Lost,
    Note,
    Resync,
    Serving,
    Setup,
    State,
    dump,
    load,
)
from vllm_disagg.orchestrator.gateway.workers.replica import RegistryReplica
from vllm_disagg.orchestrator.loop_lag import watch_loop_lag
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.scheduling.config import load_scheduler_config
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.kv_index import KvIndex

log = logging.getLogger(__name__)

LINK_MOVE_TIMEOUT_S = 30.0
PUSH_S = 0.02  # how often the worker's calls, events and in-flight counts go to the orchestrator
# Headers that describe one hop, not the request (RFC 9110 7.6.1), and the framing aiohttp redoes.
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
     "content-length", "host"}
)  # fmt: skip


class _ForwardedEvents(EventLog):
    """Events go to the orchestrator's event log (admin SSE, dashboard)."""

    def __init__(self, send: Any) -> None:
        super().__init__(lambda: 0.0, capacity=1)
        self._send_to_primary = send

    def publish_fields(self, kind: str, fields: dict[str, Any]) -> None:
        self._send_to_primary(Event(kind, dict(fields)))

    def publish(self, kind: str, **fields: Any) -> Any:
        self._send_to_primary(Event(kind, fields))


class LinkKvMover:
    """A worker's ``KvMover``: the orchestrator's control plane makes the move (``KvMove``)."""

    def __init__(self, send: Callable[[object], None]) -> None:
        self._send = send
        self._queries = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[MoveResult]] = {}

    async def move(self, holder: str, receiver: str, keys: Sequence[str]) -> MoveResult:
        query = next(self._queries)
        answer: asyncio.Future[MoveResult] = asyncio.get_running_loop().create_future()
        self._waiting[query] = answer
        try:
            self._send(KvMove(query, holder, receiver, tuple(keys)))
            # The orchestrator bounds each command's wait; this only guards against a lost answer.
            return await asyncio.wait_for(answer, LINK_MOVE_TIMEOUT_S)
        except TimeoutError:
            return failed("unavailable", "the orchestrator did not answer the KV move")
        finally:
            self._waiting.pop(query, None)

    def answered(self, msg: KvMoved) -> None:
        """The orchestrator's answer to one of this worker's moves."""
        answer = self._waiting.get(msg.query)
        if answer is not None and not answer.done():
            answer.set_result(msg.result)


class Worker:
    """The worker's state: its link, replica, KV index and gateway."""

    def __init__(self, link: str, index: int) -> None:
        if not link.startswith("ipc://"):
            # Its frames are pickles (messages.py): only a 0700 socket on this host may carry them.
            raise ValueError(f"the workers' link must be an ipc:// socket, not {link[:80]!r}")
        self.index = index
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # never drop a state message (see the hub)
        self.sock.connect(link)
        # Registry calls and events wait for the next push (a request makes about four: one message
        # each cost the orchestrator more CPU than the request itself).
        self.outbox: list[object] = []
        self.replica = RegistryReplica(index, self.outbox.append)
        self.kv_mover = LinkKvMover(self.send)  # at once, not with the next push: a decode leg waits
        # The orchestrator's index, as its whole state and then its writes in order say.
        self.kv_index = KvIndex()
        self.gateway: Gateway | None = None
        self.routes: OpenAIRoutes | None = None
        self.primary_url = ""
        self.stopped = asyncio.Event()

    def send(self, message: object) -> None:
        """To the orchestrator; never raises (a record or event lost is logged, the request goes on)."""
        try:
            self.sock.send(dump(message), flags=zmq.NOBLOCK)
        except Exception:
            log.exception("worker %d: %s not sent to the orchestrator", self.index, type(message).__name__)

    def build(self, setup: Setup) -> web.Application:
        config = setup.config
        self.primary_url = setup.primary_url
        metrics = OrchestratorMetrics(self.replica.snapshot, instances=False)
        self.gateway = gateway = Gateway(
            config,
            self.replica,
            PluginScheduler(load_scheduler_config(config)),
            metrics,
            SystemClock(),
            request_log=RequestLog(REQUEST_LOG_CAPACITY),
            kv_index=self.kv_index,
            tokenizers=Tokenizers(max_pending=config.tokenize_queue, metrics=metrics),
            events=_ForwardedEvents(self.outbox.append),
            kv_mover=self.kv_mover,
            # The planner's window measures the orchestrator process's own requests: a fair sample,
            # as the kernel spreads connections evenly (docs/planner.md).
            slo_window=None,
        )
        self.routes = OpenAIRoutes(gateway)
        app = web.Application(client_max_size=config.max_body_bytes)
        self.routes.add_to(app)
        app.router.add_route("*", "/{tail:.*}", answering(self.proxy))
        app.cleanup_ctx.append(self._session_ctx)
        return app

    async def _session_ctx(self, app: web.Application) -> Any:
        assert self.gateway is not None
        gateway = self.gateway
        gateway.open()
        # No total timeout: the admin event stream (SSE) lasts as long as its reader.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
        self.http = aiohttp.ClientSession(auto_decompress=False, timeout=timeout)
        lag = asyncio.create_task(watch_loop_lag(gateway.metrics.loop_lag), name="worker-loop-lag")
        try:
            yield
        finally:
            lag.cancel()
            await self.http.close()
            await gateway.close()
            gateway.tokenizers.close()

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """Any path but the gateway's: answered by the orchestrator, streamed back as it comes."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Forwarded-For"] = request.remote or ""
        body = await request.read() if request.body_exists else None
        try:
            upstream = await self.http.request(
                request.method, self.primary_url + request.raw_path, headers=headers, data=body
            )
        except aiohttp.ClientError as exc:
            raise OrchestratorUnreachable(f"the orchestrator did not answer: {exc}") from None
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP:
                    response.headers.add(key, value)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    def handle(self, msg: object) -> None:
        gateway = self.gateway
        assert gateway is not None
        if isinstance(msg, State):
            verdict = self.replica.in_order(msg)
            if verdict != "apply":
                if verdict == "gap":
                    log.warning("worker %d: a state message was lost; asking for the whole state", self.index)
                    self.send(Resync(self.index))
                return
            if msg.full and msg.kv_index is not None:
                self.kv_index.take(msg.kv_index)
            for kind, agent_id, events in msg.kv:
                if kind == "apply":
                    self.kv_index.apply(agent_id, events)
                else:
                    self.kv_index.drop(agent_id)
            for view in self.replica.apply(msg):
                gateway.instance_joined(view.info)
            if msg.weights:
                gateway.scheduler.update_weights(msg.weights)  # type: ignore[attr-defined]
            if msg.tenant_weights is not None and gateway.admission is not None:
                gateway.admission.set_tenant_weights(msg.tenant_weights)
        elif isinstance(msg, KvMoved):
            self.kv_mover.answered(msg)
        elif isinstance(msg, Lost):
            gateway.instance_lost(msg.agent_id, msg.reason)
        elif isinstance(msg, Joined):
            gateway.instance_joined(msg.info)
        elif isinstance(msg, Note):
            gateway.request_log.note_kv_check(msg.request_id, msg.note)
        elif isinstance(msg, Ask):
            payload: Any
            if msg.what == "metrics":
                payload = gateway.metrics.families()
            elif msg.what == "live":
                payload = gateway.live_requests()
            elif msg.what == "record":
                payload = gateway.request_log.get(msg.arg)
            elif msg.what == "admission":
                payload = gateway.admission.snapshot() if gateway.admission is not None else None
            else:
                payload = gateway.request_log.recent(msg.arg)
            self.send(Answer(msg.query, self.index, payload))

    async def read(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                self.handle(load(frame))
            except Exception:
                log.exception("worker %d: a message from the orchestrator not handled", self.index)

    async def push(self) -> None:
        """Every ``PUSH_S``: the calls and events made since, then the in-flight counts, in one message."""
        while True:
            await asyncio.sleep(PUSH_S)
            batch = self.outbox[:]
            self.outbox.clear()
            if self.replica.counts_changed:
                in_flight, sent = self.replica.take_counts()
                batch.append(Counts(self.index, in_flight, sent))
            if batch:
                self.send(Batch(tuple(batch)))


async def serve(link: str, index: int) -> None:
    worker = Worker(link, index)
    worker.send(Hello(index, os.getpid()))
    setup = load(await worker.sock.recv())
    assert isinstance(setup, Setup), setup
    config: OrchestratorConfig = setup.config
    app = worker.build(setup)
    worker.handle(load(await worker.sock.recv()))  # the whole state, before a request can come
    tasks = [asyncio.create_task(worker.read(), name="worker-link")]
    limits = ClientLimits.of(config)
    runner = gateway_runner(app, limits, 10.0)
    await runner.setup()
    assert runner.server is not None and worker.routes is not None and worker.gateway is not None
    worker.routes.route_directly(runner.server, app)
    closed = worker.gateway.metrics.client_connection_closed  # connections closed on a limit, by reason
    listener = GatewayServer(worker.routes.fast(), runner.server, config.max_body_bytes, limits, closed)
    await listener.start(config.host, config.port, reuse_port=True)
    gc.collect()
    gc.freeze()  # as the orchestrator: full collections never walk the start-up heap
    tasks += [
        asyncio.create_task(worker.push(), name="worker-push"),
    ]
    worker.send(Serving(index))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stopped.set)
    try:
        await worker.stopped.wait()
    finally:
        await listener.close(10.0)  # stops listening first, then waits for requests in flight (bounded)
        await runner.cleanup()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        worker.sock.close(linger=0)
        worker.ctx.term()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    link, index = args[0], int(args[1])
    flags = argparse.ArgumentParser(prog="gateway worker")
    flags.add_argument("--preload-tokenizer-libs", action="store_true")
    logs.add_arguments(flags)
    options = flags.parse_args(args[2:])
    logs.configure(options.log_level, options.log_format, f"worker-{index}")
    if options.preload_tokenizer_libs:
        preload_tokenizer_libs()  # as the orchestrator: never mid-traffic
    runtime.asyncio_run(serve(link, index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
