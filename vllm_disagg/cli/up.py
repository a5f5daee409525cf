"""``vllm-disagg up``: a whole local cluster in one command.

Starts the orchestrator, then one agent per instance (each agent launches its engine), prints the
endpoints and each instance as it becomes ready, and on Ctrl-C/SIGTERM stops everything. Every child
runs in its own process group and is told by the kernel to die with its parent, so neither a clean
stop nor a SIGKILL of ``up`` leaves an orphan behind. ``LocalCluster`` is the same machinery for the
benchmarks and end-to-end tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.config import add_sim_timing_arguments, sim_timing_flags
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import (
    ENV_ADMIN_TOKEN,
    admin_headers,
    load_admin_token,
    write_admin_token,
)
from vllm_disagg.orchestrator.flags import add_shared_arguments, shared_argv
from vllm_disagg.protocol.curve import make_keypair
from vllm_disagg.runtime import SELF_ARGV, child_env, die_with_parent, run_service, signal_group

DEFAULT_MODELS = {"vllm": "tiny", "sim": "sim-model"}
# Real vLLM on a small CPU machine: a cold start of two instances side by side took 92 s here.
READY_TIMEOUTS_S = {"vllm": 900.0, "sim": 120.0}


def tiny_model_dir() -> Path:
    """Where ``up`` keeps the tiny offline model it builds when no model is given."""
    root = os.environ.get("VLLM_DISAGG_HOME") or os.path.join(Path.home(), ".cache", "vllm-disagg")
    return Path(root) / "models" / "tiny-seed0"


@dataclass(frozen=True)
class InstancePlan:
    """One instance to start: its agent id, role and engine port."""

    agent_id: str
    role: str
    engine_port: int
    index: int  # position in the cluster; picks the CPU core a vLLM instance is bound to


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of a local cluster and the ports it uses."""

    engine: str = "vllm"
    prefill: int = 1
    decode: int = 1
    model: str = "tiny"  # the served name clients ask for
    model_path: str = ""  # vLLM weights directory
    engine_args: str = ""  # more vLLM flags for every instance
    kv_load_failure_policy: str = ""  # a decode engine's failed KV pull: "fail", "recompute"; "": default
    kv_lease_s: int = 0  # how long P keeps KV that no decode pulls (vLLM's kv_lease_duration); 0: default
    # The engines' KV connector: NIXL (vLLM's), or "vllm-disagg", the project's over each agent's
    # prefix pool (docs/kv-pool.md), with the pool's capacity.
    kv_connector: str = "NixlConnector"
    kv_pool_capacity: str = ""  # "": the agent's default
    engine_startup_timeout_s: float = 900.0
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int = 5555
    engine_base_port: int = 8100
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0  # the gateway's, to an engine
    health_timeout_s: float = 5.0  # each agent's /health check of its engine
    stop_grace_s: float = 10.0
    role_switch: str = "auto"  # how agents' engines take a new role: "auto" or "restart" (--role-switch)
    sim_timing: tuple[tuple[str, str], ...] = ()  # (flag name, value) passed to every sim agent
    extra_orchestrator_args: tuple[str, ...] = field(default=())
    # The admin API's bearer token; a fresh one unless given. The orchestrator reads it from
    # ``admin_token_file`` when set, else from its environment: never from its command line.
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    admin_token_file: str = ""
    # CurveZMQ keys (``with_keys``): the orchestrator admits only these agents. "": no agent auth.
    keys_dir: str = ""

    def orchestrator_env(self) -> dict[str, str]:
        """The orchestrator child's environment: ours, with the admin token unless a file holds it."""
        env = dict(os.environ)
        if not self.admin_token_file:
            env[ENV_ADMIN_TOKEN] = self.admin_token
        return env

    @property
    def base_url(self) -> str:
        """The gateway's base URL."""
        return f"http://{self.host}:{self.port}"

    def plans(self) -> list[InstancePlan]:
        """Agent ids and engine ports (prefill first, then decode)."""
        if self.prefill < 0 or self.decode < 1:
            raise ConfigError(f"need --decode >= 1 and --prefill >= 0, got {self.prefill}P{self.decode}D")
        base = self.engine_base_port
        plans = [InstancePlan(f"prefill-{i}", "prefill", base + i, i) for i in range(self.prefill)]
        plans += [
            InstancePlan(f"decode-{i}", "decode", base + self.prefill + i, self.prefill + i)
            for i in range(self.decode)
        ]
        if plans[-1].engine_port > 65535:
            raise ConfigError(f"--engine-base-port {base} leaves no room for {len(plans)} engines")
        return plans

    def orchestrator_argv(self) -> list[str]:
        """The orchestrator child's command line."""
        return [
            *SELF_ARGV,
            "orchestrator",
            "--host", self.host,
            "--port", str(self.port),
            "--zmq-endpoint", f"tcp://127.0.0.1:{self.zmq_port}",
            "--heartbeat-interval-s", str(self.heartbeat_interval_s),
            "--heartbeat-timeout-s", str(self.heartbeat_timeout_s),
            "--connect-timeout-s", str(self.connect_timeout_s),
            # Simulated engines tokenize as bytes: the orchestrator needs no transformers.
            *(("--no-preload-tokenizer-libs",) if self.engine == "sim" else ()),
            *(("--admin-token-file", self.admin_token_file) if self.admin_token_file else ()),
            *self._orchestrator_keys(),
            *self.extra_orchestrator_args,
        ]  # fmt: skip

    def _orchestrator_keys(self) -> tuple[str, ...]:
        if not self.keys_dir:
            return ()
        keys = Path(self.keys_dir)
        return (
            "--curve-secret-key",
            str(keys / "orchestrator.key_secret"),
            "--agent-keys",
            str(keys / "agents"),
        )

    def agent_argv(self, plan: InstancePlan) -> list[str]:
        """One agent child's command line."""
        argv = [
            *SELF_ARGV,
            "agent",
            "--engine", self.engine,
            "--role", plan.role,
            "--agent-id", plan.agent_id,
            "--orchestrator", f"tcp://127.0.0.1:{self.zmq_port}",
            "--model", self.model,
            "--engine-port", str(plan.engine_port),
            "--health-timeout-s", str(self.health_timeout_s),
        ]  # fmt: skip
        if self.kv_load_failure_policy:
            argv += ["--kv-load-failure-policy", self.kv_load_failure_policy]
        if self.kv_lease_s:
            argv += ["--kv-lease-s", str(self.kv_lease_s)]
        if self.engine == "vllm" and self.kv_connector != ClusterSpec.kv_connector:
            argv += ["--kv-connector", self.kv_connector]
        if self.kv_pool_capacity:
            argv += ["--kv-pool-capacity", self.kv_pool_capacity]
        if self.role_switch != "auto":
            argv += ["--role-switch", self.role_switch]
        if self.keys_dir:
            keys = Path(self.keys_dir)
            argv += [
                "--curve-secret-key", str(keys / "agents" / f"{plan.agent_id}.key_secret"),
                "--orchestrator-key", str(keys / "orchestrator.key"),
            ]  # fmt: skip
        if self.engine == "vllm":
            cores = os.cpu_count() or 1
            argv += [
                "--model-path", self.model_path,
                "--omp-threads-bind", str(plan.index % cores),  # one core each while cores last
                "--startup-timeout-s", str(self.engine_startup_timeout_s),
                # The engines can saturate every core; the agents' heartbeats must still get through.
                "--engine-nice", "10",
            ]  # fmt: skip
            if self.engine_args:
                argv += ["--engine-args", self.engine_args]
        for name, value in self.sim_timing:
            argv += ["--" + name.replace("_", "-"), value]
        return argv


class LocalCluster:
    """Orchestrator and agents as child processes; ``stop()`` leaves nothing running."""

    def __init__(self, spec: ClusterSpec) -> None:
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
        """Poll the admin API until every instance is ready (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        waiting = {p.agent_id for p in self.plans}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while waiting:
                for item in await fetch_instances(session, self.spec.base_url, self.spec.admin_token) or []:
                    agent_id = str(item.get("agent_id", ""))
                    if agent_id in waiting and item.get("state") == "ready":
                        waiting.discard(agent_id)
                        if on_ready:
                            on_ready(item)
                if not waiting:
                    break
                if time.monotonic() > deadline or any(c.returncode is not None for c in self.children):
                    return False
                await asyncio.sleep(0.05)
        return True

    async def report_agent_exits(self) -> None:
        """Say when an agent dies; its instance leaves routing and the rest keep serving."""

        async def watch(agent_id: str, proc: asyncio.subprocess.Process) -> None:
            code = await proc.wait()
            print(f"up: agent {agent_id} exited (code {code}); its instance leaves routing", flush=True)

        await asyncio.gather(*(watch(a, p) for a, p in self.agents.items()))

    async def stop(self) -> None:
        """Agents first, so they say Goodbye and stop their engines; then the orchestrator."""
        await stop_processes(list(self.agents.values()), self.spec.stop_grace_s)
        if self.orchestrator:
            await stop_processes([self.orchestrator], self.spec.stop_grace_s)


async def spawn(
    argv: list[str], env: dict[str, str] | None = None, output: IO[bytes] | None = None
) -> asyncio.subprocess.Process:
    """A child in its own process group that dies with this process; without ``env``, ours minus the
    orchestrator's secrets (``child_env``). ``output``: where its stdout and stderr go (else ours)."""
    return await asyncio.create_subprocess_exec(
        *argv,
        env=child_env() if env is None else env,
        start_new_session=True,
        preexec_fn=die_with_parent,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=output,
        stderr=asyncio.subprocess.STDOUT if output is not None else None,
    )


async def stop_processes(children: list[asyncio.subprocess.Process], grace_s: float) -> None:
    """SIGTERM each child's process group, then SIGKILL whatever is left after ``grace_s``."""
    for proc in children:
        signal_group(proc.pid, signal.SIGTERM)
    waits = [asyncio.ensure_future(p.wait()) for p in children]
    if waits:
        await asyncio.wait(waits, timeout=grace_s)
    for proc in children:
        # Even a child that exited may have left grandchildren in its group.
        signal_group(proc.pid, signal.SIGKILL)
    if waits:
        await asyncio.wait(waits, timeout=grace_s)


async def fetch_instances(
    session: aiohttp.ClientSession, base: str, token: str
) -> list[dict[str, object]] | None:
    """The admin API's instance list, or None while the orchestrator is not answering."""
    try:
        async with session.get(f"{base}/admin/v1/instances", headers=admin_headers(token)) as resp:
            if resp.status != 200:
                return None
            body = jsonutil.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):  # a busy orchestrator may answer late
        return None
    items = body.get("instances") if isinstance(body, dict) else body
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else None


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
        choices=("NixlConnector", "vllm-disagg"),
        default=d.kv_connector,
        help="how KV moves from prefill to decode: NIXL (vLLM's, the default), or vllm-disagg (the "
        "project's connector over each agent's prefix pool: a prefix computed once serves every "
        "instance; docs/kv-pool.md)",
    )
    parser.add_argument(
        "--kv-pool-capacity",
        default=d.kv_pool_capacity,
        help="with --kv-connector vllm-disagg: each agent's pool, as blocks (4096), bytes (2GiB) or a "
        "share of memory (10%%); default 2GiB",
    )
    parser.add_argument("--host", default=d.host, help="gateway host")
    parser.add_argument("--port", type=int, default=d.port, help="gateway port")
    parser.add_argument("--zmq-port", type=int, default=d.zmq_port, help="orchestrator's port for agents")
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
    parser.add_argument(
        "--role-switch",
        choices=("auto", "restart"),
        default=d.role_switch,
        help="how an engine takes a new role: auto (by routing where it serves both, else a restart), "
        "restart (always; e.g. to see restarts with simulated engines)",
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
        kv_pool_capacity=args.kv_pool_capacity,
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
        + shared_argv(args),
        sim_timing=tuple(
            (name, str(getattr(args, name)))
            for _, name, _ in sim_timing_flags()
            if getattr(args, name) is not None
        ),
    )
    spec = _with_admin_token(spec, args.admin_token_file)
    spec.plans()
    if args.scheduler_config:  # refused here, before any process starts
        from vllm_disagg.orchestrator.scheduling.config import load_config_file

        load_config_file(args.scheduler_config)
    if args.planner_config:
        from vllm_disagg.orchestrator.planner.config import load_planner_config_file

        load_planner_config_file(args.planner_config)
    return spec


def with_keys(spec: ClusterSpec, directory: Path) -> ClusterSpec:
    """New CurveZMQ keys in ``directory`` for the orchestrator and each agent (docs/security.md)."""
    make_keypair(directory, "orchestrator")
    for plan in spec.plans():
        make_keypair(directory / "agents", plan.agent_id)
    return replace(spec, keys_dir=str(directory))


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


async def _up(spec: ClusterSpec, ready_timeout_s: float, stop: asyncio.Event) -> int:
    started = time.monotonic()

    def announce(item: dict[str, object]) -> None:
        print(
            f"ready: {item.get('agent_id')} ({item.get('role')}) engine {item.get('url')} "
            f"after {time.monotonic() - started:.1f}s",
            flush=True,
        )

    if not spec.admin_token_file and not os.environ.get(ENV_ADMIN_TOKEN):
        path = admin_token_path(spec.port)
        spec = replace(spec, admin_token=write_admin_token(path), admin_token_file=str(path))
    spec = with_keys(spec, admin_token_path(spec.port).parent / "keys")
    cluster = LocalCluster(spec)
    try:
        await cluster.start()
        base = spec.base_url
        print(f"vllm-disagg up: {spec.prefill}P{spec.decode}D, engine '{spec.engine}', model '{spec.model}'")
        print(f"  gateway: {base}/v1/completions  {base}/v1/chat/completions")
        print(f"  admin:   {base}/admin/v1/instances   metrics: {base}/metrics")
        where = spec.admin_token_file or f"${ENV_ADMIN_TOKEN}"
        print(f"  admin token: {where}  (vllm-disagg status --admin-token-file FILE)")
        print(f"  agents:  tcp://127.0.0.1:{spec.zmq_port}", flush=True)
        assert cluster.orchestrator is not None
        # Without the orchestrator nothing is served: its exit ends ``up``. A dead agent does not.
        exited = asyncio.ensure_future(cluster.orchestrator.wait())
        stopped = asyncio.ensure_future(stop.wait())
        ready = asyncio.ensure_future(cluster.wait_ready(ready_timeout_s, announce))
        watch = asyncio.ensure_future(cluster.report_agent_exits())
        try:
            await asyncio.wait([ready, exited, stopped], return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and not ready.result() and not stop.is_set():
                print("up: not all instances became ready; stopping", file=sys.stderr, flush=True)
                return 1
            if ready.done():
                print(f"vllm-disagg up: all {len(cluster.plans)} instances ready; Ctrl-C stops", flush=True)
                await asyncio.wait([exited, stopped], return_when=asyncio.FIRST_COMPLETED)
            if exited.done() and not stop.is_set():
                print(f"up: the orchestrator exited (code {exited.result()}); stopping", file=sys.stderr)
                return 1
            return 0
        finally:
            for task in (ready, exited, stopped, watch):
                task.cancel()
    finally:
        await cluster.stop()
        print("vllm-disagg up: stopped", flush=True)


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-disagg up`` until SIGINT/SIGTERM."""
    spec = spec_from_args(args)  # refuse bad shapes before starting anything
    try:
        spec = with_model(spec)
    except ModuleNotFoundError as exc:
        print(f"up: {exc.name} is not installed: run `make setup` (scripts/setup_engine.sh)", file=sys.stderr)
        return 1
    ready_timeout_s = args.ready_timeout_s or READY_TIMEOUTS_S[spec.engine]
    return run_service(lambda stop: _up(spec, ready_timeout_s, stop))
