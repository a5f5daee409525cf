"""``vllm-disagg agent``: one agent per engine: supervise it, scrape it, report it to the orchestrator
(heartbeats, and the engine's KV-cache events); to every replica of a replicated one (``Sessions``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import shlex
import sys
from pathlib import Path

import aiohttp

from vllm_disagg import logs
from vllm_disagg.agent.command_log import CommandLog
from vllm_disagg.agent.discover import AttachedEngine, DiscoveryError, role_switch, warn_exposed_kv_events
from vllm_disagg.agent.engine import EngineSupervisor
from vllm_disagg.agent.engine_kinds import instance_info
from vllm_disagg.agent.kv.agent_pool import KvPool
from vllm_disagg.agent.kv.arena import Capacity
from vllm_disagg.agent.kv.disk import disk_bytes
from vllm_disagg.agent.kv_forwarder import KvEventForwarder, forwarder_endpoint
from vllm_disagg.agent.labels import add_label_arguments, labels_from_args
from vllm_disagg.agent.scraper import MetricsScraper
from vllm_disagg.agent.session import EXIT_REFUSED, SessionEnd
from vllm_disagg.agent.sessions import Sessions
from vllm_disagg.agent.vllm_command import serves_pool
from vllm_disagg.clock import Clock, SystemClock
from vllm_disagg.config import AgentConfig, add_sim_timing_arguments, sim_timing_from_args
from vllm_disagg.private_files import private_dir
from vllm_disagg.protocol.curve import ClientCurve, load_keypair, load_public
from vllm_disagg.protocol.kv_connectors import extra_config, resolve
from vllm_disagg.protocol.messages import ROLES, EngineState
from vllm_disagg.runtime import become_subreaper, reap_children, run_service

log = logging.getLogger(__name__)

GOODBYE_LINGER_MS = 1000  # how long closing may wait to deliver the last Ack/Goodbye

_DEFAULT = AgentConfig(agent_id="-", role="both")
# (flag, AgentConfig field, type, help)
_AGENT_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    (
        "--orchestrator",
        "orchestrator",
        str,
        "the orchestrator's ZeroMQ endpoint; replicas: a comma-separated list (a session with each)",
    ),
    (
        "--command-log",
        "command_log",
        str,
        "append one JSON line per command received to this file (docs/agent.md)",
    ),
    ("--model", "model", str, "served model name"),
    ("--engine-host", "engine_host", str, "host the launched engine listens on"),
    ("--engine-port", "engine_port", int, "port the launched engine listens on"),
    ("--attach", "attach_url", str, "follow this already running engine instead of launching one"),
    (
        "--kv-events-endpoint",
        "kv_events_endpoint",
        str,
        "with --attach: the engine's KV-events PUB endpoint to forward (default: none); keep it on this "
        "host (ipc:// or loopback): the events carry prompts",
    ),
    (
        "--kv-events-listen",
        "kv_events_listen",
        str,
        "with --attach: bind this ipc:// or loopback endpoint and let the engine's PUB connect to it "
        "(vLLM connects when its kv-events endpoint names a host, e.g. tcp://127.0.0.1:5557)",
    ),
    (
        "--curve-secret-key",
        "curve_secret_key_file",
        str,
        "this agent's .key_secret file (vllm-disagg keys): authenticate to the orchestrator",
    ),
    ("--orchestrator-key", "orchestrator_key_file", str, "the orchestrator's public .key file"),
    ("--scrape-interval-s", "scrape_interval_s", float, "how often /health and /metrics are read"),
    ("--metrics-window-s", "metrics_window_s", float, "window of TTFT, TPOT and hit-rate averages"),
    ("--startup-timeout-s", "startup_timeout_s", float, "a launched engine not ready by then is restarted"),
    ("--restart-backoff-s", "restart_backoff_s", float, "first restart delay, doubled per failed restart"),
    ("--restart-backoff-max-s", "restart_backoff_max_s", float, "longest restart delay"),
    ("--stop-grace-s", "stop_grace_s", float, "SIGTERM to the engine, then SIGKILL after this"),
    ("--health-timeout-s", "health_timeout_s", float, "one /health check; 3 failed in a row: unhealthy"),
    ("--engine-nice", "engine_nice", int, "niceness added to the launched engine (0..19)"),
    (
        "--role-switch",
        "role_switch",
        str,
        "a new role: auto (by routing where the engine serves both, else restart it), restart (always)",
    ),
)
# Real vLLM (--engine vllm): see docs/engine.md.
_VLLM_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--model-path", "model_path", str, "weights directory (vllm-disagg model tiny builds a test one)"),
    ("--served-model-name", "served_model_name", str, "name clients ask for (default: --model)"),
    ("--max-model-len", "max_model_len", int, "context length"),
    ("--engine-device", "engine_device", str, "cpu, cuda or auto"),
    ("--engine-python", "engine_python", str, "interpreter of the venv holding vLLM (default: this one)"),
    (
        "--kv-connector",
        "kv_connector",
        str,
        "KV connector: nixl (NixlConnector), vllm-disagg (the project's, over this agent's prefix pool), "
        "shared-storage, lmcache, mooncake, mooncake-store, offloading, cpu-offload, another vLLM class "
        "name, or empty for none (docs/kv-pool.md, Connectors)",
    ),
    (
        "--kv-connector-config",
        "kv_connector_config",
        str,
        "the connector's settings, a JSON object (vLLM's kv_connector_extra_config), e.g. "
        '\'{"shared_storage_path": "/var/lib/kv"}\'',
    ),
    (
        "--kv-pool-capacity",
        "kv_pool_capacity",
        str,
        "with --kv-connector vllm-disagg: the pool as blocks (4096), bytes (2GiB) or a share (10%%)",
    ),
    ("--kv-pool-port", "kv_pool_port", int, "TCP port other agents fetch pool blocks on (0: engine+3000)"),
    (
        "--kv-pool-node",
        "kv_pool_node",
        str,
        "with --kv-connector vllm-disagg: the id of another agent of this host whose pool the engine "
        "shares (one pool per host; up does this by default), instead of running one here",
    ),
    (
        "--kv-disk-dir",
        "kv_disk_dir",
        str,
        "with --kv-connector vllm-disagg: the pool's disk tier, a directory that outlives the agent "
        "(default: none)",
    ),
    ("--kv-disk-capacity", "kv_disk_capacity", str, "the disk tier's size in bytes (default 10GiB)"),
    (
        "--kv-load-failure-policy",
        "kv_load_failure_policy",
        str,
        "a failed KV pull: fail (error) or recompute (compute the prompt); empty: vLLM's default",
    ),
    (
        "--kv-lease-s",
        "kv_lease_s",
        int,
        "seconds a prefill engine keeps KV no decode engine pulls (vLLM's kv_lease_duration); 0: 30",
    ),
    ("--nixl-side-channel-port", "nixl_side_channel_port", int, "NIXL handshake port (0: engine port+1000)"),
    (
        "--kv-events-port",
        "kv_events_port",
        int,
        "the sim's KV cache events PUB port on loopback (0: engine port+2000); vLLM's is an ipc:// socket",
    ),
    ("--omp-threads-bind", "omp_threads_bind", str, "VLLM_CPU_OMP_THREADS_BIND on CPU (auto, 0, 0-3...)"),
    ("--kv-cache-space-gib", "kv_cache_space_gib", int, "VLLM_CPU_KVCACHE_SPACE on CPU"),
    (
        "--otlp-traces-endpoint",
        "otlp_traces_endpoint",
        str,
        "the launched vLLM's OTLP traces URL",
    ),
    ("--otlp-traces-protocol", "otlp_traces_protocol", str, "its OTLP protocol: http/protobuf or grpc"),
)


def client_curve(cfg: AgentConfig) -> ClientCurve | None:
    """The agent's CurveZMQ keys, None without them (``ConfigError`` for unreadable files)."""
    if not cfg.curve_secret_key_file:
        return None
    return ClientCurve(load_keypair(cfg.curve_secret_key_file), load_public(cfg.orchestrator_key_file))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``agent`` flags; defaults are ``AgentConfig``'s."""
    parser.add_argument(
        "--agent-id", required=True, help="unique id of the instance (said in the agent's Hello)"
    )
    parser.add_argument("--role", required=True, choices=ROLES, help="what the orchestrator may use it for")
    parser.add_argument("--engine", choices=("sim", "vllm"), default=_DEFAULT.engine, help="engine kind")
    for flag, name, kind, help_text in _AGENT_FLAGS:
        parser.add_argument(flag, dest=name, type=kind, default=getattr(_DEFAULT, name), help=help_text)
    vllm = parser.add_argument_group("real vLLM (--engine vllm)")
    for flag, name, kind, help_text in _VLLM_FLAGS:
        vllm.add_argument(flag, dest=name, type=kind, default=getattr(_DEFAULT, name), help=help_text)
    vllm.add_argument(
        "--engine-args", default="", help="more vLLM flags, one shell-quoted string; they override ours"
    )
    sim = parser.add_argument_group("simulated engine (--engine sim)")
    add_sim_timing_arguments(sim, defaults=True)
    add_label_arguments(parser)
    logs.add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """The validated config the flags describe (``ConfigError`` on values that cannot work)."""
    timing = sim_timing_from_args(args)
    return AgentConfig(
        agent_id=args.agent_id,
        role=args.role,
        engine=args.engine,
        sim=timing,
        extra_engine_args=tuple(shlex.split(args.engine_args)),
        labels=labels_from_args(args),
        **{name: getattr(args, name) for _, name, _, _ in (*_AGENT_FLAGS, *_VLLM_FLAGS)},
    )


def run(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM/SIGINT, a shutdown command, or a final refusal."""
    return run_config(config_from_args(args), args.log_level, args.log_format)


def run_config(cfg: AgentConfig, log_level: str = "INFO", log_format: str = "text") -> int:
    """Run the agent ``cfg`` describes (as ``run``; ``connect`` builds its config from the engine)."""
    instance_info(cfg)  # refuses an engine kind that cannot be launched before anything starts
    client_curve(cfg)  # and key files that will not do
    Capacity.parse(cfg.kv_pool_capacity)  # and a pool size that means nothing
    disk_bytes(cfg.kv_disk_capacity)  # or a disk tier's
    if cfg.kv_disk_dir:
        private_dir(Path(cfg.kv_disk_dir))  # and a disk tier's directory another user holds
    if store := extra_config(resolve(cfg.kv_connector), cfg.kv_connector_config).get("shared_storage_path"):
        private_dir(Path(str(store)))  # the prompts' KV, written by the engine: this user's alone
    if cfg.command_log:
        CommandLog.open(cfg.command_log).close()  # and a command log that cannot be written
    logs.configure(log_level, log_format, f"agent {cfg.agent_id}")
    # The engine's workers outlive a crashed engine core; adopt them so they can be reaped.
    become_subreaper()
    try:
        return run_service(lambda stop: serve(cfg, stop))
    finally:
        reap_children()  # the engine group is dead by now: leave no zombie behind


async def serve(cfg: AgentConfig, stop: asyncio.Event, *, clock: Clock | None = None) -> int:
    """The agent: engine supervision, scraping and the session, until one of them ends it."""
    clock = clock or SystemClock()
    # force_close: a restarted engine must not be probed over a dead pooled connection.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        engine = EngineSupervisor(cfg, http, clock)
        scraper = MetricsScraper(
            cfg.engine_url, http, clock, interval_s=cfg.scrape_interval_s, window_s=cfg.metrics_window_s
        )
        attached = AttachedEngine(cfg, http) if cfg.attach_url else None
        info = instance_info(cfg)
        if attached is not None:
            try:
                info = await attached.first_look() or info
            except DiscoveryError as exc:
                print(f"vllm-disagg agent {cfg.agent_id}: {exc}", file=sys.stderr, flush=True)
                return EXIT_REFUSED
        pool = await KvPool.start(cfg) if serves_pool(cfg) else None  # (not for its host's pool's agent)
        if pool is not None:
            info = dataclasses.replace(info, kv_pool_endpoint=pool.transfer.endpoint)
        command_log = CommandLog.open(cfg.command_log) if cfg.command_log else None
        sessions = Sessions(
            Sessions.dealers(cfg.orchestrators, client_curve(cfg)),
            cfg.agent_id,
            info,
            engine_state=lambda: engine.state,
            metrics=pool.metrics(scraper.latest) if pool else scraper.latest,
            kv_plane=pool.transfer if pool else None,
            command_log=command_log,
        )

        forwarder = _wire(cfg, engine, sessions, attached, pool)
        try:
            return await _serve_until_done(cfg, engine, scraper, sessions, forwarder, stop)
        finally:
            if attached is not None:
                await attached.close()
            await engine.stop()
            if pool is not None:
                await pool.close()
            sessions.close(linger_ms=GOODBYE_LINGER_MS)
            if command_log is not None:
                command_log.close()


def _wire(
    cfg: AgentConfig,
    engine: EngineSupervisor,
    sessions: Sessions,
    attached: AttachedEngine | None,
    pool: KvPool | None,
) -> KvEventForwarder | None:
    """Connect the engine, the sessions, an attached engine's look and the KV pool to each other; the
    KV-event forwarder, when the engine publishes events."""

    def on_state(state: EngineState) -> None:
        # An engine that exits or turns unhealthy is reported at once: detection does not wait a beat.
        sessions.report_now()
        if attached is not None:
            attached.engine_state(state)

    engine.on_state = on_state
    # Asked of the engine's config now: a restart for a role change gives it the new role's.
    sessions.set_roles(
        lambda role: role_switch(engine.config, role, attached.facts if attached else None),
        engine.relaunch if attached is None else None,
    )
    if attached is not None:
        # Any session will do: a new instance it says goes to every orchestrator (shared.py).
        attached.session = sessions.members[0]
    endpoint, bind = forwarder_endpoint(cfg), bool(cfg.kv_events_listen)
    if not endpoint and attached is not None and attached.facts is not None:
        endpoint = attached.facts.kv_events_endpoint  # the engine said where it publishes
    if cfg.attach_url and not bind:  # its operator chose where it publishes: say if others can read it
        warn_exposed_kv_events(endpoint, attached.facts if attached is not None else None)
    forwarder = KvEventForwarder(endpoint, sessions.members, bind=bind) if endpoint else None
    if forwarder is not None:
        engine.on_restart = forwarder.engine_restarted
        # Rebuild the KV index of the orchestrator that welcomed us, and of no other.
        sessions.on_welcome(forwarder.session_started)
        if pool is not None:
            pool.report_to(forwarder)
    return forwarder


async def _serve_until_done(
    cfg: AgentConfig,
    engine: EngineSupervisor,
    scraper: MetricsScraper,
    sessions: Sessions,
    forwarder: KvEventForwarder | None,
    stop: asyncio.Event,
) -> int:
    """Run until a signal, the engine or a session ends the agent; say goodbye as the end requires."""
    end = await _until_done(engine, scraper, sessions, forwarder, stop)
    if end is None:  # a signal: tell the orchestrators first so they stop routing to us
        sessions.goodbye("agent stopping")
        await engine.stop()
        return 0
    await engine.stop()
    if end.exit_code != 0:
        print(f"vllm-disagg agent {cfg.agent_id}: refused: {end.reason}", file=sys.stderr, flush=True)
    else:
        sessions.goodbye(end.reason)
    return end.exit_code


async def _until_done(
    engine: EngineSupervisor,
    scraper: MetricsScraper,
    sessions: Sessions,
    forwarder: KvEventForwarder | None,
    stop: asyncio.Event,
) -> SessionEnd | None:
    """Run every loop until a session ends the agent (its ``SessionEnd``) or ``stop`` is set (None)."""
    async with asyncio.TaskGroup() as tg:
        loops = [tg.create_task(engine.run(), name="engine"), tg.create_task(scraper.run(), name="scraper")]
        if forwarder is not None:
            loops.append(tg.create_task(forwarder.run(), name="kv-events"))
        talk = tg.create_task(sessions.run(), name="sessions")
        stopped = tg.create_task(stop.wait(), name="stop")
        await asyncio.wait({talk, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (*loops, talk, stopped):
            task.cancel()
    return talk.result() if talk.done() and not talk.cancelled() else None
