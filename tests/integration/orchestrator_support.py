"""Support for the orchestrator's integration tests: a scripted agent on a real DEALER socket,
small misbehaving engines on real ports, and Prometheus text parsing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ADMIN, ADMIN_TOKEN
from vllm_disagg.agent.scraper import MetricsScraper
from vllm_disagg.clock import SystemClock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.orchestrator.state.registry import InstanceView
from vllm_disagg.protocol.curve import ClientCurve
from vllm_disagg.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Command,
    EngineState,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    MetricsSnapshot,
    Refuse,
    Role,
    Welcome,
)
from vllm_disagg.protocol.transport import DealerTransport

MODEL = "sim-model"


START_S = 300.0  # a deadline for a stuck start, not a speed bound


async def spawn_orchestrator(*argv: str) -> tuple[asyncio.subprocess.Process, str]:
    """``vllm-disagg orchestrator ARGV`` in its own process, once it listens: the process and the
    line it printed then (waited for: a start on a loaded machine takes what it takes)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from vllm_disagg.cli.commands import main; raise SystemExit(main())",
        "orchestrator", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(START_S):
            first = (await proc.stdout.readline()).decode()
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    if not first:
        raise AssertionError(f"it exited before it listened: {(await proc.communicate())[1].decode()}")
    return proc, first


def registered(orch: OrchestratorServer, agent_id: str) -> InstanceView:
    """``agent_id``'s instance in ``orch``'s registry; an AssertionError when it has none (to an
    ``eventually`` probe: not yet)."""
    view = orch.registry.get(agent_id)
    assert view is not None, f"no instance {agent_id!r} in the registry"
    return view


def orch_config(**overrides: Any) -> OrchestratorConfig:
    """A test orchestrator: any free ports, fast heartbeats, generous timeouts for a busy 2-core box."""
    values: dict[str, Any] = {
        "port": 0,
        "zmq_endpoint": "tcp://127.0.0.1:*",
        "heartbeat_interval_s": 0.1,
        "heartbeat_timeout_s": 1.5,
        "connect_timeout_s": 2.0,
        "idle_timeout_s": 20.0,
        "command_timeout_s": 5.0,
        "admin_token": ADMIN_TOKEN,
    }
    values.update(overrides)
    return OrchestratorConfig(**values)


class FakeAgent:
    """Plays the agent's side of the protocol: Hello until answered, heartbeats, Acks commands."""

    def __init__(
        self,
        endpoint: str,
        agent_id: str,
        url: str,
        role: Role,
        *,
        model: str = MODEL,
        interval_s: float = 0.1,
        protocol_version: int = PROTOCOL_VERSION,
        auto_ack: bool = True,
        curve: ClientCurve | None = None,
        info: InstanceInfo | None = None,
    ) -> None:
        self.agent_id = agent_id
        self.info = info or InstanceInfo(url=url, role=role, model=model, engine="sim")
        self.interval_s = interval_s
        self.protocol_version = protocol_version
        self.auto_ack = auto_ack
        self.role_refusal = ""  # when set, a set_role is answered with this error (the engine cannot)
        self.engine_state: EngineState = "ready"
        self.draining = False
        self.metrics = MetricsSnapshot()  # what the heartbeats report
        self.transport = DealerTransport(endpoint, curve=curve)
        self.inbox: asyncio.Queue[Welcome | Refuse] = asyncio.Queue()
        self.commands: list[Command] = []
        self.refusals: list[Refuse] = []
        self._seq = 0
        self._reader = asyncio.create_task(self._read())
        self._heartbeats: asyncio.Task[None] | None = None
        self._scraper: tuple[aiohttp.ClientSession, asyncio.Task[None]] | None = None

    def follow_metrics(self, engine_url: str) -> None:
        """Report what the agent's real scraper reads from ``engine_url`` instead of ``metrics``."""
        http = aiohttp.ClientSession()
        scraper = MetricsScraper(engine_url, http, SystemClock(), interval_s=self.interval_s, window_s=10.0)
        self._scraper = (http, asyncio.create_task(scraper.run()))
        self._metrics_source = scraper.latest

    _metrics_source: Callable[[], MetricsSnapshot] | None = None

    async def _read(self) -> None:
        while True:
            incoming = await self.transport.recv()
            msg = incoming.message
            if isinstance(msg, Command):
                self.commands.append(msg)
                if msg.kind == "drain":
                    self.draining = True
                elif msg.kind == "undrain":
                    self.draining = False
                if self.auto_ack:
                    refused = msg.kind == "set_role" and self.role_refusal
                    self.transport.send(
                        Ack(id=msg.id, ok=not refused, error=self.role_refusal if refused else "")
                    )
            elif isinstance(msg, Refuse):
                self.refusals.append(msg)
                await self.inbox.put(msg)
            elif isinstance(msg, Welcome):
                await self.inbox.put(msg)

    async def hello(self, timeout: float = 20.0) -> Welcome | Refuse:
        """Say Hello until the orchestrator answers (the DEALER drops sends until it is connected)."""
        hello = Hello(protocol_version=self.protocol_version, agent_id=self.agent_id, instance=self.info)
        async with asyncio.timeout(timeout):
            while True:
                self.transport.send(hello)
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(self.inbox.get(), 0.2)

    async def join(self) -> Welcome:
        """Hello, then heartbeat in the background."""
        answer = await self.hello()
        assert isinstance(answer, Welcome), answer
        self.start_heartbeats()
        return answer

    def heartbeat_now(self) -> None:
        """Send one heartbeat."""
        self._seq += 1
        self.transport.send(
            Heartbeat(
                seq=self._seq,
                engine_state=self.engine_state,
                draining=self.draining,
                metrics=self._metrics_source() if self._metrics_source else self.metrics,
            )
        )

    def start_heartbeats(self) -> None:
        """Heartbeat every ``interval_s`` until stopped."""

        async def beat() -> None:
            while True:
                self.heartbeat_now()
                await asyncio.sleep(self.interval_s)

        self.stop_heartbeats()
        self._heartbeats = asyncio.create_task(beat())

    def stop_heartbeats(self) -> None:
        """Go silent, as a crashed agent would."""
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            self._heartbeats = None

    async def next_refusal(self, timeout: float = 10.0) -> Refuse:
        """The next Refuse the orchestrator sends."""
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.inbox.get()
                if isinstance(msg, Refuse):
                    return msg

    async def close(self, goodbye: bool = False) -> None:
        """Stop tasks and close the socket (optionally saying Goodbye first)."""
        if goodbye:
            self.transport.send(Goodbye(reason="test over"))
        self.stop_heartbeats()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self.transport.close()
        if self._scraper is not None:
            http, task = self._scraper
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await http.close()


class FakeEngine:
    """A tiny HTTP server on a real port whose handlers a test writes (for failures the sim never has)."""

    def __init__(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self._handler = handler
        self.requests: list[dict[str, Any]] = []
        self.headers: list[Mapping[str, str]] = []  # case-insensitive, as HTTP headers are
        self.disconnected = asyncio.Event()
        self.release = asyncio.Event()  # handlers that hang wait on this; close() sets it
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _record(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        self.headers.append(request.headers.copy())
        try:
            return await self._handler(request)
        except (asyncio.CancelledError, ConnectionError):
            self.disconnected.set()
            raise

    async def start(self) -> FakeEngine:
        """Serve on a free loopback port."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._record)
        app.router.add_post("/v1/chat/completions", self._record)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        """Release hanging handlers and stop."""
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def fake_engine(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[FakeEngine]:
    """A started ``FakeEngine``, closed on exit."""
    engine = await FakeEngine(handler).start()
    try:
        yield engine
    finally:
        await engine.close()


async def scrape(
    session: aiohttp.ClientSession, url: str
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample at ``url/metrics`` as {(name, labels): value}."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


async def request_record(
    http: aiohttp.ClientSession, orch: OrchestratorServer, request_id: str
) -> dict[str, Any]:
    """A finished request's record from the admin API (``GET /admin/v1/requests/{id}``)."""
    async with http.get(f"{orch.url}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
        assert resp.status == 200
        record: dict[str, Any] = await resp.json()
        return record
