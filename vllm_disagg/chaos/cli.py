"""``vllm-disagg chaos``: a local simulated cluster under streaming load, a random engine or agent (with
``--replicas N``: or orchestrator replica, on a local etcd) SIGKILLed every interval and brought back,
every response checked byte for byte. See docs/chaos.md.

Everything runs on loopback: the cluster's processes, the load, the kills. Exit code 0 when no request
failed (with replicas: none on a live replica) and none was garbled, 1 otherwise (or when nothing could
be checked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.chaos.check import Checker
from vllm_disagg.chaos.etcd import LocalEtcd, etcd_binary
from vllm_disagg.chaos.killer import FAULT_KINDS, FaultInjector, FaultKind
from vllm_disagg.chaos.load import LoadConfig, LoadGenerator, RequestPlanner, Tally
from vllm_disagg.chaos.replicas import ReplicaSet, low_ports
from vllm_disagg.chaos.report import ChaosReport, counter_growth, recovery_counters
from vllm_disagg.cli.up import ClusterSpec, LocalCluster, stop_processes, with_keys
from vllm_disagg.config import SimTiming, add_sim_timing_arguments, sim_timing_flags, sim_timing_from_args
from vllm_disagg.errors import ConfigError
from vllm_disagg.runtime import die_with_parent, run_service

MODEL = "sim-model"
# Streams of 32-64 tokens take about 0.5-1.5 s in the engine (more while the batch is full), and
# 4P4D under 200 streams fits a 2-core machine: 16 sequences per batch, 15 ms + 0.5 ms each a step.
CHAOS_TIMING = SimTiming(
    prefill_s_per_token=0.0001,
    decode_step_s=0.015,
    decode_step_s_per_seq=0.0005,
    kv_transfer_s_per_token=0.00002,
    max_num_seqs=16,
)
KV_EVENTS_PORT_OFFSET = 2000  # a simulated engine publishes KV events on its port + 2000 (as vLLM)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg chaos``."""
    parser.add_argument("--prefill", type=int, default=4, help="prefill instances")
    parser.add_argument("--decode", type=int, default=4, help="decode instances")
    parser.add_argument("--concurrency", type=int, default=200, help="load workers (requests in flight)")
    parser.add_argument(
        "--duration", type=float, default=120.0, help="seconds of load (then in-flight ones finish)"
    )
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="stop sending after this many")
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds between faults; 0: none")
    parser.add_argument(
        "--kinds",
        default=None,
        help="what may be killed, comma-separated: engine, agent, replica (default: engine,agent; "
        "with --replicas: engine,agent,replica)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="orchestrator replicas on a local etcd (0: one orchestrator, no etcd; else at least 2)",
    )
    parser.add_argument(
        "--lease-ttl-s", type=int, default=2, help="with --replicas: the leader's etcd lease (2..60 s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the requests and the faults")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    load = parser.add_argument_group("load")
    load.add_argument("--min-tokens", type=int, default=32, help="fewest output tokens per request")
    load.add_argument("--max-tokens", type=int, default=64, help="most output tokens per request")
    load.add_argument("--stream-fraction", type=float, default=0.8, help="share of streaming requests")
    load.add_argument("--chat-fraction", type=float, default=0.5, help="share of chat requests")
    load.add_argument("--request-timeout-s", type=float, default=60.0, help="one whole request; then failed")
    load.add_argument("--examples", type=int, default=5, help="failed and garbled responses kept, each")
    load.add_argument("--progress-s", type=float, default=5.0, help="a progress line on stderr this often")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--heartbeat-interval-s", type=float, default=0.25)
    cluster.add_argument(
        "--heartbeat-timeout-s", type=float, default=1.0, help="the orchestrator's failure detection"
    )
    cluster.add_argument(
        "--recovery-timeout-s", type=float, default=30.0, help="a victim must be back by then"
    )
    cluster.add_argument("--ready-timeout-s", type=float, default=120.0, help="cluster start-up limit")
    cluster.add_argument("--port", type=int, default=0, help="gateway port (0: a free one)")
    cluster.add_argument("--zmq-port", type=int, default=0, help="orchestrator's agent port (0: a free one)")
    cluster.add_argument(
        "--engine-base-port", type=int, default=0, help="first engine port (0: a free range)"
    )
    cluster.add_argument("--log-file", default="", help="the cluster's output (default: a new file in /tmp)")
    timing = parser.add_argument_group("simulated engine timing")
    add_sim_timing_arguments(timing, defaults=False)
    parser.set_defaults(**{name: getattr(CHAOS_TIMING, name) for _, name, _ in sim_timing_flags()})


def _kinds(args: argparse.Namespace) -> tuple[FaultKind, ...]:
    text = args.kinds or ("engine,agent,replica" if args.replicas else "engine,agent")
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    found = [k for k in FAULT_KINDS if k in kinds]
    if not found or len(found) != len(kinds):
        raise ConfigError(
            f"--kinds must be a comma-separated subset of {','.join(FAULT_KINDS)}, got {text!r}"
        )
    if "replica" in found and not args.replicas:
        raise ConfigError("--kinds replica needs --replicas N")
    return tuple(found)


def _validate(args: argparse.Namespace) -> None:
    if args.concurrency < 1 or args.max_requests < 1:
        raise ConfigError("--concurrency and --max-requests must be at least 1")
    if not args.duration > 0:
        raise ConfigError(f"--duration must be > 0, got {args.duration}")
    if args.kill_every < 0:
        raise ConfigError(f"--kill-every must be >= 0, got {args.kill_every}")
    if not 1 <= args.min_tokens <= args.max_tokens:
        raise ConfigError(f"need 1 <= --min-tokens <= --max-tokens, got {args.min_tokens}..{args.max_tokens}")
    for name in ("stream_fraction", "chat_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be within 0..1")
    _kinds(args)
    if args.replicas == 1 or args.replicas < 0:
        raise ConfigError(
            f"--replicas must be 0 (one orchestrator, no etcd) or at least 2, got {args.replicas}"
        )
    if args.replicas:
        if not 2 <= args.lease_ttl_s <= 60:
            raise ConfigError(f"--lease-ttl-s must be within 2..60, got {args.lease_ttl_s}")
        etcd_binary()  # refuses a machine without etcd before anything starts
    sim_timing_from_args(args)  # refuses a timing the engines would refuse
    ClusterSpec(engine="sim", prefill=args.prefill, decode=args.decode).plans()


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pick_ports(engines: int, port: int, zmq_port: int, base: int) -> tuple[int, int, int]:
    """Gateway, agent and first engine ports: the given ones, or free ones (engine range and KV-event
    ports included) below the ephemeral range, so that no client connection takes them meanwhile."""
    port = port or _ephemeral()
    zmq_port = zmq_port or next(p for p in iter(_ephemeral, None) if p != port)
    if base:
        return port, zmq_port, base
    rng = random.SystemRandom()
    taken = {port, zmq_port}
    for _ in range(500):
        base = rng.randrange(20000, 30000 - engines)
        wanted = [base + i + off for i in range(engines) for off in (0, KV_EVENTS_PORT_OFFSET)]
        if not taken & set(wanted) and all(_free(p) for p in wanted):
            return port, zmq_port, base
    raise ConfigError(f"found no {engines} free consecutive engine ports")


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """The simulated cluster the flags describe, on free loopback ports."""
    n = args.prefill + args.decode
    port, zmq_port, base = pick_ports(n, args.port, args.zmq_port, args.engine_base_port)
    spec = ClusterSpec(
        engine="sim",
        prefill=args.prefill,
        decode=args.decode,
        model=MODEL,
        host="127.0.0.1",
        port=port,
        zmq_port=zmq_port,
        engine_base_port=base,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        stop_grace_s=5.0,
        sim_timing=tuple((name, str(getattr(args, name))) for _, name, _ in sim_timing_flags()),
    )
    spec.plans()
    return spec


class _Logged:
    """Starts the cluster's children with their output going to one log file."""

    def __init__(self, log: IO[bytes]) -> None:
        self._log = log

    async def __call__(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _progress(t: float, tally: Tally, load: LoadGenerator, injector: FaultInjector) -> None:
    killed = f" (on killed replicas {tally.failed_on_killed_replicas})" if load.replicated else ""
    print(
        f"chaos: t={t:6.1f}s sent={tally.sent} completed={tally.completed} failed={tally.failed}{killed} "
        f"garbled={tally.garbled} in_flight={load.in_flight} faults={len(injector.faults)}",
        file=sys.stderr,
        flush=True,
    )


async def _every(period_s: float, tick: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(period_s)
        tick()


async def _ready(
    cluster: LocalCluster, replicas: ReplicaSet | None, timeout_s: float, stop: asyncio.Event
) -> bool:
    if replicas is None:
        ready = asyncio.ensure_future(cluster.wait_ready(timeout_s))
    else:
        agents = [p.agent_id for p in cluster.plans]

        def gone() -> bool:
            return replicas.exited() or any(a.returncode is not None for a in cluster.agents.values())

        ready = asyncio.ensure_future(replicas.wait_ready(agents, timeout_s, gone))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        return ready.done() and ready.result()
    finally:
        ready.cancel()
        stopped.cancel()


def _replicated(args: argparse.Namespace, spec: ClusterSpec, log: IO[bytes]) -> tuple[LocalEtcd, ReplicaSet]:
    """A local etcd and ``--replicas`` replicas on it, on ports the cluster does not use."""
    taken = {spec.port, spec.zmq_port}
    taken |= {p.engine_port + off for p in spec.plans() for off in (0, KV_EVENTS_PORT_OFFSET)}
    client, peer = low_ports(2, taken)
    etcd = LocalEtcd(client, peer, log)
    name = f"chaos-{uuid.uuid4().hex[:8]}"
    return etcd, ReplicaSet(spec, args.replicas, etcd.url, args.lease_ttl_s, taken, name)


async def chaos(
    args: argparse.Namespace, stop: asyncio.Event, log: IO[bytes], log_path: str
) -> ChaosReport | None:
    """Start the cluster, run load and faults, stop the cluster; the report (None if it never got ready)."""
    keys = tempfile.mkdtemp(prefix="vllm-disagg-chaos-keys-")  # agents authenticate, as with ``up``
    spec = with_keys(cluster_spec(args), Path(keys))
    etcd, replicas = _replicated(args, spec, log) if args.replicas else (None, None)
    if replicas is not None:  # the gateway the report names: the first replica's
        spec = replace(spec, port=replicas.plans[0].port, zmq_port=replicas.plans[0].zmq_port)
    cluster = LocalCluster(spec)
    spawn = _Logged(log)
    started_at = time.monotonic()
    try:
        up = etcd is None or await etcd.start(args.ready_timeout_s)
        if up:
            await _spawn_cluster(cluster, spec, spawn, replicas)
        if not up or not await _ready(cluster, replicas, args.ready_timeout_s, stop):
            if not stop.is_set():
                print(f"chaos: the cluster did not become ready (log: {log_path})", file=sys.stderr)
            return None
        _announce(args, spec, time.monotonic() - started_at, log_path)
        tally = Tally(max_examples=args.examples)
        load = _load(args, spec, tally, replicas)
        injector = FaultInjector(
            cluster,
            spawn,
            every_s=args.kill_every,
            seed=args.seed,
            kinds=_kinds(args),
            recovery_timeout_s=args.recovery_timeout_s,
            replicas=replicas,
        )
        urls = replicas.urls if replicas is not None else [spec.base_url]
        duration, deltas = await _load_under_faults(args, urls, load, injector, stop)
    finally:
        await cluster.stop()
        if replicas is not None:
            await replicas.stop(stop_processes)
        if etcd is not None:
            await etcd.stop()
        shutil.rmtree(keys, ignore_errors=True)
    return _report(args, spec, cluster, tally, injector, duration, deltas, log_path, replicas)


def _report(
    args: argparse.Namespace,
    spec: ClusterSpec,
    cluster: LocalCluster,
    tally: Tally,
    injector: FaultInjector,
    duration: float,
    deltas: dict[str, int],
    log_path: str,
    replicas: ReplicaSet | None,
) -> ChaosReport:
    return ChaosReport(
        sent=tally.sent,
        completed=tally.completed,
        failed=tally.failed,
        garbled=tally.garbled,
        duration_s=duration,
        faults=[f.to_json() for f in injector.faults],
        examples=tally.examples,
        abandoned=tally.abandoned,
        skipped_faults=injector.skipped,
        config={
            **_config(args),
            "gateway": spec.base_url,
            "engine_ports": [p.engine_port for p in cluster.plans],
            **({"gateways": replicas.urls, "etcd": replicas.etcd_url} if replicas is not None else {}),
        },
        log_file=log_path,
        replicas=args.replicas,
        failed_on_killed_replicas=tally.failed_on_killed_replicas,
        per_replica={
            replicas.plans[i].replica_id: counts for i, counts in sorted(tally.per_replica.items()) if i >= 0
        }
        if replicas is not None
        else {},
        **deltas,
    )


async def _spawn_cluster(
    cluster: LocalCluster, spec: ClusterSpec, spawn: _Logged, replicas: ReplicaSet | None
) -> None:
    """Start the orchestrator (or every replica), then every agent (each starts its engine)."""
    if replicas is None:
        cluster.orchestrator = await spawn(spec.orchestrator_argv(), env=spec.orchestrator_env())
    else:
        await replicas.start(spawn)
    for plan in cluster.plans:
        argv = spec.agent_argv(plan) if replicas is None else replicas.agent_argv(plan)
        cluster.agents[plan.agent_id] = await spawn(argv)


def _announce(args: argparse.Namespace, spec: ClusterSpec, ready_s: float, log_path: str) -> None:
    """Say on stderr that the cluster is ready and what the run will do to it."""
    replicas = f" x {args.replicas} replicas" if args.replicas else ""
    print(
        f"chaos: {spec.prefill}P{spec.decode}D{replicas} ready in {ready_s:.1f} s at "
        f"{spec.base_url}; {args.duration:g} s of load, concurrency {args.concurrency}, "
        + (f"a fault every {args.kill_every:g} s" if args.kill_every else "no faults")
        + f" (log: {log_path})",
        file=sys.stderr,
        flush=True,
    )


def _load(
    args: argparse.Namespace, spec: ClusterSpec, tally: Tally, replicas: ReplicaSet | None
) -> LoadGenerator:
    """The load the flags describe, its responses checked and counted in ``tally``; with replicas,
    spread over them in the rotation their killer keeps."""
    planner = RequestPlanner(
        random.Random(f"{args.seed}/load"),
        uuid.uuid4().hex[:8],
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        stream_fraction=args.stream_fraction,
        chat_fraction=args.chat_fraction,
    )
    load_cfg = LoadConfig(
        spec.base_url,
        MODEL,
        args.concurrency,
        args.duration,
        args.max_requests,
        args.request_timeout_s,
        replica_urls=tuple(replicas.urls) if replicas is not None else (),
    )
    targets = replicas.targets if replicas is not None else None
    return LoadGenerator(load_cfg, planner, Checker(MODEL), tally, targets)


async def _load_under_faults(
    args: argparse.Namespace,
    urls: list[str],
    load: LoadGenerator,
    injector: FaultInjector,
    stop: asyncio.Event,
) -> tuple[float, dict[str, int]]:
    """Run the load under faults, let every victim come back; the load's seconds, each counter's growth
    (summed over the orchestrators: one, or every replica)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        before = [await recovery_counters(http, url) for url in urls]
        started = time.monotonic()
        killing = asyncio.ensure_future(injector.run(started, started + args.duration, stop))
        progress = asyncio.ensure_future(
            _every(args.progress_s, lambda: _progress(time.monotonic() - started, load.tally, load, injector))
        )
        try:
            duration = await load.run(stop)
        finally:
            killing.cancel()
            progress.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await killing
        if stop.is_set():
            await injector.cancel()
        else:
            await injector.settle()  # every victim back (or its recovery timed out)
        after = [await recovery_counters(http, url) for url in urls]
    return duration, counter_growth(before, after)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "prefill", "decode", "concurrency", "duration", "max_requests", "kill_every", "seed",
        "min_tokens", "max_tokens", "stream_fraction", "chat_fraction", "heartbeat_timeout_s", "replicas",
    )  # fmt: skip
    config = {k: getattr(args, k) for k in keys}
    config["kinds"] = ",".join(_kinds(args))
    if args.replicas:
        config["lease_ttl_s"] = args.lease_ttl_s
    config["sim_timing"] = {name: getattr(args, name) for _, name, _ in sim_timing_flags()}
    return config


def run(args: argparse.Namespace) -> int:
    """Run the chaos test and print its report; 0 when failed == garbled == 0."""
    _validate(args)
    if args.log_file:
        log_path = os.path.abspath(args.log_file)
        log = open(log_path, "ab")  # noqa: SIM115 - closed below, after every child is gone
    else:
        fd, log_path = tempfile.mkstemp(prefix="vllm-disagg-chaos-", suffix=".log")
        log = os.fdopen(fd, "ab")
    reports: list[ChaosReport] = []

    async def main(stop: asyncio.Event) -> int:
        report = await chaos(args, stop, log, log_path)
        reports.extend([report] if report else [])
        return 0

    try:
        run_service(main)
    finally:
        log.close()
    report = reports[0] if reports else None
    if report is None:
        return 1
    if args.json:
        print(report.render(), file=sys.stderr)
        print(jsonutil.dumps(report.to_json()).decode(), flush=True)
    else:
        print(report.render(), flush=True)
    return 0 if report.ok and report.sent > 0 else 1
