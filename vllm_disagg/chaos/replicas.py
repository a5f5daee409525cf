"""``vllm-disagg chaos --replicas N``: N orchestrator replicas on a local etcd, and killing them.

Each replica is ``vllm-disagg orchestrator --etcd ...`` with its own HTTP, agent and peer ports (below
the ephemeral range, so that no client connection takes one while its replica is down), the cluster's
keys and admin token; every agent reports to all of them (``--orchestrator tcp://a,tcp://b,...``).

A replica fault: the replica leaves the load's rotation (``spread.Targets``: a load balancer's health
check), is SIGKILLed, and, the harness playing its supervisor, is started again with the same command
line; it is *recovered* once it knows a leader and has every instance ready, and then rejoins the
rotation. Requests in flight on it when it died fail on a killed replica's connections; no other may.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.chaos.spread import Targets
from vllm_disagg.cli.up import ClusterSpec, InstancePlan, fetch_instances
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import admin_headers

Spawn = Callable[..., Awaitable[asyncio.subprocess.Process]]
_POLL_S = 0.1


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def low_ports(n: int, taken: set[int]) -> list[int]:
    """``n`` free loopback ports below the ephemeral range, none in ``taken`` (which grows by them)."""
    rng = random.SystemRandom()
    found: list[int] = []
    for _ in range(1000 * n):
        if len(found) == n:
            break
        port = rng.randrange(20000, 30000)
        if port not in taken and _free(port):
            taken.add(port)
            found.append(port)
    if len(found) < n:
        raise ConfigError(f"found no {n} free ports in 20000-29999")
    return found


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica: its id and ports."""

    index: int
    replica_id: str
    port: int
    zmq_port: int
    peer_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"


class ReplicaSet:
    """The replicas' plans and processes, who is recovering, and the replica faults."""

    def __init__(
        self, spec: ClusterSpec, n: int, etcd_url: str, lease_ttl_s: int, taken: set[int], cluster: str
    ) -> None:
        if n < 2:
            raise ConfigError(f"--replicas must be 0 (one orchestrator, no etcd) or at least 2, got {n}")
        self.spec = spec
        self.etcd_url = etcd_url
        self.lease_ttl_s = lease_ttl_s
        self.cluster = cluster
        ports = low_ports(3 * n, taken)
        self.plans = [
            ReplicaPlan(i, f"r{i}", ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]) for i in range(n)
        ]
        self.targets = Targets([p.url for p in self.plans])
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.recovering: set[int] = set()

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.plans]

    def argv(self, index: int) -> list[str]:
        """Replica ``index``'s command line: the cluster's orchestrator, on its own ports, on etcd."""
        plan = self.plans[index]
        replica = (
            "--etcd", self.etcd_url, "--cluster", self.cluster, "--replica-id", plan.replica_id,
            "--advertise-host", "127.0.0.1", "--peer-port", str(plan.peer_port),
            "--lease-ttl-s", str(self.lease_ttl_s),
        )  # fmt: skip
        spec = replace(
            self.spec,
            port=plan.port,
            zmq_port=plan.zmq_port,
            extra_orchestrator_args=(*self.spec.extra_orchestrator_args, *replica),
        )
        return spec.orchestrator_argv()

    def agent_argv(self, plan: InstancePlan) -> list[str]:
        """An agent's command line, reporting to every replica."""
        argv = self.spec.agent_argv(plan)
        at = argv.index("--orchestrator") + 1
        argv[at] = ",".join(p.endpoint for p in self.plans)
        return argv

    async def start(self, spawn: Spawn) -> None:
        """Start every replica."""
        for plan in self.plans:
            self.procs[plan.index] = await spawn(self.argv(plan.index), env=self.spec.orchestrator_env())

    def exited(self) -> bool:
        """Whether a replica that should run has exited (not one killed on purpose)."""
        return any(p.returncode is not None for i, p in self.procs.items() if i not in self.recovering)

    def admin_url(self) -> str:
        """A replica serving now (in the rotation): where the admin API is asked."""
        live = self.targets.in_rotation
        return self.plans[live[0] if live else 0].url

    async def ready(self, http: aiohttp.ClientSession, index: int, agents: Sequence[str]) -> bool:
        """Whether replica ``index`` knows a leader and has every instance in ``agents`` ready."""
        url = self.plans[index].url
        items = await fetch_instances(http, url, self.spec.admin_token) or []
        ready = {str(i.get("agent_id")) for i in items if i.get("state") == "ready"}
        if not ready >= set(agents):
            return False
        try:
            async with http.get(
                f"{url}/admin/v1/replicas", headers=admin_headers(self.spec.admin_token)
            ) as r:
                seen = jsonutil.loads(await r.read()) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        return isinstance(seen, dict) and bool(seen.get("leader"))

    async def wait_ready(self, agents: Sequence[str], timeout_s: float, failed: Callable[[], bool]) -> bool:
        """Until every replica is ready (True), ``timeout_s`` passes or ``failed()`` (False)."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while not failed() and time.monotonic() < deadline:
                if all([await self.ready(http, p.index, agents) for p in self.plans]):
                    return True
                await asyncio.sleep(_POLL_S)
        return False

    def kill(self, index: int) -> int:
        """Take replica ``index`` out of the rotation and SIGKILL it; its pid."""
        proc = self.procs[index]
        self.recovering.add(index)
        self.targets.take_out(index)
        self.targets.killed(index, time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        return proc.pid

    async def bring_back(self, index: int, spawn: Spawn, agents: Sequence[str]) -> int:
        """Start replica ``index`` again once the old process is gone; back in the rotation once ready.
        Its new pid (the caller bounds the wait)."""
        try:
            await self.procs[index].wait()
            fresh = await spawn(self.argv(index), env=self.spec.orchestrator_env())
            self.procs[index] = fresh
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
                while True:  # the caller bounds the wait
                    if await self.ready(http, index, agents):
                        break
                    await asyncio.sleep(_POLL_S)
            self.targets.put_back(index)
            return fresh.pid
        finally:
            self.recovering.discard(index)

    async def stop(
        self, stop_processes: Callable[[list[asyncio.subprocess.Process], float], Awaitable[None]]
    ) -> None:
        """Stop every replica (SIGTERM, then SIGKILL after the spec's grace)."""
        await stop_processes(list(self.procs.values()), self.spec.stop_grace_s)
