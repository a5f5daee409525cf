"""The processes of ``vllm-disagg bench ha``: one orchestrator, or etcd and N replicas, and agents.

``HaCluster`` starts every process as ``up`` would (``ClusterSpec``'s command lines: the replicas on
an etcd member of their own, ``local_etcd.EmbeddedEtcd``'s command line; every agent connects to every
replica), each in its own process group with its output in a file of ``logs``. Agents write
``--command-log`` files; with ``spare`` a third agent serves a model no request asks for
(``spare-0``), so a benchmark can drain and undrain it to make the leader command an agent without
touching the load's instances. It also reads what the benchmarks need from outside the processes:
who leads (``GET /admin/v1/replicas``), the agents' command logs, the processes' CPU time (``/proc``)
and the bytes each agent's sockets to the orchestrators carried (``ss``: the kernel's TCP counters).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.compare import group_cpu_seconds
from vllm_disagg.cli.local_etcd import EmbeddedEtcd
from vllm_disagg.cli.supervise import end_groups, session_leaders_with
from vllm_disagg.cli.up import ClusterSpec, InstancePlan, spawn, stop_processes
from vllm_disagg.cli.up_replicas import ReplicaSet, fetch_instances, leader_of
from vllm_disagg.orchestrator.admin.auth import admin_headers

Proc = asyncio.subprocess.Process
MODEL = "sim-model"
SPARE = "spare-0"
SPARE_MODEL = "spare-model"  # no request asks for it: draining the spare never touches the load
HEARTBEAT_TIMEOUT_S = 3.0  # generous: a 2-core machine running a dozen processes must not lose an agent
STOP_GRACE_S = 5.0
_POLL_S = 0.05
_HTTP, _ZMQ, _ENGINES = 0, 10, 20  # the port layout from a free base: base + these (+ i)
_ENGINE_OFFSETS = (0, 1000, 2000, 3000)  # an engine's own port, and the ones it derives from it


@dataclass(frozen=True)
class Shape:
    """What to start: ``replicas`` 0 is one orchestrator without etcd (the default deployment)."""

    replicas: int
    gateway_workers: int = 1
    lease_ttl_s: int = 3
    spare: bool = False
    sim_timing: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class CommandRecord:
    """One line of an agent's ``--command-log``."""

    agent: str
    mono: float
    kind: str
    epoch: int
    accepted: bool


@dataclass(frozen=True)
class Leadership:
    """Who leads, as every live replica agrees."""

    leader: str
    epoch: int


def free_base(offsets: Sequence[int]) -> int:
    """A base port where ``base + d`` is free on loopback now for every ``d`` in ``offsets``."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 60000 - max(offsets))
        if all(_port_free(base + d) for d in offsets):
            return base


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class HaCluster:
    """The processes of one benchmark configuration; ``stop()`` leaves nothing running."""

    def __init__(self, shape: Shape, logs: Path, name: str) -> None:
        self.shape = shape
        self.logs = logs / name
        self.logs.mkdir(parents=True, exist_ok=True)
        n = max(1, shape.replicas)
        agents = 3 if shape.spare else 2
        offsets = [_HTTP + i for i in range(n)] + [_ZMQ + i for i in range(n)]
        offsets += [_ENGINES + i + d for i in range(agents) for d in _ENGINE_OFFSETS]
        base = free_base(offsets)
        self.etcd = EmbeddedEtcd.plan(self.logs / "etcd-data") if shape.replicas else None
        replicas = None
        if self.etcd is not None:
            cluster = f"bench-ha-{os.getpid()}-{random.randrange(1 << 24):x}"
            replicas = ReplicaSet(shape.replicas, (self.etcd.url,), cluster, lease_ttl_s=shape.lease_ttl_s)
        workers = ("--gateway-workers", str(shape.gateway_workers)) if shape.gateway_workers > 1 else ()
        self.spec = ClusterSpec(
            engine="sim",
            model=MODEL,
            port=base + _HTTP,
            zmq_port=base + _ZMQ,
            engine_base_port=base + _ENGINES,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            stop_grace_s=STOP_GRACE_S,
            sim_timing=shape.sim_timing,
            extra_orchestrator_args=workers,
            replicas=replicas,
        )
        self.plans = self.spec.plans()
        if shape.spare:
            self.plans.append(InstancePlan(SPARE, "decode", base + _ENGINES + 2, 2))
        self.urls = self.spec.base_urls()
        self.zmq_ports = {base + _ZMQ + i for i in range(n)}
        self.token = self.spec.admin_token
        self.etcd_proc: Proc | None = None
        self.orchestrators: list[Proc] = []
        self.agents: dict[str, Proc] = {}
        self._files: list[IO[bytes]] = []

    @property
    def agent_ids(self) -> list[str]:
        """Every agent's id (the spare's last)."""
        return [p.agent_id for p in self.plans]

    def command_log(self, agent_id: str) -> Path:
        """Where ``agent_id`` logs its commands."""
        return self.logs / f"{agent_id}.commands.jsonl"

    async def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        out = (self.logs / f"{name}.log").open("ab")
        self._files.append(out)
        return await spawn(argv, env=env, output=out)

    async def start(self, timeout_s: float) -> None:
        """etcd (with replicas), the orchestrators, the agents; returns once every replica agrees on a
        leader and has every instance ready."""
        if self.etcd is not None:
            self.etcd.reset()
            self.etcd_proc = await self._spawn("etcd", self.etcd.argv())
            await self._etcd_healthy(timeout_s)
        for i in range(len(self.urls)):
            self.orchestrators.append(await self.start_orchestrator(i))
        for plan in self.plans:
            spec = replace(self.spec, model=SPARE_MODEL) if plan.agent_id == SPARE else self.spec
            argv = [*spec.agent_argv(plan), "--command-log", str(self.command_log(plan.agent_id))]
            self.agents[plan.agent_id] = await self._spawn(plan.agent_id, argv)
        await self.ready(range(len(self.urls)), timeout_s)

    async def start_orchestrator(self, index: int) -> Proc:
        """Orchestrator (replica) ``index``'s process, started (again) with its command line."""
        argv = self.spec.orchestrator_argv(index)
        return await self._spawn(f"orchestrator-{index}", argv, self.spec.orchestrator_env())

    async def restart(self, index: int, timeout_s: float) -> None:
        """Replica ``index`` again, after it died; returns once it is part of the cluster again."""
        old = self.orchestrators[index]
        await old.wait()
        self.orchestrators[index] = await self.start_orchestrator(index)
        await self.ready(range(len(self.urls)), timeout_s)

    def kill(self, index: int) -> float:
        """SIGKILL orchestrator ``index``; the monotonic time read right before the signal."""
        pid = self.orchestrators[index].pid
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return at

    async def _etcd_healthy(self, timeout_s: float) -> None:
        assert self.etcd is not None and self.etcd_proc is not None
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
            while time.monotonic() < deadline and self.etcd_proc.returncode is None:
                try:
                    async with http.get(f"{self.etcd.url}/health") as resp:
                        body = jsonutil.loads(await resp.read()) if resp.status == 200 else None
                    if isinstance(body, dict) and body.get("health") == "true":
                        return
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                await asyncio.sleep(_POLL_S)  # another process: the loop's own clock
        raise RuntimeError(f"etcd at {self.etcd.url} not healthy within {timeout_s:g} s; logs: {self.logs}")

    async def ready(self, indexes: Sequence[int] | range, timeout_s: float) -> Leadership | None:
        """Wait until the orchestrators ``indexes`` each have every instance ready (the spare: or
        draining) and, with replicas, agree on one leader that knows them all."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while time.monotonic() < deadline:
                self._check_alive(indexes)
                if all([await self._instances_ready(http, i) for i in indexes]):
                    if self.etcd is None:
                        return None
                    agreed = await self.leadership(http, indexes)
                    if agreed is not None:
                        return agreed
                await asyncio.sleep(_POLL_S * 2)
        raise RuntimeError(f"the cluster was not ready within {timeout_s:g} s; logs: {self.logs}")

    def _check_alive(self, indexes: Sequence[int] | range) -> None:
        procs = [self.orchestrators[i] for i in indexes] + list(self.agents.values())
        procs += [self.etcd_proc] if self.etcd_proc is not None else []
        if any(p.returncode is not None for p in procs):
            raise RuntimeError(f"a process of the cluster exited; logs: {self.logs}")

    async def _instances_ready(self, http: aiohttp.ClientSession, index: int) -> bool:
        items = await fetch_instances(http, self.urls[index], self.token) or []
        states = {str(i.get("agent_id")): i.get("state") for i in items}
        ok = {a: ("ready", "draining") if a == SPARE else ("ready",) for a in self.agent_ids}
        return all(states.get(a) in allowed for a, allowed in ok.items())

    async def leadership(
        self, http: aiohttp.ClientSession, indexes: Sequence[int] | range
    ) -> Leadership | None:
        """The leader every replica of ``indexes`` names, once each also sees all of them; else None."""
        seen = set()
        for i in indexes:
            described = await self.get(http, i, "/admin/v1/replicas")
            leader = leader_of(described)
            members = described.get("replicas") if isinstance(described, dict) else None
            if leader is None or not isinstance(members, list) or len(members) != len(indexes):
                return None
            seen.add((leader.replica_id, leader.epoch))
        if len(seen) != 1:
            return None
        replica_id, epoch = seen.pop()
        return Leadership(replica_id, epoch)

    def index_of(self, replica_id: str) -> int:
        """The orchestrator index of ``replica_id`` (``ReplicaSet.replica_id``)."""
        return next(i for i in range(len(self.urls)) if ReplicaSet.replica_id(i) == replica_id)

    async def get(self, http: aiohttp.ClientSession, index: int, path: str) -> Any:
        """An admin GET on orchestrator ``index``; its JSON, or None when it did not answer 200."""
        try:
            async with http.get(self.urls[index] + path, headers=admin_headers(self.token)) as resp:
                return jsonutil.loads(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def command_logs(self) -> list[CommandRecord]:
        """Every agent's command log, read now."""
        records = []
        for agent_id in self.agents:
            path = self.command_log(agent_id)
            if not path.exists():
                continue
            for line in path.read_bytes().splitlines():
                if line.strip():
                    d = jsonutil.loads(line)
                    records.append(CommandRecord(agent_id, d["mono"], d["kind"], d["epoch"], d["accepted"]))
        return records

    def orchestrators_cpu_s(self) -> float:
        """User + system seconds of every orchestrator process group (gateway workers included)."""
        return sum(group_cpu_seconds(p.pid) for p in self.orchestrators if p.returncode is None)

    def agents_cpu_s(self) -> float:
        """User + system seconds of the agents (their engines lead groups of their own)."""
        return sum(group_cpu_seconds(p.pid) for p in self.agents.values())

    def etcd_cpu_s(self) -> float:
        """User + system seconds of etcd (0 without one)."""
        return group_cpu_seconds(self.etcd_proc.pid) if self.etcd_proc is not None else 0.0

    async def agent_bytes(self) -> dict[str, tuple[int, int]]:
        """Per agent, the bytes its TCP connections to the orchestrators have carried so far: (sent,
        received), from the kernel's counters (``ss -i``: ``bytes_acked``, ``bytes_received``)."""
        pids = {p.pid: agent_id for agent_id, p in self.agents.items()}
        ss = await asyncio.create_subprocess_exec(
            "ss", "-tinpH", "state", "established",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        out, _ = await ss.communicate()
        return tcp_bytes(out.decode(errors="replace"), pids, self.zmq_ports)

    async def stop(self) -> None:
        """Agents (they stop their engines), the orchestrators, etcd; then any engine left behind."""
        await stop_processes(list(self.agents.values()), STOP_GRACE_S)
        await stop_processes([p for p in self.orchestrators if p.returncode is None], STOP_GRACE_S)
        if self.etcd_proc is not None:
            await stop_processes([self.etcd_proc], STOP_GRACE_S)
        if self.etcd is not None:
            shutil.rmtree(self.etcd.data_dir, ignore_errors=True)  # 60 MB of preallocated log each
        for plan in self.plans:
            await end_groups(session_leaders_with(("--port", str(plan.engine_port))), STOP_GRACE_S)
        for out in self._files:
            out.close()


_SOCKET = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)\s.*pid=(\d+),")
_COUNTER = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


def tcp_bytes(ss_output: str, pids: Mapping[int, str], ports: set[int]) -> dict[str, tuple[int, int]]:
    """From ``ss -tinpH`` output: per owner in ``pids``, the (acked sent, received) bytes of its
    connections whose peer port is in ``ports``."""
    totals = {name: (0, 0) for name in pids.values()}
    owner: str | None = None
    for line in ss_output.splitlines():
        if line and not line[0].isspace():
            match = _SOCKET.search(line)
            owner = None
            if match and int(match.group(4)) in ports:
                owner = pids.get(int(match.group(5)))
            continue
        if owner is None:
            continue
        counters = dict(_COUNTER.findall(line))
        sent, received = totals[owner]
        totals[owner] = (
            sent + int(counters.get("bytes_acked", 0)),
            received + int(counters.get("bytes_received", 0)),
        )
        owner = None
    return totals
