"""The orchestrator's side of the gateway workers: starts and restarts them, keeps their state current.

Every ``FLUSH_S`` the hub sends each serving worker what changed since the last time: the instance
views that changed (views are rebuilt per changed instance, so an identity comparison finds them),
the KV index's writes in order, the in-flight counts of every gateway process and, when changed, the
scheduler's weights and admission's tenants' weights. A worker that says ``Hello`` first gets
everything (``State(full=True)``, the KV index included); the journal is flushed to the others
before, so nothing is applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from vllm_disagg import logs
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.control.kv_moves import KvMover, failed
from vllm_disagg.orchestrator.gateway.workers.messages import (
    Answer,
    Ask,
    Batch,
    Call,
    Counts,
    Event,
    Hello,
    Joined,
    KvChange,
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
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.kv_limits import KvGate
from vllm_disagg.orchestrator.state.link_table import LinkTable
from vllm_disagg.orchestrator.state.registry import InstanceView, Registry, sum_counts
from vllm_disagg.protocol.messages import InstanceInfo, KvEvent
from vllm_disagg.runtime import die_with_parent

log = logging.getLogger(__name__)

FLUSH_S = 0.02  # how stale a worker's view of the others' load and of the instances may be
START_TIMEOUT_S = 120.0  # a worker imports the gateway (and tokenizers' libraries) before it serves
ASK_TIMEOUT_S = 2.0
# Registry calls a worker may make: those that change breakers, probes and the KV audit.
CALLS = frozenset(
    {"leg_succeeded", "leg_failed", "audit_dispatch", "audit_done", "probe_sent", "probe_ended", "kv_sent"}
)


class JournaledKvIndex(KvIndex):
    """The orchestrator's KV index, keeping its writes until the hub sends them to the workers."""

    def __init__(self, gate: KvGate | None = None) -> None:
        super().__init__(gate)
        self.journal: list[KvChange] = []

    def apply(self, agent_id: str, events: Sequence[KvEvent]) -> int:
        applied, admitted = self.apply_gated(agent_id, events)  # the workers replay it, ungated
        self.journal.append(("apply", agent_id, tuple(admitted)))
        return applied

    def drop(self, agent_id: str) -> None:
        self.journal.append(("drop", agent_id, ()))
        super().drop(agent_id)

    def plain(self) -> KvIndex:
        """A ``KvIndex`` sharing this one's entries, without the journal (what a joining worker gets)."""
        index = KvIndex.__new__(KvIndex)
        index.__dict__.update({k: v for k, v in vars(self).items() if k != "journal"})
        return index


# (the scheduler's weights, admission's tenants' weights): sent to the workers when they change
_Policies = tuple[dict[str, dict[str, float]] | None, dict[str, float] | None]


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes]
    identity: bytes | None = None
    serving: bool = False
    in_flight: dict[str, int] = field(default_factory=dict)
    restarts: int = 0


class WorkerHub:
    """Starts ``config.gateway_workers - 1`` worker processes and serves them the state."""

    def __init__(
        self,
        config: OrchestratorConfig,
        registry: Registry,
        kv_index: JournaledKvIndex,
        events: EventLog,
        weights: Callable[[], dict[str, dict[str, float]]] | None = None,
        kv_mover: KvMover | None = None,
    ) -> None:
        """``kv_mover``: the orchestrator's, for the workers' ``KvMove``s (None: each fails)."""
        self._config = config
        self._registry = registry
        self._kv_index = kv_index
        self._events = events
        self._weights = weights
        # Admission's tenants' weights (``Admission.tenant_weights``; set once the gateway is built).
        self.tenant_weights: Callable[[], dict[str, float]] | None = None
        self._workers: dict[int, _Worker] = {}
        self._dir = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sent_views: dict[str, InstanceView] = {}
        self._sent_key: tuple[Any, ...] = ()
        self._sent_policies: _Policies = (None, None)  # the weights last sent
        self._sent_links: LinkTable | None = None  # the link table last sent
        self._seq = 0  # flushes sent; a full state carries the current one
        self._queries = itertools.count(1)
        self._answers: dict[int, tuple[asyncio.Future[None], list[Answer], int]] = {}
        self._closing = False
        self.primary_url = ""
        self.all_serving = asyncio.Event()
        self.kv_mover = kv_mover
        self._moves: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        return f"ipc://{self._dir}/link"

    async def start(self, primary_url: str, port: int) -> None:
        """Bind the link, start the workers and wait until each serves on the shared ``port``."""
        self.primary_url = primary_url
        self._config = dataclasses.replace(self._config, port=port)  # the one bound, when 0 was asked
        self._dir = tempfile.mkdtemp(prefix="vllm-disagg-workers-")  # 0700: this user only
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a ROUTER drops what it cannot queue, and a worker busy for a moment must
        # get every delta (a lost one is caught by ``State.seq`` and costs a whole resync).
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.bind(self.endpoint)
        for index in range(1, self._config.gateway_workers):
            self._workers[index] = _Worker(index, self._spawn(index))
        self._tasks = [
            asyncio.create_task(self._read(), name="workers-reader"),
            asyncio.create_task(self._flush_loop(), name="workers-flush"),
            asyncio.create_task(self._supervise(), name="workers-supervise"),
        ]
        try:
            await asyncio.wait_for(self.all_serving.wait(), START_TIMEOUT_S)
        except TimeoutError:
            await self.close()
            raise RuntimeError(f"gateway workers not serving after {START_TIMEOUT_S:g} s") from None

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            "-m",
            "vllm_disagg.orchestrator.gateway.workers.worker",
            self.endpoint,
            str(index),
            *logs.child_argv(),
        ]
        if self._config.preload_tokenizer_libs:
            argv.append("--preload-tokenizer-libs")  # before it says Hello: the imports take seconds
        return subprocess.Popen(argv, preexec_fn=die_with_parent)

    def _send(self, worker: _Worker, message: object, frame: bytes | None = None) -> None:
        """``message`` (or its ``frame``, dumped once for many workers) to one worker that said Hello."""
        if self._sock is None or worker.identity is None:
            return
        with contextlib.suppress(zmq.ZMQError):  # a worker that just died: the supervisor restarts it
            self._sock.send_multipart([worker.identity, frame or dump(message)], flags=zmq.NOBLOCK)

    def broadcast(self, message: object) -> None:
        """Send ``message`` to every serving worker."""
        frame = dump(message)
        for worker in self._workers.values():
            if worker.serving:
                self._send(worker, message, frame)

    def instance_lost(self, agent_id: str, reason: str) -> None:
        self.broadcast(Lost(agent_id, reason))

    def instance_joined(self, info: InstanceInfo) -> None:
        self.broadcast(Joined(info))

    def note(self, request_id: str, note: str) -> None:
        """A KV audit note for a request this process did not serve: the workers' records get it."""
        self.broadcast(Note(request_id, note))

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            identity, frame = await self._sock.recv_multipart()
            try:
                self._handle(identity, load(frame))
            except Exception:  # one bad frame or message must not stop the link
                log.exception("gateway worker message not handled")

    def _handle(self, identity: bytes, msg: object) -> None:
        if isinstance(msg, Batch):
            for one in msg.messages:
                self._handle(identity, one)
        elif isinstance(msg, Counts):
            worker = self._workers.get(msg.index)
            if worker is not None:
                worker.in_flight = msg.in_flight
                self._registry.set_remote_in_flight(self._remote_in_flight())
                self._registry.count_sent(msg.sent)
        elif isinstance(msg, Call):
            if msg.name not in CALLS:
                log.error("a gateway worker asked for %r: refused", msg.name)
                return
            getattr(self._registry, msg.name)(*msg.args, **msg.kwargs)
        elif isinstance(msg, Event):
            self._events.publish_fields(msg.kind, msg.fields)
        elif isinstance(msg, KvMove):
            task = asyncio.get_running_loop().create_task(self._move(identity, msg))
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)
        elif isinstance(msg, Answer):
            waiting = self._answers.get(msg.query)
            if waiting is not None:
                done, answers, expected = waiting
                answers.append(msg)
                if len(answers) >= expected and not done.done():
                    done.set_result(None)
        elif isinstance(msg, Hello):
            self._hello(identity, msg)
        elif isinstance(msg, Resync):
            worker = self._workers.get(msg.index)
            if worker is not None and worker.identity == identity:
                log.warning("gateway worker %d missed a state message: sending it the whole state", msg.index)
                self._flush()
                self._send(worker, self._state(full=True))
        elif isinstance(msg, Serving):
            worker = self._workers.get(msg.index)
            if worker is not None:
                worker.serving = True
                log.info("gateway worker %d serving (pid %d)", msg.index, worker.process.pid)
                if all(w.serving for w in self._workers.values()):
                    self.all_serving.set()

    async def _move(self, identity: bytes, msg: KvMove) -> None:
        """A worker's KV move, made with the control plane; the outcome goes back to that worker."""
        mover = self.kv_mover
        if mover is None:
            result = failed("unavailable", "the orchestrator has no control plane")
        else:
            try:
                result = await mover.move(msg.holder, msg.receiver, msg.keys)
            except Exception as exc:  # a bug must not leave the worker's decode leg waiting
                log.exception("a gateway worker's KV move failed")
                result = failed("unavailable", f"{type(exc).__name__}: {exc}")
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):  # a worker that died meanwhile: it is restarted
                self._sock.send_multipart([identity, dump(KvMoved(msg.query, result))], flags=zmq.NOBLOCK)

    def _hello(self, identity: bytes, msg: Hello) -> None:
        worker = self._workers.get(msg.index)
        if worker is None or worker.process.pid != msg.pid:
            log.error("a gateway worker that was not started here said Hello (%s): ignored", msg)
            return
        self._flush()  # the others get the journal first: the full state below already holds it
        worker.identity = identity
        # The admin token stays here: a worker proxies admin calls, it never checks them.
        self._send(worker, Setup(dataclasses.replace(self._config, admin_token=""), self.primary_url))
        self._send(worker, self._state(full=True))

    def _remote_in_flight(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for worker in self._workers.values():
            total = sum_counts(total, worker.in_flight)
        return total

    def _state(self, full: bool) -> State:
        snap = self._registry.snapshot()
        views = dict(snap.by_id)
        removed: tuple[str, ...] = ()
        if full:
            changed = views
        else:
            sent = self._sent_views
            changed = {i: v for i, v in views.items() if sent.get(i) is not v}
            removed = tuple(i for i in sent if i not in views)
        in_flight = {0: self._beside_workers()}
        in_flight.update({w.index: w.in_flight for w in self._workers.values()})
        policies = self._policies()
        weights, tenants = policies
        if full:
            return State(
                True, self._seq, changed, removed, snap.version, snap.membership, snap.blocked_links,
                self._registry.audited(), in_flight, kv_index=self._kv_index.plain(), weights=weights,
                tenant_weights=tenants, links=snap.links,
            )  # fmt: skip
        sent_weights, sent_tenants = self._sent_policies
        self._sent_views = views
        self._sent_policies = policies
        links, self._sent_links = (None if snap.links is self._sent_links else snap.links), snap.links
        kv, self._kv_index.journal = tuple(self._kv_index.journal), []
        self._seq += 1
        return State(
            False, self._seq, changed, removed, snap.version, snap.membership, snap.blocked_links,
            self._registry.audited(), in_flight, kv=kv, weights=None if weights == sent_weights else weights,
            tenant_weights=None if tenants == sent_tenants else tenants, links=links,
        )  # fmt: skip

    def _policies(self) -> _Policies:
        """(the scheduler's weights, admission's tenants' weights), each None where there are none."""
        weights = self._weights() if self._weights is not None else None
        tenants = self.tenant_weights() if self.tenant_weights is not None else None
        return weights, tenants

    def _beside_workers(self) -> dict[str, int]:
        """Requests in flight outside the workers: this process's and, as a replica, the others'."""
        return sum_counts(self._registry.own_in_flight(), self._registry.remote_in_flight("peers"))

    def _flush(self) -> None:
        """Send what changed since the last flush to every serving worker (nothing when nothing did)."""
        key = (
            self._registry.snapshot().version,
            tuple(sorted(self._beside_workers().items())),
            tuple((w.index, tuple(sorted(w.in_flight.items()))) for w in self._workers.values()),
        )
        if key == self._sent_key and not self._kv_index.journal and self._policies() == self._sent_policies:
            return
        self._sent_key = key
        state = self._state(full=False)
        frame = dump(state)
        for worker in self._workers.values():  # serving or not: a starting worker counts on every delta
            self._send(worker, state, frame)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                self._flush()
            except Exception:
                log.exception("gateway workers' state not sent")

    async def _supervise(self) -> None:
        while not self._closing:
            await asyncio.sleep(0.2)
            for worker in list(self._workers.values()):
                code = worker.process.poll()
                if code is None or self._closing:
                    continue
                worker.restarts += 1
                log.error("gateway worker %d exited (%s): restarting it", worker.index, code)
                self._events.publish("gateway_worker_restarted", worker=worker.index, exit_code=code)
                self._workers[worker.index] = _Worker(
                    worker.index, self._spawn(worker.index), restarts=worker.restarts
                )
                self._registry.set_remote_in_flight(self._remote_in_flight())

    async def ask(self, what: str, arg: Any = None) -> list[Answer]:
        """Ask every serving worker ``what`` (see ``Ask``); the answers that came in time."""
        serving = [w for w in self._workers.values() if w.serving]
        if not serving:
            return []
        query = next(self._queries)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answers: list[Answer] = []
        self._answers[query] = (done, answers, len(serving))
        for worker in serving:
            self._send(worker, Ask(query, what, arg))
        try:
            await asyncio.wait_for(done, ASK_TIMEOUT_S)
        except TimeoutError:
            log.warning("gateway workers: %d of %d answered %r in time", len(answers), len(serving), what)
        finally:
            self._answers.pop(query, None)
        return sorted(answers, key=lambda a: a.index)

    def describe(self) -> list[dict[str, Any]]:
        """The workers, for the admin API."""
        return [
            {
                "index": w.index,
                "pid": w.process.pid,
                "serving": w.serving,
                "restarts": w.restarts,
                "in_flight": dict(w.in_flight),  # requests per instance, as it last said
            }
            for w in self._workers.values()
        ]

    async def close(self) -> None:
        """Stop the workers (they finish what is in flight, bounded) and the link."""
        self._closing = True
        for worker in self._workers.values():
            # SIGTERM: a serving worker stops listening and finishes its requests; one still starting exits.
            with contextlib.suppress(ProcessLookupError):
                worker.process.terminate()
        for task in (*self._tasks, *self._moves):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._moves, return_exceptions=True)
        for worker in self._workers.values():
            try:  # a worker finishes its requests in flight within its shutdown timeout (10 s)
                await asyncio.to_thread(worker.process.wait, 15.0)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                await asyncio.to_thread(worker.process.wait)
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
