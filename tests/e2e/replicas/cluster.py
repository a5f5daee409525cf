"""Replicated orchestrators as real processes on a real etcd, for the failure tests of this folder.

``ReplicaCluster`` starts, each as its own process with its output in the test's directory: one etcd
member (``tests/etcd_support.py``), N ``vllm-disagg orchestrator --etcd ...`` replicas, and three
``vllm-disagg agent --engine sim`` (each launching its simulated engine) that hold a session with every
replica and write ``--command-log`` files (``commands.py`` reads them):

- ``prefill-0`` and ``decode-0`` serve ``sim-model``, the model the load asks for (``load.py``);
- ``spare-0`` serves ``spare-model``, which no request asks for: the tests drain and undrain it to make
  the leader send agent commands (a cordon sends none) without touching the load's instances.

Every process can be placed (``Placement``): an address to bind and be reached at, and a command prefix
(``ip netns exec NS``) to run it in a network namespace; by default everything is on 127.0.0.1.

Cleanup: ``close()`` SIGKILLs every process group it started, and every engine found by its port, and
etcd; the fixture calls it in ``finally``, so a failed test leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e.replicas.commands import CommandRecord, read_command_log
from tests.e2e.up_support import engine_pids
from tests.etcd_support import EtcdServer
from tests.helpers import ADMIN, cli_argv, eventually, free_port, free_ports, metric_sum, parse_prometheus
from vllm_disagg.runtime import die_with_parent

MODEL = "sim-model"
SPARE_MODEL = "spare-model"
SPARE = "spare-0"
TTL_S = 2  # the leader's lease: etcd's minimum, so failovers are as quick as they get
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 3.0  # generous: a 2-core machine running 11 processes must not lose an agent
SHUTDOWN_TIMEOUT_S = 10.0  # a replica's SIGTERM: in-flight streams (about a second each) finish first
# ... after this long failing its health checks while serving on: the load's check (every 0.1 s) has
# taken it out of the rotation before its listener closes.
SHUTDOWN_DELAY_S = 3.0
READY_TIMEOUT_S = 90.0  # eleven Python processes starting on a busy 2-core machine
# Streams of 24-48 tokens at 20 ms a step last 0.5-1 s: some are always in flight when a replica dies.
SIM_TIMING = ("--decode-step-s", "0.02", "--prefill-s-per-token", "0.0001", "--max-num-seqs", "32")
AGENTS = (("prefill-0", "prefill", MODEL), ("decode-0", "decode", MODEL), (SPARE, "decode", SPARE_MODEL))
LOOPBACK = "127.0.0.1"


class ChildDied(Exception):
    """A process of the cluster exited when it should run."""


@dataclass(frozen=True)
class Placement:
    """Where a process runs: the address it binds and is reached at, and a command prefix."""

    host: str = LOOPBACK
    wrap: tuple[str, ...] = ()  # e.g. ("ip", "netns", "exec", NS): ``ip`` execs the command, same pid


class Child:
    """One process in its own process group, its output appended to ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (again, with the same command line)."""
        # Popen on the test's main thread: PR_SET_PDEATHSIG fires when the forking *thread* exits.
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """``sig`` to the process itself."""
        if self.running():
            os.kill(self.pid, sig)

    async def exited(self, timeout_s: float) -> int:
        """Its exit code, once it has exited (fails after ``timeout_s``)."""
        proc = self.proc
        assert proc is not None
        await eventually(
            lambda: proc.poll() is not None, timeout=timeout_s, interval=0.05, what=f"{self.name} to exit"
        )
        return int(proc.returncode)

    def kill_group(self) -> None:
        """SIGKILL its whole process group, and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def tail(self, limit: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


class PlacedEtcd(EtcdServer):
    """``EtcdServer`` bound to a placement's address and run under its prefix (a namespace)."""

    def __init__(self, data_dir: Path, place: Placement) -> None:
        super().__init__(data_dir)
        self.place = place

    @property
    def url(self) -> str:
        return f"http://{self.place.host}:{self.client_port}"

    def argv(self) -> list[str]:
        return [*self.place.wrap, *super().argv()]


@dataclass
class Replica:
    """One orchestrator replica: its id, ports and process."""

    index: int
    replica_id: str
    place: Placement
    port: int
    zmq_port: int
    peer_port: int
    child: Child

    @property
    def url(self) -> str:
        return f"http://{self.place.host}:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.place.host}:{self.zmq_port}"


class ReplicaCluster:
    """etcd, ``n`` replicas and the three agents (with their engines), each a process."""

    def __init__(
        self,
        tmp: Path,
        *,
        n: int = 3,
        etcd_place: Placement = Placement(),
        replica_places: Sequence[Placement] | None = None,
        engine_host: str = LOOPBACK,
    ) -> None:
        self.tmp = tmp
        self.cluster = f"e2e-{os.getpid()}-{random.randrange(1 << 30):x}"
        self.etcd = PlacedEtcd(tmp / "etcd", etcd_place)
        places = list(replica_places or [Placement()] * n)
        self.replicas = [self._replica(i, place) for i, place in enumerate(places)]
        self.engine_host = engine_host
        self.last_views: dict[str, Any] = {}  # what the replicas said last in ``ready`` (for its failure)
        self.engine_ports = [free_ports(1, (0, 2000)) for _ in AGENTS]
        endpoints = ",".join(r.endpoint for r in self.replicas)
        self.agents = {
            agent_id: Child(
                agent_id, self._agent_argv(agent_id, role, model, port, endpoints), self._log(agent_id)
            )
            for (agent_id, role, model), port in zip(AGENTS, self.engine_ports, strict=True)
        }

    def _log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def command_log(self, agent_id: str) -> Path:
        return self.tmp / f"{agent_id}.commands.jsonl"

    def _replica(self, i: int, place: Placement) -> Replica:
        replica_id = f"r{i}"
        port, zmq_port, peer_port = free_port(), free_port(), free_port()
        argv = [
            *place.wrap,
            *cli_argv(
                "orchestrator", "--host", place.host, "--port", str(port),
                "--zmq-endpoint", f"tcp://{place.host}:{zmq_port}", "--insecure-agents",
                "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
                "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
                "--shutdown-timeout-s", str(SHUTDOWN_TIMEOUT_S), "--shutdown-delay-s", str(SHUTDOWN_DELAY_S),
                "--no-preload-tokenizer-libs",
                "--etcd", self.etcd.url, "--cluster", self.cluster, "--replica-id", replica_id,
                "--advertise-host", place.host, "--peer-port", str(peer_port),
                "--lease-ttl-s", str(TTL_S),
            ),
        ]  # fmt: skip
        return Replica(
            i, replica_id, place, port, zmq_port, peer_port, Child(replica_id, argv, self._log(replica_id))
        )

    def _agent_argv(self, agent_id: str, role: str, model: str, port: int, endpoints: str) -> list[str]:
        return cli_argv(
            "agent", "--engine", "sim", "--role", role, "--agent-id", agent_id, "--model", model,
            "--orchestrator", endpoints, "--engine-host", self.engine_host,
            "--engine-port", str(port), "--kv-events-port", str(port + 2000),
            "--command-log", str(self.command_log(agent_id)), *SIM_TIMING,
        )  # fmt: skip

    # -- start, stop ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start everything and wait until one leader is agreed and every instance is ready everywhere."""
        await self.etcd.start_async()
        for replica in self.replicas:
            replica.child.start()
        for agent in self.agents.values():
            agent.start()
        await self.ready(self.replicas)

    def close(self) -> None:
        """SIGKILL everything this cluster started (agents first: their engines die with them)."""
        for child in [*self.agents.values(), *(r.child for r in self.replicas)]:
            child.kill_group()
        for pid in engine_pids(self.engine_ports):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.etcd.kill()

    def logs(self) -> str:
        """The end of every process's output, for a failed assertion."""
        parts = [
            f"--- {c.name}\n{c.tail()}" for c in [*(r.child for r in self.replicas), *self.agents.values()]
        ]
        return "\n".join([*parts, f"--- etcd\n{self.etcd.log_tail()}"])

    @property
    def log(self) -> Path:
        """Every process's output in one file, made when read (tests/e2e/conftest.py shows a failed
        test's last lines of it): etcd first, the replicas last."""
        path = self.tmp / "cluster.log"
        children = [*self.agents.values(), *(r.child for r in self.replicas)]
        parts = [f"--- etcd\n{self.etcd.log_tail()}", *(f"--- {c.name}\n{c.tail(20000)}" for c in children)]
        path.write_text("\n".join(parts))
        return path

    # -- what the replicas say -----------------------------------------------------------------------

    async def get(self, http: aiohttp.ClientSession, replica: Replica, path: str) -> Any:
        """An admin GET on ``replica`` (with the token); its JSON (fails on a non-200)."""
        async with http.get(replica.url + path, headers=ADMIN) as resp:
            if resp.status != 200:
                raise AssertionError(f"{replica.replica_id} {path}: {resp.status} {await resp.text()}")
            return await resp.json()

    async def view(self, http: aiohttp.ClientSession, replica: Replica) -> dict[str, Any]:
        """``GET /admin/v1/replicas`` of ``replica``."""
        seen: dict[str, Any] = await self.get(http, replica, "/admin/v1/replicas")
        return seen

    async def metric(self, http: aiohttp.ClientSession, replica: Replica, what: str) -> float:
        """``vllm_disagg_replica{what=...}`` of ``replica``."""
        async with http.get(replica.url + "/metrics") as resp:
            text = await resp.text()
        return metric_sum(parse_prometheus(text), "vllm_disagg_replica", what=what)

    async def agreed_leader(
        self, http: aiohttp.ClientSession, among: Sequence[Replica]
    ) -> tuple[str, int] | None:
        """(leader id, epoch) when every replica of ``among`` names the same leader, the leader says it
        leads, and each sees them all."""
        views = {r.replica_id: await self.view(http, r) for r in among}
        self.last_views.update(views)
        leaders = {(v["leader"], v["epoch"]) for v in views.values()}
        if len(leaders) != 1 or None in next(iter(leaders)):
            return None
        leader, epoch = next(iter(leaders))
        if leader not in views or views[leader]["role"] != "leader":
            return None
        if any(len(v["replicas"]) != len(among) for v in views.values()):
            return None
        return str(leader), int(epoch)

    async def instances_ready(self, http: aiohttp.ClientSession, replica: Replica) -> bool:
        """Whether ``replica`` has every agent's instance ready (the spare: or drained, as a toggler may
        have left it, or cordoned)."""
        body = await self.get(http, replica, "/admin/v1/instances")
        states = {i["agent_id"]: i["state"] for i in body["instances"]}
        self.last_views[f"{replica.replica_id} instances"] = states
        return all(
            states.get(a) in (("ready", "draining", "cordoned") if a == SPARE else ("ready",))
            for a in self.agents
        )

    async def ready(self, among: Sequence[Replica], timeout_s: float = READY_TIMEOUT_S) -> tuple[str, int]:
        """Wait until ``among`` agree on a leader and each has every instance ready: (leader, epoch)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:

            async def probe() -> tuple[str, int] | None:
                dead = [c.name for c in self.children(among) if not c.running()]
                if dead:
                    raise ChildDied(f"{dead} exited")
                for replica in among:
                    if not await self.instances_ready(http, replica):
                        return None
                return await self.agreed_leader(http, among)

            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    if found := await probe():
                        return found
                except ChildDied as exc:
                    raise AssertionError(f"{exc}\n{self.logs()}") from None
                except (AssertionError, aiohttp.ClientError, TimeoutError, KeyError):
                    pass  # not answering yet
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"replicas not ready after {timeout_s} s; last views {self.last_views}\n{self.logs()}"
                    )
                await asyncio.sleep(0.1)

    def children(self, among: Sequence[Replica]) -> list[Child]:
        """The processes of ``among`` and every agent."""
        return [*(r.child for r in among), *self.agents.values()]

    def by_id(self, replica_id: str) -> Replica:
        return next(r for r in self.replicas if r.replica_id == replica_id)

    # -- the agents' command logs --------------------------------------------------------------------

    def command_logs(self) -> dict[str, list[CommandRecord]]:
        """Every agent's command log, in file order."""
        return {agent_id: read_command_log(agent_id, self.command_log(agent_id)) for agent_id in self.agents}
