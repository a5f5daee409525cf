"""Wiring: one aiohttp application holding the registry, control plane, scheduler, gateway and admin.

State lives under ``web.AppKey``s; the ZeroMQ socket, its reader and expiry tasks and the engine client
session start and stop with the application (``cleanup_ctx``). ``start_orchestrator`` runs it
in-process on real sockets, for tests, the benchmark and ``main``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_disagg.clock import Clock, SystemClock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.http_errors import answering
from vllm_disagg.orchestrator.admin.admission import tenant_weights
from vllm_disagg.orchestrator.admin.api import Admin
from vllm_disagg.orchestrator.admin.dashboard import add_dashboard_routes
from vllm_disagg.orchestrator.control.kv_moves import ControlKvMover, KvMover, KvMoveSettings
from vllm_disagg.orchestrator.control.plane import ControlPlane, cancel_and_wait, load_server_curve
from vllm_disagg.orchestrator.control.roles import RoleChanger
from vllm_disagg.orchestrator.control.rollout import Rollouts
from vllm_disagg.orchestrator.control.spawner import AgentSpawner
from vllm_disagg.orchestrator.gateway.deadlines import ClientLimits
from vllm_disagg.orchestrator.gateway.listener import GatewayServer, gateway_runner
from vllm_disagg.orchestrator.gateway.records import REQUEST_LOG_CAPACITY, RequestLog
from vllm_disagg.orchestrator.gateway.routes import OpenAIRoutes
from vllm_disagg.orchestrator.gateway.service import Gateway
from vllm_disagg.orchestrator.gateway.tokenize import Tokenizers
from vllm_disagg.orchestrator.gateway.workers.hub import JournaledKvIndex, WorkerHub
from vllm_disagg.orchestrator.kv_warmup import KvLinkWarmup
from vllm_disagg.orchestrator.loop_lag import watch_loop_lag
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.planner.config import PlannerConfig, load_planner_config_file
from vllm_disagg.orchestrator.planner.runner import PlannerRunner
from vllm_disagg.orchestrator.planner.signals import SloWindow
from vllm_disagg.orchestrator.replicas.forward import LeaderForwarder
from vllm_disagg.orchestrator.replicas.replica import (
    Card,
    ForwardingKvMover,
    Replication,
    advertised,
    default_replica_id,
    with_host,
)
from vllm_disagg.orchestrator.scheduling.config import load_scheduler_config
from vllm_disagg.orchestrator.scheduling.framework import Scheduler
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.health import BreakerPolicy
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.kv_limits import KvGate, KvLimits
from vllm_disagg.orchestrator.state.leadership import Leadership, LeaderView
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import HELLO_BACKOFF_MAX_S

log = logging.getLogger(__name__)


CONFIG_KEY = web.AppKey("config", OrchestratorConfig)
CLOCK_KEY = web.AppKey("clock", Clock)
REGISTRY_KEY = web.AppKey("registry", Registry)
METRICS_KEY = web.AppKey("metrics", OrchestratorMetrics)
CONTROL_KEY = web.AppKey("control", ControlPlane)
GATEWAY_KEY = web.AppKey("gateway", Gateway)
ROUTES_KEY = web.AppKey("routes", OpenAIRoutes)  # the gateway's handlers, for the port's own server
REQUEST_LOG_KEY = web.AppKey("request_log", RequestLog)
KV_INDEX_KEY = web.AppKey("kv_index", KvIndex)
SPAWNER_KEY = web.AppKey("spawner", AgentSpawner)
ADMIN_APP_KEY = web.AppKey("admin_app", web.Application)  # only with a separate admin listener
WORKERS_KEY = web.AppKey("workers", WorkerHub)  # only with --gateway-workers above 1
PLANNER_KEY = web.AppKey("planner", PlannerRunner)
ROLLOUTS_KEY = web.AppKey("rollouts", Rollouts)
ROLES_KEY = web.AppKey("roles", RoleChanger)
REPLICATION_KEY = web.AppKey("replication", Replication)  # only with --etcd
FORWARDER_KEY = web.AppKey("forwarder", LeaderForwarder)  # only with --etcd
ADMIN_KEY = web.AppKey("admin", Admin)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died", task.get_name(), exc_info=task.exception())


async def _control_ctx(app: web.Application) -> AsyncIterator[None]:
    control = app[CONTROL_KEY]
    control.start()
    tasks = [
        asyncio.create_task(control.run_reader(), name="orchestrator-zmq-reader"),
        asyncio.create_task(control.run_expiry(), name="orchestrator-expiry"),
        asyncio.create_task(watch_loop_lag(app[METRICS_KEY].loop_lag), name="orchestrator-loop-lag"),
    ]
    planner = app[PLANNER_KEY]
    if planner.config.enabled:
        tasks.append(asyncio.create_task(planner.run(), name="orchestrator-planner"))
    tasks.append(asyncio.create_task(app[ROLLOUTS_KEY].run(), name="orchestrator-rollouts"))
    warmup = KvLinkWarmup(app[REGISTRY_KEY], app[CONFIG_KEY], app[METRICS_KEY])  # ready: its KV link works
    tasks.append(asyncio.create_task(warmup.run(), name="orchestrator-kv-warmup"))
    for task in tasks:
        task.add_done_callback(_log_crash)
    try:
        yield
    finally:
        await app[SPAWNER_KEY].close()  # while the socket is open: their Goodbyes still arrive
        for task in tasks:
            await cancel_and_wait(task)
        await planner.close()
        await app[ROLLOUTS_KEY].close()
        await app[ROLES_KEY].close()
        control.close()


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY_KEY]
    gateway.open()
    try:
        yield
    finally:
        await gateway.close()
        gateway.tokenizers.close()


class _Listeners:
    """Calls each of its listeners in turn. Handed to a part that tells of something (the control
    plane, of a Hello) before its listeners exist: they use what is built after it (the KV mover)."""

    def __init__(self) -> None:
        self.listeners: list[Callable[..., None]] = []

    def __call__(self, *args: Any) -> None:
        for listener in self.listeners:
            listener(*args)


@dataclass(frozen=True, slots=True)
class _State:
    """What everything else reads or feeds: instances, the KV index, metrics, the event log."""

    registry: Registry
    kv_index: KvIndex
    metrics: OrchestratorMetrics
    events: EventLog

    @classmethod
    def build(cls, config: OrchestratorConfig, clock: Clock) -> _State:
        registry = Registry(
            config.heartbeat_timeout_s,
            suspect_after_s=config.suspect_after_s,
            breaker=BreakerPolicy(failures_to_open=config.breaker_failures, open_s=config.breaker_open_s),
            prove_kv_links=True,  # by ``kv_warmup``, run with the control plane
        )
        # With gateway workers the index keeps a journal of its writes, which the workers replay.
        gate = KvGate(KvLimits(), clock.monotonic)  # bounds what one agent's KV events can index
        kv_index = KvIndex(gate) if config.gateway_workers == 1 else JournaledKvIndex(gate)
        metrics = OrchestratorMetrics(
            registry.snapshot, kv_index.blocks_of, pool_blocks=kv_index.pool_blocks_of
        )
        gate.sink = metrics.kv_events_dropped
        return cls(registry, kv_index, metrics, EventLog(clock.wall))


def build_app(
    config: OrchestratorConfig,
    clock: Clock | None = None,
    scheduler: Scheduler | None = None,
    *,
    kv_moves: KvMoveSettings | None = None,
) -> web.Application:
    """The orchestrator's application; nothing is bound until it is started. ``kv_moves``: how KV is
    moved between agents' pools (defaults: ``KvMoveSettings``).

    Each part is built after what it uses and given it in its constructor. What is joined afterwards
    is who hears of events: the gateway and the workers' hub of an instance's Hello (the control
    plane's, through ``_Listeners``), of its loss, and of KV audits (the registry's hooks)."""
    clock = clock or SystemClock()
    state = _State.build(config, clock)
    scheduler = scheduler or PluginScheduler(load_scheduler_config(config))
    hellos = _Listeners()
    leadership = _leadership(config)
    replication: Replication | None = None
    control = ControlPlane(
        config, state.registry, clock, state.metrics, state.kv_index, on_hello=hellos, leadership=leadership
    )
    kv_moves = kv_moves or KvMoveSettings(
        config.kv_grant_ttl_s, config.kv_grant_timeout_s, config.kv_fetch_timeout_s
    )
    kv_mover: KvMover = ControlKvMover(control, state.registry, kv_moves)
    if config.replica is not None:
        replication = _replication(config, state, leadership, clock, kv_mover, scheduler)
        # A follower's gateway asks the leader to move KV: only the leader commands agents.
        timeout_s = kv_moves.grant_timeout_s + kv_moves.fetch_timeout_s + 1.0
        kv_mover = ForwardingKvMover(kv_mover, replication, timeout_s)
    hub = None
    if isinstance(state.kv_index, JournaledKvIndex):
        weights = getattr(scheduler, "weights", None)
        hub = WorkerHub(config, state.registry, state.kv_index, state.events, weights, kv_mover=kv_mover)
    planner_config = load_planner_config_file(config.planner_config)
    slo_window = SloWindow(planner_config.window_s, clock.monotonic)
    gateway = _gateway(config, clock, state, scheduler, kv_mover, hub, slo_window, replication)
    _listen(state.registry, hellos, gateway, hub)
    roles = RoleChanger(
        state.registry,
        control,
        state.metrics,
        clock,
        state.events,
        drain_timeout_s=config.role_drain_timeout_s,
        restart_timeout_s=config.role_restart_timeout_s,
        record=replication.intent if replication is not None else None,
    )
    if replication is not None:
        replication.intent.on_role = roles.adopt
        # A new leader goes on with the role changes the last one left under way.
        leadership.watch(lambda: roles.take_over() if leadership.is_leader else None)
    planner = _planner(planner_config, state, slo_window, roles, clock, leadership, replication)
    return _application(config, clock, state, control, gateway, hub, roles, planner, replication)


def _planner(
    config: PlannerConfig,
    state: _State,
    window: SloWindow,
    roles: RoleChanger,
    clock: Clock,
    leadership: Leadership,
    replication: Replication | None,
) -> PlannerRunner:
    """The planner: it looks while this orchestrator leads; a replica's memory is kept in etcd."""
    planner = PlannerRunner(
        config,
        state.registry,
        window,
        roles,
        state.metrics,
        state.events,
        clock,
        leads=lambda: leadership.is_leader,
        record=replication.intent.save_planner if replication is not None else None,
    )
    if replication is not None:
        replication.intent.on_planner = planner.adopt
    return planner


def _replication(
    config: OrchestratorConfig,
    state: _State,
    leadership: Leadership,
    clock: Clock,
    kv_mover: KvMover,
    scheduler: Scheduler,
) -> Replication:
    """This replica's election, membership, link to the others and operators' intent (``--etcd``)."""
    assert config.replica is not None
    return Replication(
        config.replica,
        leadership.replica_id,
        leadership,
        state.registry,
        clock,
        state.events,
        state.metrics,
        peer_endpoint=f"tcp://{_bind_host(config.host)}:{config.replica.peer_port}",
        curve=load_server_curve(config),
        kv_mover=kv_mover,  # the leader carries out the moves its followers ask for
        weights=getattr(scheduler, "weights", None),
        set_weights=getattr(scheduler, "update_weights", None),
    )


def _leadership(config: OrchestratorConfig) -> Leadership:
    """A single orchestrator leads for good; a replica follows until its election says otherwise."""
    if config.replica is None:
        return Leadership.sole()
    replica_id = config.replica.replica_id or default_replica_id(config.port)
    waiting = LeaderView(False, 0, "", 0.0, etcd_ok=False, paused="starting: not yet heard from etcd")
    return Leadership(replica_id, waiting)


def _bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _gateway(
    config: OrchestratorConfig,
    clock: Clock,
    state: _State,
    scheduler: Scheduler,
    kv_mover: KvMover,
    hub: WorkerHub | None,
    slo_window: SloWindow,
    replication: Replication | None,
) -> Gateway:
    """The gateway, with its request log and tokenizers; its admission's tenants' weights shared."""
    gateway = Gateway(
        config,
        state.registry,
        scheduler,
        state.metrics,
        clock,
        # A KV audit's note for a request served by a worker goes to the workers.
        request_log=RequestLog(REQUEST_LOG_CAPACITY, note_elsewhere=hub.note if hub is not None else None),
        kv_index=state.kv_index,
        tokenizers=Tokenizers(max_pending=config.tokenize_queue, metrics=state.metrics),
        events=state.events,
        kv_mover=kv_mover,
        slo_window=slo_window,
    )
    _share_tenant_weights(gateway, hub, replication)
    return gateway


def _listen(registry: Registry, hellos: _Listeners, gateway: Gateway, hub: WorkerHub | None) -> None:
    """Who hears of an instance's Hello, of its loss, of KV audits and of the registry's events."""
    hellos.listeners.append(gateway.instance_joined)  # it loads the model's tokenizer before traffic
    lost = _Listeners()
    lost.listeners.append(gateway.instance_lost)
    if hub is not None:
        hellos.listeners.append(hub.instance_joined)
        lost.listeners.append(hub.instance_lost)
    registry.on_lost = lost
    registry.on_kv_audit = gateway.kv_audited
    registry.on_event = gateway.events.publish_fields


def _share_tenant_weights(gateway: Gateway, hub: WorkerHub | None, replication: Replication | None) -> None:
    """Admission's tenants' weights reach every process that admits: the gateway workers with the next
    state push, and the other replicas through etcd (``admission/tenants``), which each one applies."""
    admission = gateway.admission
    if admission is None:
        return
    if hub is not None:
        hub.tenant_weights = admission.tenant_weights
    if replication is not None:
        replication.intent.on_tenants = lambda data: admission.set_tenant_weights(
            tenant_weights(data, admission.config)
        )


def _application(
    config: OrchestratorConfig,
    clock: Clock,
    state: _State,
    control: ControlPlane,
    gateway: Gateway,
    hub: WorkerHub | None,
    roles: RoleChanger,
    planner: PlannerRunner,
    replication: Replication | None,
) -> web.Application:
    """The application: its parts under their keys, every route, and what starts and stops with it."""
    registry, events = state.registry, state.events
    spawner = AgentSpawner(control, registry)
    rollouts = _rollouts(registry, control, events, clock, replication)
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG_KEY] = config
    app[CLOCK_KEY] = clock
    app[REGISTRY_KEY] = registry
    app[METRICS_KEY] = state.metrics
    app[CONTROL_KEY] = control
    app[GATEWAY_KEY] = gateway
    app[REQUEST_LOG_KEY] = gateway.request_log
    app[KV_INDEX_KEY] = state.kv_index
    app[SPAWNER_KEY] = spawner
    if hub is not None:
        app[WORKERS_KEY] = hub
    app[PLANNER_KEY] = planner
    app[ROLLOUTS_KEY] = rollouts
    app[ROLES_KEY] = roles
    forwarder = None
    if replication is not None:
        app[REPLICATION_KEY] = replication
        app[FORWARDER_KEY] = forwarder = LeaderForwarder(replication)
    app[ROUTES_KEY] = routes = OpenAIRoutes(gateway)
    routes.add_to(app)
    admin = Admin(
        registry,
        control,
        state.metrics,
        gateway.request_log,
        clock,
        gateway.describe,
        events,
        gateway.live_requests,
        gateway.scheduler,
        spawner=spawner,
        workers=hub,
        roles=roles,
        planner=planner.describe,
        rollouts=rollouts,
        replicas=replication.describe if replication is not None else None,
        forward=forwarder,
        intent=replication.intent if replication is not None else None,
        start_grace_s=config.heartbeat_timeout_s + HELLO_BACKOFF_MAX_S if replication is not None else 0.0,
        admission=gateway.admission,
    )
    _add_admin(app, admin, config)
    app.cleanup_ctx.extend((_control_ctx, _session_ctx))  # in this order: stopped in the reverse one
    return app


def _rollouts(
    registry: Registry, control: ControlPlane, events: EventLog, clock: Clock, replication: Replication | None
) -> Rollouts:
    """Model rollouts; a replica's are recorded in etcd, stepped by the leader and adopted by all."""
    rollouts = Rollouts(
        registry,
        control.admit_revisions,
        control.settle_revision,
        control.send_command,
        events,
        clock,
        record=replication.intent if replication is not None else None,
        leads=lambda: control.leadership.is_leader,
    )
    if replication is not None:
        replication.intent.on_rollout = rollouts.adopt
        control.leadership.watch(rollouts.wake)  # a new leader goes on with a rollout at once
    return rollouts


def _add_admin(app: web.Application, admin: Admin, config: OrchestratorConfig) -> None:
    """The admin API and dashboard: on the gateway's port, or on their own listener."""
    app[ADMIN_KEY] = admin  # its health checks fail first when the server closes
    admin.add_public_routes(app)
    if config.admin_port is None:
        admin.add_admin_routes(app, config.admin_token)
        add_dashboard_routes(app)  # beside the API it reads: same origin
    else:  # its own listener, started beside the gateway's by ``start_orchestrator``
        admin_app = web.Application(client_max_size=1 << 20)
        admin.add_admin_routes(admin_app, config.admin_token)
        add_dashboard_routes(admin_app)  # not on the public port: there it is a 404
        app[ADMIN_APP_KEY] = admin_app
        app.router.add_route("*", "/admin/{tail:.*}", answering(admin.elsewhere))


class OrchestratorServer:
    """A running orchestrator: its HTTP URLs (gateway; admin, the same unless it has its own
    listener), its actual ZeroMQ endpoint, and ``close()``."""

    def __init__(
        self,
        app: web.Application,
        listener: GatewayServer,
        runners: list[web.AppRunner],
        url: str,
        admin_url: str = "",
        shutdown_timeout_s: float = 10.0,
        shutdown_delay_s: float = 0.0,
    ) -> None:
        self.app = app
        self.url = url
        self.admin_url = admin_url or url
        self._listener = listener
        self._runners = runners
        self._shutdown_timeout_s = shutdown_timeout_s
        self._shutdown_delay_s = shutdown_delay_s

    @property
    def zmq_endpoint(self) -> str:
        """The agent endpoint actually bound."""
        return self.app[CONTROL_KEY].endpoint

    @property
    def replica_id(self) -> str:
        """This replica's id ("" for a single orchestrator)."""
        return self.app[CONTROL_KEY].leadership.replica_id

    @property
    def registry(self) -> Registry:
        """The live registry (tests read it)."""
        return self.app[REGISTRY_KEY]

    @property
    def kv_index(self) -> KvIndex:
        """Which instance caches which prompt prefix, fed by the agents' KV events."""
        return self.app[KV_INDEX_KEY]

    async def close(self, hurry: asyncio.Event | None = None) -> None:
        """Fail the health checks and go on serving for ``shutdown_delay_s`` or until ``hurry`` is set
        (a load balancer stops sending meanwhile: a connection still waiting to be accepted when the
        listener closes is reset), then stop serving, wait for in-flight requests (bounded), release
        every socket and task."""
        self.app[ADMIN_KEY].stop_serving()
        if self._shutdown_delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for((hurry or asyncio.Event()).wait(), self._shutdown_delay_s)
        replication = self.app.get(REPLICATION_KEY)
        if replication is not None:  # first: another replica leads at once, not after the lease's TTL
            await replication.close()
            await self.app[FORWARDER_KEY].close()
        hub = self.app.get(WORKERS_KEY)
        if hub is not None:  # first: they finish their requests, proxying to this process meanwhile
            await hub.close()
        await self._listener.close(self._shutdown_timeout_s)
        for runner in reversed(self._runners):  # the admin listener first, the gateway's last
            await runner.cleanup()


async def start_orchestrator(
    config: OrchestratorConfig,
    clock: Clock | None = None,
    scheduler: Scheduler | None = None,
    *,
    shutdown_timeout_s: float = 10.0,
    shutdown_delay_s: float = 0.0,
    kv_moves: KvMoveSettings | None = None,
) -> OrchestratorServer:
    """Build and start the orchestrator on ``config.host:config.port`` (port 0: any free port)."""
    app = build_app(config, clock, scheduler, kv_moves=kv_moves)
    limits = ClientLimits.of(config)
    runner = gateway_runner(app, limits, shutdown_timeout_s)
    runners = [runner]
    routes = app[ROUTES_KEY]
    listener: GatewayServer | None = None
    try:
        await runner.setup()
        assert runner.server is not None
        routes.route_directly(runner.server, app)
        # The gateway's port: its own server for the OpenAI routes, aiohttp's for the rest.
        closed = app[METRICS_KEY].client_connection_closed  # connections closed on a limit, by reason
        listener = GatewayServer(routes.fast(), runner.server, config.max_body_bytes, limits, closed)
        hub = app.get(WORKERS_KEY)
        # With workers the port is only bound until every worker serves on it too: the orchestrator
        # answers nothing (admin on this port included) before the whole gateway is up, so whoever
        # waits for it to answer (``up``, a readiness probe) never sends traffic that one process gets.
        bound = await listener.start(config.host, config.port, reuse_port=hub is not None, listen=hub is None)
        url = _url(bound)
        if hub is not None:
            # The workers proxy every path but the gateway's to a listener of this process only (on the
            # shared port the kernel could hand a proxied request back to a worker).
            primary_url = await _serve_more(runner, "127.0.0.1", 0)
            await hub.start(primary_url, bound[1])
            await listener.listen()
        admin_url = ""
        if ADMIN_APP_KEY in app:
            admin_runner = web.AppRunner(app[ADMIN_APP_KEY], access_log=None, shutdown_timeout=1.0)
            runners.append(admin_runner)
            await admin_runner.setup()
            admin_url = await _serve(admin_runner, config.admin_host, config.admin_port or 0)
        replication = app.get(REPLICATION_KEY)
        if replication is not None:
            await replication.start(
                _card(config, replication, url, admin_url or url, app[CONTROL_KEY].endpoint)
            )
    except BaseException:
        if listener is not None:
            await listener.close(0.0)
        for r in reversed(runners):
            await r.cleanup()
        raise
    return OrchestratorServer(app, listener, runners, url, admin_url, shutdown_timeout_s, shutdown_delay_s)


def _card(
    config: OrchestratorConfig, replication: Replication, url: str, admin_url: str, agents: str
) -> Card:
    """Where the other replicas reach this one: its bound URLs, at its advertised host."""
    assert config.replica is not None
    host = advertised(config.replica.advertise_host, config.host)
    admin_host = advertised(config.replica.advertise_host, config.admin_host) if admin_url != url else host
    return Card(
        replication.replica_id,
        http=with_host(url, host),
        admin=with_host(admin_url, admin_host),
        peer=with_host(replication.link.endpoint, host),
        agents=with_host(agents, host),
    )


async def _serve(runner: web.AppRunner, host: str, port: int) -> str:
    """Start the set-up ``runner`` on ``host:port`` (0: any free port); its base URL."""
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return _url(runner.addresses[0])


async def _serve_more(runner: web.AppRunner, host: str, port: int) -> str:
    """Add a listener to a started ``runner``; its base URL."""
    site = web.TCPSite(runner, host, port)
    await site.start()
    return _url(runner.addresses[-1])


def _url(address: Any) -> str:
    bound_host, bound_port = address[:2]
    if ":" in bound_host:
        bound_host = f"[{bound_host}]"
    return f"http://{bound_host}:{bound_port}"
