"""``vllm-disagg up``: a whole local cluster in one command.

Starts the orchestrator (or, with ``--replicas N``, N replicas of it on one etcd, which ``up`` may
start too: ``up_replicas.py``, ``local_etcd.py``), then one agent per instance (each agent launches
its engine), prints the endpoints and each instance as it becomes ready, restarts a child that crashes
(``supervise.py``: with backoff, giving up after repeated crashes), and on Ctrl-C/SIGTERM stops
everything. Every child runs in its own process group and is told by the kernel to die with its
parent, so neither a clean stop nor a SIGKILL of ``up`` leaves an orphan behind. The cluster's shape
and each process's command line are ``ClusterSpec``'s (``up_spec.py``). ``LocalCluster`` is the same
start and stop, unsupervised, for the benchmarks and end-to-end tests (the chaos harness plays the
supervisor there itself).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from vllm_disagg import logs
from vllm_disagg.agent.labels import add_label_arguments, parse_instance_label
from vllm_disagg.cli import up_replicas
from vllm_disagg.cli.supervise import (
    ChildSpec,
    EventLog,
    RestartPolicy,
    StartFailed,
    Supervisor,
    end_groups,
    session_leaders_with,
)
from vllm_disagg.cli.supervise import spawn as spawn  # where the benchmarks and chaos find them
from vllm_disagg.cli.supervise import stop_processes as stop_processes
from vllm_disagg.cli.up_replicas import LeaderWatch, replica_set_from_args
from vllm_disagg.cli.up_replicas import fetch_instances as fetch_instances
from vllm_disagg.cli.up_spec import ClusterSpec as ClusterSpec  # where the benchmarks and chaos find it
from vllm_disagg.cli.up_spec import InstancePlan as InstancePlan
from vllm_disagg.config import add_sim_timing_arguments, sim_timing_flags
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import (
    ENV_ADMIN_TOKEN,
    load_admin_token,
    write_admin_token,
)
from vllm_disagg.orchestrator.flags import (
    add_shared_arguments,
    add_tracing_arguments,
    shared_argv,
    tracing_argv,
)
from vllm_disagg.protocol.curve import make_keypair
from vllm_disagg.protocol.kv_connectors import check_kv_settings, connector_names, parse_settings, resolve
from vllm_disagg.runtime import run_service

DEFAULT_MODELS = {"vllm": "tiny", "sim": "sim-model"}
# Real vLLM on a small CPU machine: a cold start of two instances side by side took 92 s here.
READY_TIMEOUTS_S = {"vllm": 900.0, "sim": 120.0}


def tiny_model_dir() -> Path:
    """Where ``up`` keeps the tiny offline model it builds when no model is given."""
    root = os.environ.get("VLLM_DISAGG_HOME") or os.path.join(Path.home(), ".cache", "vllm-disagg")
    return Path(root) / "models" / "tiny-seed0"


class LocalCluster:
    """Orchestrator and agents as child processes; ``stop()`` leaves nothing running."""

    def __init__(self, spec: ClusterSpec) -> None:
        if spec.replicas is not None:
            raise ConfigError("LocalCluster runs one orchestrator; replicas (and their etcd) are up's")
        self.spec = spec
        self.plans = spec.plans()
        self.orchestrator: asyncio.subprocess.Process | None = None
        self.agents: dict[str, asyncio.subprocess.Process] = {}

    @property
    def children(self) -> list[asyncio.subprocess.Process]:
        """Every child process, orchestrator first."""
        return ([self.orchestrator] if self.orchestrator else []) + list(self.agents.values())

    async def start(self) -> None:
        """Spawn the orchestrator, then every agent (agents retry until the orchestrator listens)."""
        self.orchestrator = await spawn(self.spec.orchestrator_argv(), env=self.spec.orchestrator_env())
        for plan in self.plans:
            self.agents[plan.agent_id] = await spawn(self.spec.agent_argv(plan))

    async def wait_ready(
        self, timeout_s: float, on_ready: Callable[[dict[str, object]], None] | None = None
    ) -> bool:
        """Poll the admin API until every instance is ready (True) or ``timeout_s`` passes or a child
        exits (False)."""
        return await wait_ready(
            self.spec,
            timeout_s,
            on_ready,
            failed=lambda: any(c.returncode is not None for c in self.children),
        )

    async def stop(self) -> None:
        """Agents first, so they say Goodbye and stop their engines; then the orchestrator."""
        await stop_processes(list(self.agents.values()), self.spec.stop_grace_s)
        if self.orchestrator:
            await stop_processes([self.orchestrator], self.spec.stop_grace_s)


async def wait_ready(
    spec: ClusterSpec,
    timeout_s: float,
    on_ready: Callable[[dict[str, object]], None] | None,
    failed: Callable[[], bool],
) -> bool:
    """Poll the admin API until every instance is ready (True), or ``timeout_s`` passes or ``failed()``
    (False); with replicas, ready on every replica. An orchestrator not answering is "not yet"."""
    ids = [p.agent_id for p in spec.plans()]
    return await up_replicas.wait_ready(spec.base_urls(), spec.admin_token, ids, timeout_s, on_ready, failed)


def supervised_children(spec: ClusterSpec) -> list[ChildSpec]:
    """What ``up`` supervises: the orchestrator (essential: without it nothing is served), or its
    replicas after the etcd ``up`` starts for them, then one agent per instance, each restarted with
    its own command line (same ports, same agent id)."""
    children = _control_plane(spec)
    for plan in spec.plans():
        # A SIGKILLed agent's engine got SIGTERM from the kernel (PR_SET_PDEATHSIG) but may still be
        # stopping, on the port the restarted agent's engine needs, and answering /health there.
        cleanup = functools.partial(_end_engine, plan.engine_port, spec.stop_grace_s)
        children.append(
            ChildSpec(
                f"agent {plan.agent_id}",
                tuple(spec.agent_argv(plan)),
                stage=1,
                consequence="its instance leaves routing",
                cleanup=cleanup,
            )
        )
    return children


def _control_plane(spec: ClusterSpec) -> list[ChildSpec]:
    """The orchestrator; or the embedded etcd and each replica, the cluster ending with the last."""
    env = spec.orchestrator_env()
    if spec.replicas:
        return spec.replicas.children(spec.orchestrator_argv, env)
    only = ChildSpec(
        "orchestrator",
        tuple(spec.orchestrator_argv()),
        env=env,
        essential=True,
        consequence="stopping the cluster",
    )
    return [only]


async def _end_engine(port: int, grace_s: float) -> None:
    """End the engine a dead agent left on ``port``: it leads its own process group."""
    await end_groups(session_leaders_with(("--port", str(port))), grace_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg up``."""
    d = ClusterSpec()
    parser.add_argument(
        "--engine", choices=("vllm", "sim"), default=d.engine, help="engine behind the agents"
    )
    parser.add_argument("--prefill", type=int, default=d.prefill, help="number of prefill instances")
    parser.add_argument("--decode", type=int, default=d.decode, help="number of decode instances")
    parser.add_argument(
        "--model",
        default="",
        help="vLLM: the weights, as for `vllm serve` (default: the tiny model, built offline); "
        "sim: the served name",
    )
    parser.add_argument(
        "--served-model-name", default="", help="the name clients ask for (default: tiny, or --model)"
    )
    parser.add_argument("--engine-args", default="", help="more vLLM flags for every instance, one string")
    add_label_arguments(parser)  # --label KEY=VALUE: every instance's
    parser.add_argument(
        "--instance-label",
        dest="instance_labels",
        action="append",
        type=parse_instance_label,
        default=[],
        metavar="AGENT_ID:KEY=VALUE",
        help="a topology label of one instance (prefill-0, decode-1, ...), over --label; repeatable",
    )
    parser.add_argument(
        "--kv-load-failure-policy",
        choices=("fail", "recompute"),
        default=None,
        help="what a decode engine does when pulling KV fails: answer an error, or compute the prompt "
        "itself (silently slower; the orchestrator's KV audit finds it). Default: vLLM's (fail)",
    )
    parser.add_argument(
        "--kv-lease-s",
        type=int,
        default=d.kv_lease_s,
        help="seconds a prefill engine keeps a prompt's KV that no decode engine pulls (vLLM's "
        "kv_lease_duration); 0: the engine's default (30)",
    )
    parser.add_argument(
        "--kv-connector",
        choices=connector_names(),
        default=d.kv_connector,
        help="how KV moves from prefill to decode: NIXL (vLLM's, the default), vllm-disagg (the "
        "project's connector over each agent's prefix pool: a prefix computed once serves every "
        "instance), shared-storage (vLLM's example connector: a directory every engine reads), or "
        "another of vLLM's (docs/kv-pool.md, Connectors)",
    )
    parser.add_argument(
        "--kv-connector-config",
        default=d.kv_connector_config,
        help="the connector's settings for every engine, a JSON object (vLLM's "
        "kv_connector_extra_config); shared-storage's directory defaults to one of this cluster's",
    )
    parser.add_argument(
        "--kv-pool-capacity",
        default=d.kv_pool_capacity,
        help="with --kv-connector vllm-disagg: each agent's pool, as blocks (4096), bytes (2GiB) or a "
        "share of memory (10%%); default 2GiB",
    )
    parser.add_argument(
        "--kv-pool-scope",
        choices=("node", "agent"),
        default=d.kv_pool_scope,
        help="with --kv-connector vllm-disagg: node (default) runs one pool on this host that every "
        "engine shares, the first agent's, so blocks move between engines through shared memory; "
        "agent runs one per agent, blocks moved between them over loopback TCP",
    )
    parser.add_argument(
        "--kv-disk-dir",
        default=d.kv_disk_dir,
        help="with --kv-connector vllm-disagg: the pools' disk tier, a directory (one per agent under "
        "it) that blocks evicted from memory go to and that outlives the cluster; default: none",
    )
    parser.add_argument(
        "--kv-disk-capacity",
        default=d.kv_disk_capacity,
        help="each agent's disk tier, in bytes (50GiB); default 10GiB",
    )
    parser.add_argument("--host", default=d.host, help="gateway host")
    parser.add_argument("--port", type=int, default=d.port, help="gateway port (replica i: + i)")
    parser.add_argument(
        "--zmq-port", type=int, default=d.zmq_port, help="orchestrator's port for agents (replica i: + i)"
    )
    parser.add_argument("--engine-base-port", type=int, default=d.engine_base_port, help="first engine port")
    parser.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=d.heartbeat_timeout_s)
    parser.add_argument(
        "--health-timeout-s",
        type=float,
        default=d.health_timeout_s,
        help="each agent's /health check of its engine (3 failed in a row: unhealthy)",
    )
    parser.add_argument(
        "--connect-timeout-s", type=float, default=d.connect_timeout_s, help="gateway to engine; then 504"
    )
    parser.add_argument(
        "--scheduler-config", default="", metavar="FILE", help="scheduler YAML for the orchestrator"
    )
    parser.add_argument(
        "--planner-config",
        default="",
        metavar="FILE",
        help="planner YAML for the orchestrator (docs/planner.md)",
    )
    parser.add_argument(
        "--admin-token-file",
        default="",
        metavar="FILE",
        help=f"the admin API's token (default: ${ENV_ADMIN_TOKEN}, else a new one written under "
        "$VLLM_DISAGG_HOME and printed)",
    )
    parser.add_argument("--ready-timeout-s", type=float, default=None, help="give up if not ready by then")
    parser.add_argument("--stop-grace-s", type=float, default=d.stop_grace_s, help="SIGTERM, then SIGKILL")
    logs.add_arguments(parser)  # the orchestrator's and the agents' (up itself prints)
    add_tracing_arguments(
        parser.add_argument_group("OpenTelemetry traces: the orchestrator's, and the vLLM engines' too")
    )
    parser.add_argument(
        "--role-switch",
        choices=("auto", "restart"),
        default=d.role_switch,
        help="how an engine takes a new role: auto (by routing where it serves both, else a restart), "
        "restart (always; e.g. to see restarts with simulated engines)",
    )
    p = RestartPolicy()
    supervision = parser.add_argument_group("supervision: crashed children are restarted with backoff")
    supervision.add_argument(
        "--max-crashes",
        type=int,
        default=p.max_crashes,
        help="give up on a child (the orchestrator: stop the cluster; an agent: its instance leaves "
        "routing) at its N-th crash within --crash-window-s; 1: never restart",
    )
    supervision.add_argument(
        "--crash-window-s", type=float, default=p.window_s, help="the window --max-crashes counts in"
    )
    supervision.add_argument(
        "--restart-backoff-s",
        type=float,
        default=p.backoff_s,
        help=f"the first restart's delay, doubled for a child that keeps crashing, to at least "
        f"{p.backoff_max_s:g} s",
    )
    up_replicas.add_arguments(
        parser.add_argument_group("replicas: a replicated control plane on etcd (docs/operations.md)")
    )
    add_shared_arguments(
        parser.add_argument_group("the orchestrator's recovery and tuning (as vllm-disagg orchestrator's)"),
        forwarded=True,
    )
    add_sim_timing_arguments(
        parser.add_argument_group("simulated engine timing (--engine sim)"), defaults=False
    )


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """The cluster the flags describe (validated; the model path is resolved later, by ``run``)."""
    spec = ClusterSpec(
        engine=args.engine,
        prefill=args.prefill,
        decode=args.decode,
        model=args.served_model_name or args.model or DEFAULT_MODELS[args.engine],
        model_path=args.model if args.engine == "vllm" else "",
        engine_args=args.engine_args,
        kv_load_failure_policy=args.kv_load_failure_policy or "",
        kv_lease_s=args.kv_lease_s,
        kv_connector=args.kv_connector,
        kv_connector_config=store_config(args.kv_connector, args.kv_connector_config, args.port),
        kv_pool_capacity=args.kv_pool_capacity,
        kv_disk_dir=args.kv_disk_dir,
        kv_pool_scope=args.kv_pool_scope,
        kv_disk_capacity=args.kv_disk_capacity,
        host=args.host,
        port=args.port,
        zmq_port=args.zmq_port,
        engine_base_port=args.engine_base_port,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        health_timeout_s=args.health_timeout_s,
        stop_grace_s=args.stop_grace_s,
        role_switch=args.role_switch,
        extra_orchestrator_args=(
            ("--scheduler-config", os.path.abspath(args.scheduler_config)) if args.scheduler_config else ()
        )
        + (("--planner-config", os.path.abspath(args.planner_config)) if args.planner_config else ())
        + shared_argv(args)
        + tracing_argv(args),
        sim_timing=tuple(
            (name, str(getattr(args, name)))
            for _, name, _ in sim_timing_flags()
            if getattr(args, name) is not None
        ),
        replicas=replica_set_from_args(args, admin_token_path(args.port).parent),
        labels=tuple(args.labels),
        instance_labels=tuple(args.instance_labels),
        log_level=args.log_level,
        log_format=args.log_format,
        otlp_traces_endpoint=args.otlp_traces_endpoint or "",
        otlp_traces_protocol=args.otlp_protocol or "http/protobuf",
    )
    spec = _with_admin_token(spec, args.admin_token_file)
    for plan in spec.plans():  # what every agent would refuse, refused before any starts
        if spec.engine == "vllm":
            check_kv_settings(plan.role, spec.kv_connector, spec.kv_connector_config, "", 0)
    if args.scheduler_config:  # refused here, before any process starts
        from vllm_disagg.orchestrator.scheduling.config import load_config_file

        load_config_file(args.scheduler_config)
    if args.planner_config:
        from vllm_disagg.orchestrator.planner.config import load_planner_config_file

        load_planner_config_file(args.planner_config)
    return spec


def policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    """The restart policy the flags describe (``ConfigError`` for values that cannot work)."""
    backoff_s = args.restart_backoff_s
    return RestartPolicy(
        max_crashes=args.max_crashes,
        window_s=args.crash_window_s,
        backoff_s=backoff_s,
        backoff_max_s=max(RestartPolicy().backoff_max_s, backoff_s),
    )


def with_keys(spec: ClusterSpec, directory: Path) -> ClusterSpec:
    """New CurveZMQ keys in ``directory`` for the orchestrator and each agent (docs/security.md).

    The agents' directory is emptied first: the orchestrator admits every key listed there, so a key
    of an earlier, larger run (decode-3 of a 2P4D run, now 1P1D) would stay admitted.
    """
    make_keypair(directory, "orchestrator")
    agents = directory / "agents"
    shutil.rmtree(agents, ignore_errors=True)
    for plan in spec.plans():
        make_keypair(agents, plan.agent_id)
    return replace(spec, keys_dir=str(directory))


def store_config(connector: str, settings: str, port: int) -> str:
    """``--kv-connector-config``, with a store connector's directory where it needs one and none is
    given: one of this cluster's, private to this user (the engines check it as they start)."""
    spec = resolve(connector)
    if "shared_storage_path" not in spec.required or "shared_storage_path" in parse_settings(settings):
        return settings
    store = admin_token_path(port).parent / "kv-store"
    return json.dumps({**parse_settings(settings), "shared_storage_path": str(store)})


def admin_token_path(port: int) -> Path:
    """Where ``up`` writes the admin token it makes for the cluster on ``port``."""
    return tiny_model_dir().parents[1] / f"up-{port}" / "admin-token"


def _with_admin_token(spec: ClusterSpec, token_file: str) -> ClusterSpec:
    """The admin token: from ``token_file``, else ``$VLLM_DISAGG_ADMIN_TOKEN``, else a new one that
    ``_up`` writes to ``admin_token_path`` (``ConfigError`` for a file that will not do)."""
    if token_file:
        path = os.path.abspath(token_file)
        return replace(spec, admin_token=load_admin_token(path), admin_token_file=path)
    token = load_admin_token()
    return replace(spec, admin_token=token) if token else spec


def with_model(spec: ClusterSpec) -> ClusterSpec:
    """For real vLLM without ``--model``: build (or reuse) the tiny offline model and use it."""
    if spec.engine != "vllm" or spec.model_path:
        return spec
    from vllm_disagg.model.tiny import build_tiny_model  # torch: only when a model must be built

    started = time.monotonic()
    built = build_tiny_model(tiny_model_dir())
    verb = "built" if built.built else "using"
    print(
        f"vllm-disagg up: {verb} the tiny offline model at {built.path} ({time.monotonic() - started:.1f}s)"
    )
    return replace(spec, model_path=str(built.path))


def _prepared(spec: ClusterSpec) -> ClusterSpec:
    """Under ``up``'s state directory: the admin token written (unless given), the agents' keys made,
    the embedded etcd's data directory emptied."""
    if not spec.admin_token_file and not os.environ.get(ENV_ADMIN_TOKEN):
        path = admin_token_path(spec.port)
        spec = replace(spec, admin_token=write_admin_token(path), admin_token_file=str(path))
    if spec.replicas and spec.replicas.embedded:
        spec.replicas.embedded.reset()
    return with_keys(spec, admin_token_path(spec.port).parent / "keys")


def _say_endpoints(spec: ClusterSpec) -> None:
    shape = f"vllm-disagg up: {spec.prefill}P{spec.decode}D, engine '{spec.engine}', model '{spec.model}'"
    token = f"  admin token: {spec.admin_token_file or '$' + ENV_ADMIN_TOKEN}"
    token += "  (vllm-disagg status --admin-token-file FILE)"
    if spec.replicas is None:
        base = spec.base_url
        print(shape)
        print(f"  gateway: {base}/v1/completions  {base}/v1/chat/completions")
        print(f"  admin:   {base}/admin/v1/instances   metrics: {base}/metrics")
        print(token)
        print(f"  agents:  tcp://127.0.0.1:{spec.zmq_port}", flush=True)
        return
    print(f"{shape}, {spec.replicas.count} orchestrator replicas (cluster '{spec.replicas.cluster}')")
    print("\n".join(spec.replicas.lines(spec.base_urls(), spec.zmq_endpoints())))
    print(token, flush=True)


def _say(line: str) -> None:
    print(f"vllm-disagg up: {line}", flush=True)


async def _up(spec: ClusterSpec, ready_timeout_s: float, stop: asyncio.Event, policy: RestartPolicy) -> int:
    spec = _prepared(spec)
    events = EventLog(spec.base_urls(), spec.admin_token)  # any replica: it hands notes to the leader
    supervisor = Supervisor(
        supervised_children(spec), policy, note=events.note, stop_grace_s=spec.stop_grace_s
    )
    leaders: asyncio.Future[None] | None = None
    try:
        try:
            await supervisor.start()
        except StartFailed as exc:
            print(f"up: {exc}; stopping", file=sys.stderr, flush=True)
            return 1
        _say_endpoints(spec)
        if spec.replicas:
            leaders = asyncio.ensure_future(LeaderWatch(spec.base_urls(), spec.admin_token, _say).run())
        return await _serve(spec, supervisor, ready_timeout_s, stop)
    finally:
        if leaders is not None:
            leaders.cancel()
            await asyncio.gather(leaders, return_exceptions=True)
        await supervisor.stop()
        await events.close()
        print("vllm-disagg up: stopped", flush=True)


async def _serve(
    spec: ClusterSpec, supervisor: Supervisor, ready_timeout_s: float, stop: asyncio.Event
) -> int:
    """Say each instance as it becomes ready, then serve until ``stop`` or the supervisor's end; the
    exit code. Crashed children come back (supervise.py); one given up on during start-up fails it, and
    giving up on the orchestrator (on the last replica), or its leaving, ends ``up``. A dead agent
    after start-up does not."""
    started = time.monotonic()

    def announce(item: dict[str, object]) -> None:
        print(
            f"ready: {item.get('agent_id')} ({item.get('role')}) engine {item.get('url')} "
            f"after {time.monotonic() - started:.1f}s",
            flush=True,
        )

    ended = asyncio.ensure_future(supervisor.ended.wait())
    stopped = asyncio.ensure_future(stop.wait())
    ready = asyncio.ensure_future(
        wait_ready(spec, ready_timeout_s, announce, failed=lambda: bool(supervisor.left))
    )
    try:
        await asyncio.wait([ready, ended, stopped], return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and not ready.result() and not stop.is_set():
            print("up: not all instances became ready; stopping", file=sys.stderr, flush=True)
            return 1
        if ready.done():
            _say(f"all {len(spec.plans())} instances ready; Ctrl-C stops")
            await asyncio.wait([ended, stopped], return_when=asyncio.FIRST_COMPLETED)
        if supervisor.ended.is_set() and not stop.is_set():
            print("up: stopping", file=sys.stderr, flush=True)  # the supervisor said why
            return supervisor.end_code
        return 0
    finally:
        for task in (ready, ended, stopped):
            task.cancel()


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-disagg up`` until SIGINT/SIGTERM."""
    spec = spec_from_args(args)  # refuse bad shapes before starting anything
    try:
        spec = with_model(spec)
    except ModuleNotFoundError as exc:
        print(f"up: {exc.name} is not installed: run `make setup` (scripts/setup_engine.sh)", file=sys.stderr)
        return 1
    policy = policy_from_args(args)
    ready_timeout_s = args.ready_timeout_s or READY_TIMEOUTS_S[spec.engine]
    return run_service(lambda stop: _up(spec, ready_timeout_s, stop, policy))
