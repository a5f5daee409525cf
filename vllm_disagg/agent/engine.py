"""Engine supervision: launch (or attach to) one engine, follow its health, restart it when it dies.

States (``EngineState``)::

    starting ──/health 200──▶ ready ──/health fails──▶ unhealthy ──/health 200──▶ ready
       │  ▲                     │                          │
       │  └──── respawned ──────┼──── process exited ──────┴──▶ restarting (backoff, then respawn)
       └── stuck past startup_timeout_s: killed ───────────────▶ restarting
    any ── stop() ──▶ stopped

The decisions are pure functions (``decide``, ``restart_delay``); ``EngineSupervisor`` does the I/O.
An engine kind is an ``EngineCommand`` (how to start it, ``engine_command``); ``engine_kinds`` picks one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import aiohttp

from vllm_disagg.agent.engine_command import EngineCommand
from vllm_disagg.agent.engine_kinds import engine_command
from vllm_disagg.clock import Clock, wait_event
from vllm_disagg.config import AgentConfig
from vllm_disagg.procfs import group_members
from vllm_disagg.protocol.messages import EngineState, Role
from vllm_disagg.runtime import child_env, engine_preexec, signal_group

log = logging.getLogger(__name__)

UNHEALTHY_AFTER_CHECKS = 3  # failed /health checks in a row before a ready engine is reported unhealthy
_GROUP_EXIT_POLLS = 250
_GROUP_EXIT_POLL_S = 0.02  # up to 5 s in all for the kernel to finish SIGKILLed processes

Action = Literal["none", "restart", "kill"]


# --- decisions (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """What one supervision tick saw."""

    state: EngineState
    attached: bool  # following someone else's engine: no process to watch or restart
    alive: bool  # our engine process is running (always True when attached)
    healthy: bool  # GET /health answered 200
    starting_for_s: float = 0.0  # since the process was (re)started
    failed_checks: int = 0  # consecutive failed health checks, this one included


@dataclass(frozen=True, slots=True)
class Decision:
    """The state to report and what to do about the process."""

    state: EngineState
    action: Action = "none"


def decide(obs: Observation, *, startup_timeout_s: float, unhealthy_after: int = 1) -> Decision:
    """The next state, and whether to restart (process gone) or kill (stuck starting) the engine.

    A ready engine becomes unhealthy only after ``unhealthy_after`` failed checks in a row: one slow
    ``/health`` on a saturated host is not a sick engine, and routing away from it has a cost.
    """
    if obs.state == "stopped":
        return Decision("stopped")
    if not obs.attached and not obs.alive:
        return Decision("restarting", "restart")
    if obs.healthy:
        return Decision("ready")
    if obs.state == "ready" and obs.failed_checks < unhealthy_after:
        return Decision("ready")
    if not obs.attached and obs.state in ("starting", "restarting"):
        if obs.starting_for_s > startup_timeout_s:
            return Decision("restarting", "kill")
        return Decision("starting")
    return Decision("unhealthy")


def restart_delay(failures: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before restart number ``failures`` (1, 2, ...): base doubling, capped at max."""
    if failures < 1:
        return 0.0
    return float(min(max_s, base_s * 2.0 ** min(failures - 1, 62)))


# --- the adapter --------------------------------------------------------------------------------


def group_alive(pgid: int) -> bool:
    """True while some process of group ``pgid`` still runs (zombies waiting for a reaper do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members({pgid}))


def reap_group(pgid: int) -> int:
    """Collect this process's exited children of process group ``pgid`` (a dead engine's workers,
    adopted as its subreaper); the number reaped. Any other child is left to whoever waits for it
    (``subprocess`` and asyncio wait for their own by pid)."""
    reaped = 0
    for pid in group_members({pgid}, zombies=True):
        try:
            got, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue  # not this process's child (init's, or another reaper's)
        reaped += got == pid
    return reaped


class EngineSupervisor:
    """Launches or attaches to the engine and keeps ``state`` current until ``stop()``."""

    def __init__(
        self,
        cfg: AgentConfig,
        http: aiohttp.ClientSession,
        clock: Clock,
        *,
        interval_s: float | None = None,
        command: EngineCommand | None = None,
    ) -> None:
        self._cfg = cfg
        self._http = http
        self._clock = clock
        # ``command`` replaces the launcher chosen by ``cfg.engine`` (tests launch stand-ins).
        self._command = command if command is not None and not cfg.attach_url else engine_command(cfg)
        self._interval_s = interval_s if interval_s is not None else cfg.scrape_interval_s
        self._health_url = f"{cfg.engine_url}/health"
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = clock.monotonic()
        self._failures = 0  # consecutive restarts without reaching ready
        self._failed_checks = 0  # consecutive failed health checks
        self.state: EngineState = "starting"
        self.restarts = 0
        self._relaunch_as: AgentConfig | None = None  # a role change's restart, for the loop to do
        self._wake = asyncio.Event()
        # Called once a dead or stuck engine is gone, before its replacement starts (its cache is lost).
        self.on_restart: Callable[[], None] | None = None
        # Called on every state change: the agent reports it at once, not at the next heartbeat.
        self.on_state: Callable[[EngineState], None] | None = None

    @property
    def config(self) -> AgentConfig:
        """The config the engine runs with now (its role changes with a restart for a role change)."""
        return self._relaunch_as or self._cfg

    def relaunch(self, role: Role) -> None:
        """Restart the engine as ``role`` (its role's ``kv_role``). The state says ``restarting`` from
        now on, so no heartbeat after the ``set_role`` Ack still says ``ready``; the loop does the rest."""
        assert not self.attached, "an attached engine is not ours to restart"
        if self.state == "stopped":
            return
        self._relaunch_as = dataclasses.replace(self.config, role=role)
        self._set_state("restarting")
        self._wake.set()

    @property
    def attached(self) -> bool:
        """True when following an engine the agent did not start."""
        return self._command is None

    @property
    def pid(self) -> int | None:
        """The engine process's pid while one is running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _set_state(self, state: EngineState) -> None:
        if state != self.state:
            log.info("engine %s -> %s", self.state, state)
            self.state = state
            if self.on_state is not None:
                self.on_state(state)

    def _spawn(self) -> None:
        assert self._command is not None
        self._command.prepare(self._cfg)
        argv = self._command.argv(self._cfg)
        # Own session: stop() signals the whole group. die_with_parent: the kernel stops the engine
        # even when the agent is SIGKILLed and gets no chance to clean up.
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            env=child_env(dict(self._command.env(self._cfg))),
            start_new_session=True,
            preexec_fn=engine_preexec(self._cfg.engine_nice),
        )
        self._started_at = self._clock.monotonic()
        log.info("engine started: pid %d: %s", self._proc.pid, " ".join(argv[3:]))

    async def _healthy(self) -> bool:
        try:
            async with self._http.get(
                self._health_url, timeout=aiohttp.ClientTimeout(total=self._cfg.health_timeout_s)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def tick(self) -> Decision:
        """Observe the engine once, update ``state``, and return the decision."""
        alive = self.attached or (self._proc is not None and self._proc.poll() is None)
        healthy = alive and await self._healthy()
        if self._relaunch_as is not None:  # asked while we looked: the engine seen is going away
            return Decision(self.state)
        self._failed_checks = 0 if healthy else self._failed_checks + 1
        obs = Observation(
            state=self.state,
            attached=self.attached,
            alive=alive,
            healthy=healthy,
            starting_for_s=self._clock.monotonic() - self._started_at,
            failed_checks=self._failed_checks,
        )
        decision = decide(
            obs, startup_timeout_s=self._cfg.startup_timeout_s, unhealthy_after=UNHEALTHY_AFTER_CHECKS
        )
        self._set_state(decision.state)
        if decision.state == "ready":
            self._failures = 0
        return decision

    async def run(self) -> None:
        """Launch the engine (unless attached) and supervise it until cancelled."""
        if self.state == "stopped":
            return
        if not self.attached:
            self._spawn()
        while True:
            if self._relaunch_as is not None:
                await self._relaunch()
            decision = await self.tick()
            if decision.action == "none":
                # On the injected clock (not wait_for, which can swallow a cancel on 3.11): woken by
                # ``relaunch``.
                await wait_event(self._clock, self._wake, self._interval_s)
                self._wake.clear()
                continue
            if decision.action == "kill":
                log.warning("engine not ready after %.0f s; killing it", self._cfg.startup_timeout_s)
            else:
                code = self._proc.returncode if self._proc is not None else None
                log.warning("engine exited unexpectedly (code %s)", code)
            await self._terminate()  # also whatever the engine left behind in its group
            if self.on_restart is not None:
                self.on_restart()
            self._failures += 1
            delay = restart_delay(
                self._failures, self._cfg.restart_backoff_s, self._cfg.restart_backoff_max_s
            )
            log.info("restarting the engine in %.1f s (restart %d)", delay, self.restarts + 1)
            await self._clock.sleep(delay)
            self._spawn()
            self.restarts += 1
            self._set_state("starting")

    async def _relaunch(self) -> None:
        """Stop the engine and start it again with the new role's config (not a failure: no backoff)."""
        cfg = self._relaunch_as
        assert cfg is not None
        log.info("restarting the engine as %s", cfg.role)
        await self._terminate()
        if self.on_restart is not None:
            self.on_restart()
        self._cfg, self._relaunch_as = cfg, None
        self._spawn()
        self.restarts += 1
        self._set_state("starting")

    async def _terminate(self) -> None:
        """SIGTERM the engine's process group, SIGKILL it after ``stop_grace_s``; nothing survives."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the engine leads its own group
        if proc.poll() is None:
            signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(proc.wait, self._cfg.stop_grace_s)
        # Always: the engine's own children may outlive it and still hold its ports.
        signal_group(pgid, signal.SIGKILL)
        if proc.poll() is None:
            await asyncio.to_thread(proc.wait)
        self._proc = None
        # SIGKILL is delivered asynchronously; return only when the group is really gone (bounded).
        for _ in range(_GROUP_EXIT_POLLS):
            if not group_alive(pgid):
                # Its workers, orphaned when the engine died, were adopted (``become_subreaper``):
                # reaped now, not when the agent exits (a crash-looping engine piled them up).
                reap_group(pgid)
                return
            await asyncio.sleep(_GROUP_EXIT_POLL_S)
        log.warning("processes of the engine's group %d still run after SIGKILL", pgid)

    async def stop(self) -> None:
        """Stop supervising and stop the engine (if the agent launched it)."""
        self._set_state("stopped")
        await self._terminate()
