"""The fault injector: every interval, SIGKILL a random engine, agent or (``--replicas``) orchestrator
replica of the cluster and watch the victim come back.

An engine is killed by SIGKILL to its process (it leads its own group); its agent notices and starts
a new one. An agent is killed by SIGKILL; the kernel then stops its engine (``PR_SET_PDEATHSIG``) and
this harness, playing the part of a process supervisor, starts the agent again with the same command
line once the old engine is gone (so the ports are free). Only instances that are ready and not
still recovering from an earlier fault are picked, so faults do not pile up on one instance. A replica
(``replicas.py``) is SIGKILLed and started again by the harness too; while one recovers no other fault
is injected, and a replica is hit only while no other fault recovers, so a majority always serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from vllm_disagg.chaos.replicas import ReplicaSet
from vllm_disagg.cli.up import InstancePlan, LocalCluster, fetch_instances
from vllm_disagg.runtime import signal_group

FaultKind = Literal["engine", "agent", "replica"]
FAULT_KINDS: tuple[FaultKind, ...] = ("engine", "agent", "replica")
Spawn = Callable[..., Awaitable[asyncio.subprocess.Process]]  # (argv, env=None)
_POLL_S = 0.1
_GONE_TIMEOUT_S = 10.0  # a killed agent's engine, stopping on SIGTERM, before it is SIGKILLed


@dataclass
class Fault:
    """One injected fault and what became of it."""

    at_s: float  # since the load started
    kind: FaultKind
    target: str  # agent id of the instance hit, or the replica's id
    pid: int  # the process killed
    new_pid: int | None = None  # its replacement (a new engine, or the restarted agent)
    recovered_s: float | None = None  # from the kill until the instance was ready again
    error: str = ""  # why it did not recover

    def to_json(self) -> dict[str, Any]:
        """The fault as a JSON object."""
        return asdict(self)


def _stat(pid: int) -> list[str] | None:
    try:
        # The command name may contain spaces and parentheses: split after its closing one.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs (an unreaped zombie does not count)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def engine_pid(agent_pid: int, port: int) -> int | None:
    """The simulated engine an agent launched: its child whose command line serves ``port``."""
    needle = "\x00sim-engine\x00"
    port_arg = f"\x00--port\x00{port}\x00"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is None or fields[0] == "Z" or int(fields[1]) != agent_pid:
            continue
        try:
            cmdline = "\x00" + Path(f"/proc/{entry}/cmdline").read_text(errors="replace")
        except OSError:
            continue
        if needle in cmdline and port_arg in cmdline:
            return int(entry)
    return None


class FaultInjector:
    """Kills on a schedule; ``faults`` holds every fault injected so far."""

    def __init__(
        self,
        cluster: LocalCluster,
        spawn: Spawn,
        *,
        every_s: float,
        seed: int,
        kinds: Sequence[FaultKind] = ("engine", "agent"),
        recovery_timeout_s: float = 30.0,
        replicas: ReplicaSet | None = None,
    ) -> None:
        if not kinds or any(k not in FAULT_KINDS for k in kinds):
            raise ValueError(f"fault kinds must be among {FAULT_KINDS}, got {kinds}")
        if "replica" in kinds and replicas is None:
            raise ValueError("replica faults need replicas")
        self.cluster = cluster
        self.replicas = replicas
        self._spawn = spawn
        self.every_s = every_s
        # Separate streams: the kinds drawn do not depend on how many instances happened to be ready.
        self._kind_rng = random.Random(f"{seed}/kind")
        self._target_rng = random.Random(f"{seed}/target")
        self.kinds = tuple(kinds)
        self.recovery_timeout_s = recovery_timeout_s
        self.faults: list[Fault] = []
        self.skipped = 0  # ticks with no instance fit to be hit
        self._plans = {p.agent_id: p for p in cluster.plans}
        self._recovering: set[str] = set()
        self._watchers: list[asyncio.Task[None]] = []
        self._started = time.monotonic()

    async def run(self, started: float, deadline: float, stop: asyncio.Event) -> None:
        """Strike at ``started + k * every_s`` for k = 1, 2, ... while before ``deadline``."""
        self._started = started
        if self.every_s <= 0:
            return
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            k = 1
            while (at := started + k * self.every_s) < deadline:
                k += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=max(0.0, at - time.monotonic()))
                if stop.is_set():
                    return
                kind = self._kind_rng.choice(self.kinds)
                if kind == "replica":
                    self._strike_replica()
                    continue
                url = self._admin_url()
                instances = await fetch_instances(http, url, self.cluster.spec.admin_token) or []
                fit = sorted(
                    str(i["agent_id"])
                    for i in instances
                    if i.get("state") == "ready"
                    and i.get("agent_id") in self._plans
                    and i.get("agent_id") not in self._recovering
                )
                if not fit or (self.replicas is not None and self.replicas.recovering):
                    self.skipped += 1
                    continue
                target = self._target_rng.choice(fit)
                session = next((i.get("session") for i in instances if i.get("agent_id") == target), None)
                self._strike(kind, target, session, url)

    def _admin_url(self) -> str:
        """Where the admin API is asked: the orchestrator, or a replica in the load's rotation."""
        return self.replicas.admin_url() if self.replicas is not None else self.cluster.spec.base_url

    def _agent_argv(self, plan: InstancePlan) -> list[str]:
        return (
            self.replicas.agent_argv(plan)
            if self.replicas is not None
            else self.cluster.spec.agent_argv(plan)
        )

    def _strike_replica(self) -> None:
        """SIGKILL a replica, only while no other fault recovers (a majority always serves)."""
        replicas = self.replicas
        assert replicas is not None
        fit = [] if self._recovering or replicas.recovering else replicas.targets.in_rotation
        if not fit:
            self.skipped += 1
            return
        index = self._target_rng.choice(fit)
        at_s = round(time.monotonic() - self._started, 3)
        target = replicas.plans[index].replica_id
        fault = Fault(at_s, "replica", target, replicas.kill(index))
        self.faults.append(fault)
        self._recovering.add(target)
        agents = list(self._plans)
        watch = self._replica_back(fault, index, agents)
        self._watchers.append(asyncio.ensure_future(self._watch(fault, watch)))

    async def _replica_back(self, fault: Fault, index: int, agents: list[str]) -> None:
        assert self.replicas is not None
        fault.new_pid = await self.replicas.bring_back(index, self._spawn, agents)

    def _strike(self, kind: FaultKind, target: str, session: object, url: str) -> None:
        agent = self.cluster.agents[target]
        port = self._plans[target].engine_port
        engine = engine_pid(agent.pid, port)
        at_s = round(time.monotonic() - self._started, 3)
        if kind == "engine":
            if engine is None:  # between restarts: nothing to kill right now
                self.skipped += 1
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)
            fault = Fault(at_s, kind, target, engine)
            watch = self._engine_back(fault, agent.pid, port, url)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGKILL)
            fault = Fault(at_s, kind, target, agent.pid)
            watch = self._agent_back(fault, agent, engine, session, url)
        self.faults.append(fault)
        self._recovering.add(target)
        self._watchers.append(asyncio.ensure_future(self._watch(fault, watch)))

    async def _watch(self, fault: Fault, watch: Awaitable[None]) -> None:
        killed = time.monotonic()
        try:
            await asyncio.wait_for(watch, timeout=self.recovery_timeout_s)
            fault.recovered_s = round(time.monotonic() - killed, 3)
        except TimeoutError:
            fault.error = f"not ready again within {self.recovery_timeout_s:g} s"
        finally:
            self._recovering.discard(fault.target)

    async def _engine_back(self, fault: Fault, agent_pid: int, port: int, url: str) -> None:
        """Until the agent runs a new engine that answers /health and the instance is ready."""

        async def back(http: aiohttp.ClientSession) -> bool:
            new = engine_pid(agent_pid, port)
            if new is None or new == fault.pid:
                return False
            fault.new_pid = new
            return await _healthy(http, f"http://127.0.0.1:{port}/health") and await self._ready(
                http, url, fault.target, lambda _: True
            )

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            await _until(lambda: back(http))

    async def _agent_back(
        self, fault: Fault, agent: asyncio.subprocess.Process, engine: int | None, session: object, url: str
    ) -> None:
        """Start the agent again once its engine is gone; until it is ready in a new session."""
        await agent.wait()
        if engine is not None:
            gone = asyncio.ensure_future(_until(lambda: not alive(engine)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone, timeout=_GONE_TIMEOUT_S)
            signal_group(engine, signal.SIGKILL)  # still there after SIGTERM: it goes now
            await _until(lambda: not alive(engine))
        plan = self._plans[fault.target]
        fresh = await self._spawn(self._agent_argv(plan))
        self.cluster.agents[fault.target] = fresh
        fault.new_pid = fresh.pid

        def new_session(item: dict[str, object]) -> bool:
            now = item.get("session")
            return not isinstance(now, int) or not isinstance(session, int) or now > session

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            await _until(lambda: self._ready(http, url, fault.target, new_session))

    async def _ready(
        self, http: aiohttp.ClientSession, url: str, agent_id: str, also: Callable[[dict[str, object]], bool]
    ) -> bool:
        """Whether ``agent_id`` is ready (and ``also``) at ``url``: the replica asked when it was hit, whose
        session numbers the fault's are (each replica counts its own)."""
        for item in await fetch_instances(http, url, self.cluster.spec.admin_token) or []:
            if item.get("agent_id") == agent_id:
                return item.get("state") == "ready" and also(item)
        return False

    async def settle(self) -> None:
        """Wait for every fault's watcher (each bounded by the recovery timeout)."""
        if self._watchers:
            await asyncio.gather(*self._watchers)

    async def cancel(self) -> None:
        """Stop watching (on an interrupted run)."""
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for fault in self.faults:
            if fault.recovered_s is None and not fault.error:
                fault.error = "the run was interrupted before it recovered"


async def _until(probe: Callable[[], Awaitable[bool] | bool]) -> None:
    """Poll ``probe`` until it holds (callers bound the wait)."""
    while True:
        result = probe()
        if result if isinstance(result, bool) else await result:
            return
        await asyncio.sleep(_POLL_S)


async def _healthy(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
