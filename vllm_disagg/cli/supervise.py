"""What ``up`` does when a child process dies: the restart policy (pure) and the supervisor (I/O).

A child is a ``ChildSpec``: a name (``orchestrator``, ``agent decode-0``; a replica is one more spec),
its command line and environment. ``Supervisor`` starts the specs, watches each child, and when one
exits asks ``after_exit`` what to do:

- exit 0 (it stopped on its own: SIGTERM, or an agent told to shut down), 2 (a configuration error:
  the same command line fails the same way) or 3 (an agent the orchestrator refuses, ``EXIT_REFUSED``:
  a restart would be refused again): **leave it**;
- any other code, or a signal (a negative code: SIGKILL is -9, the OOM killer's too): a **crash**,
  restarted with the same command line after a backoff (``RestartPolicy``), unless it is the K-th crash
  within W seconds, where it **gives up**. Giving up on an ``essential`` child (the orchestrator) ends
  the supervisor, and ``up`` with it; essential children of one ``group`` (replicas of the
  orchestrator) end it only when the last of them has left.

Each decision is said in one line and noted in the orchestrator's event log (``EventLog``: ``POST
/admin/v1/events`` to the first orchestrator replica that answers; a note that cannot be posted is
said, never fatal).
A stop (``Supervisor.stop``) is never taken for a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import aiohttp

from vllm_disagg.agent.session import EXIT_REFUSED
from vllm_disagg.clock import Clock, SystemClock, wait_event
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import admin_headers
from vllm_disagg.procfs import group_members
from vllm_disagg.runtime import child_env, die_with_parent, signal_group

EXIT_CONFIG = 2  # ``vllm-disagg``'s exit code for a bad flag or configuration (cli/commands.py)
# Exit codes that are not crashes, and why a restart would not help.
FINAL_EXITS: Mapping[int, str] = {
    0: "it stopped on its own",
    EXIT_CONFIG: "a configuration error (the same command line would fail the same way)",
    EXIT_REFUSED: "refused by the orchestrator (a restart would be refused again)",
}
# A follower's answers while the leader changes: 503 (no leader now), 502 and 504 (the leader it
# forwarded to did not answer: it died, and its lease has not yet expired). A note waits them out.
_FAILOVER = frozenset({502, 503, 504})
_GONE_POLL_S = 0.02
_GONE_POLLS = 250  # up to 5 s for the kernel to finish SIGKILLed processes

Action = Literal["restart", "leave", "give_up"]


# --- the policy (pure) --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When to restart a crashed child, and when to give up on it.

    Defaults: the first restart after 0.5 s (long enough that a child dying at start-up does not spin
    a core; short against the 1 s heartbeat timeout ``up`` gives agents, so a SIGKILLed agent is
    back about as soon as it is missed), doubling to 10 s for a child that keeps crashing (a
    slow-crashing one costs at most a start every 10 s). A child up for 30 s had started fine (a
    simulated cluster is ready in seconds), so its next crash starts the backoff again. Five crashes
    within 60 s give up: a child failing at start-up crashes 5 times in about 8 s of backoff plus 5
    starts, well inside the window, so a deterministic failure ends in seconds with its reason, while
    4 crashes a minute are still restarted. (systemd's default is 5 starts in 10 s, with 0.1 s
    between: a shorter window for a shorter backoff.)
    """

    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    stable_after_s: float = 30.0  # up this long: the next crash is a first one again (backoff_s)
    max_crashes: int = 5  # the K-th crash within window_s gives up; 1: never restart
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_crashes < 1:
            raise ConfigError(f"--max-crashes must be at least 1 (1: never restart), got {self.max_crashes}")
        if not self.window_s > 0:
            raise ConfigError(f"--crash-window-s must be > 0, got {self.window_s}")
        if not 0 < self.backoff_s <= self.backoff_max_s:
            raise ConfigError(f"restart backoff needs 0 < {self.backoff_s} <= {self.backoff_max_s}")
        if self.stable_after_s < 0:
            raise ConfigError(f"stable_after_s must be >= 0, got {self.stable_after_s}")

    def backoff(self, streak: int) -> float:
        """Seconds before the restart that follows crash number ``streak`` (1, 2, ...) in a row."""
        return float(min(self.backoff_max_s, self.backoff_s * 2.0 ** min(max(streak, 1) - 1, 62)))


@dataclass(frozen=True, slots=True)
class CrashHistory:
    """One child's crashes so far."""

    crashes: tuple[float, ...] = ()  # when, within the policy's window of the latest
    streak: int = 0  # crashes in a row without staying up ``stable_after_s``
    restarts: int = 0  # restarts so far


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do about a child that exited, and its history from now on."""

    action: Action
    history: CrashHistory
    delay_s: float = 0.0  # before the restart
    reason: str = ""  # why it is left or given up on


def after_exit(
    policy: RestartPolicy, history: CrashHistory, code: int, *, up_s: float, now: float
) -> Verdict:
    """The verdict on a child that exited with ``code`` after running ``up_s`` seconds, at ``now``."""
    if code in FINAL_EXITS:
        return Verdict("leave", history, reason=FINAL_EXITS[code])
    streak = 1 if up_s >= policy.stable_after_s else history.streak + 1
    crashes = (*(t for t in history.crashes if now - t < policy.window_s), now)
    if len(crashes) >= policy.max_crashes:
        times = "once" if len(crashes) == 1 else f"{len(crashes)} times"
        reason = f"crashed {times} in {policy.window_s:g} s"
        return Verdict("give_up", CrashHistory(crashes, streak, history.restarts), reason=reason)
    restarts = history.restarts + 1
    return Verdict("restart", CrashHistory(crashes, streak, restarts), delay_s=policy.backoff(streak))


def exit_line(name: str, code: int, verdict: Verdict, consequence: str) -> str:
    """What the supervisor says about an exit, e.g. ``agent decode-0 exited (code -9); restarting in
    0.5 s (restart 1)``."""
    if verdict.action == "restart":
        delay, count = verdict.delay_s, verdict.history.restarts
        return f"{name} exited (code {code}); restarting in {delay:g} s (restart {count})"
    if verdict.action == "give_up":
        return f"{name} {verdict.reason} (last: code {code}); giving up: {consequence}"
    return f"{name} exited (code {code}): {verdict.reason}; not restarting: {consequence}"


@dataclass(frozen=True, slots=True)
class Note:
    """A supervisor's note for the orchestrator's event log (``POST /admin/v1/events``)."""

    process: str
    action: Literal["restarted", "gave_up"]
    message: str
    exit_code: int
    restarts: int

    def to_json(self) -> dict[str, Any]:
        """The request body."""
        return {
            "process": self.process,
            "action": self.action,
            "message": self.message,
            "exit_code": self.exit_code,
            "restarts": self.restarts,
        }


# --- children and how they are started ----------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """One supervised child: how to start it again, and what giving up on it means."""

    name: str  # said in lines and notes: "orchestrator", "agent decode-0"
    argv: tuple[str, ...]
    env: Mapping[str, str] | None = field(default=None, repr=False)  # None: ours minus the secrets
    stage: int = 0  # started by ascending stage, stopped by descending (agents before the orchestrator)
    essential: bool = False  # giving up on it ends the supervisor (in a group: on the group's last)
    consequence: str = "it stays down"  # what giving up means, for the line
    # Essential children of one group (orchestrator replicas) end the supervisor only when the last of
    # them leaves; its line then says ``last_consequence``. "": a group of its own.
    group: str = ""
    last_consequence: str = ""
    # Before a restart: end what the dead child left outside its process group (an agent's engine).
    cleanup: Callable[[], Awaitable[None]] | None = field(default=None, compare=False)
    # Awaited once the child first started, before the next stage starts (an embedded etcd answering
    # its health check); it raises ``StartFailed`` to fail the start.
    ready: Callable[[Child], Awaitable[None]] | None = field(default=None, compare=False)


class StartFailed(Exception):
    """A child did not come up at the start (``ChildSpec.ready``): the message says why."""


class Child(Protocol):
    """A running child: ``asyncio.subprocess.Process``, or a test's stand-in."""

    @property
    def pid(self) -> int:
        """Its pid (it leads its own process group)."""
        ...

    @property
    def returncode(self) -> int | None:
        """Its exit code once it exited (negative: the signal that ended it)."""
        ...

    async def wait(self) -> int:
        """Its exit code, once it exits."""
        ...


class Launcher(Protocol):
    """How the supervisor starts, stops and clears up after children (``ProcessLauncher``)."""

    async def start(self, spec: ChildSpec) -> Child:
        """Start ``spec``'s child."""
        ...

    async def stop(self, children: Sequence[Child], grace_s: float) -> None:
        """Stop these children, each with what it started in its group."""
        ...

    async def reap(self, child: Child) -> None:
        """After ``child`` exited: end whatever it left running in its process group."""
        ...


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


async def stop_processes(children: Sequence[Child], grace_s: float) -> None:
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


async def until_groups_gone(pgids: set[int], timeout_s: float = _GONE_POLLS * _GONE_POLL_S) -> bool:
    """Poll until no live process is in these groups, for at most ``timeout_s``; whether they are gone."""
    for _ in range(max(1, round(timeout_s / _GONE_POLL_S))):
        if not group_members(pgids):
            return True
        await asyncio.sleep(_GONE_POLL_S)  # the OS, not the clock: a fake clock would never move
    return not group_members(pgids)


def session_leaders_with(args: Sequence[str]) -> list[int]:
    """Live processes that lead their own process group and whose command line holds ``args`` in a
    row: how an engine a SIGKILLed agent left behind is found (``--port``, its port)."""
    needle = "\x00" + "\x00".join(args) + "\x00"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = "\x00" + Path(f"/proc/{entry}/cmdline").read_text(errors="replace")
        except OSError:
            continue
        if stat[0] != "Z" and int(stat[2]) == int(entry) and needle in cmdline:
            found.append(int(entry))
    return found


async def end_groups(pgids: list[int], grace_s: float) -> None:
    """SIGTERM these process groups, SIGKILL them if still there after ``grace_s``; return once gone."""
    if not pgids:
        return
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    await until_groups_gone(set(pgids), grace_s)
    for pgid in pgids:
        signal_group(pgid, signal.SIGKILL)
    await until_groups_gone(set(pgids))


class ProcessLauncher:
    """Real children: each leads its own process group and dies with this process (``spawn``)."""

    async def start(self, spec: ChildSpec) -> Child:
        """``spawn`` the spec's command line."""
        return await spawn(list(spec.argv), env=None if spec.env is None else dict(spec.env))

    async def stop(self, children: Sequence[Child], grace_s: float) -> None:
        """``stop_processes``."""
        await stop_processes(children, grace_s)

    async def reap(self, child: Child) -> None:
        """SIGKILL what is left of the child's group (a crashed orchestrator's gateway workers would
        hold its port), and wait until it is gone."""
        signal_group(child.pid, signal.SIGKILL)
        await until_groups_gone({child.pid})


# --- the supervisor -----------------------------------------------------------------------------


def print_line(line: str, error: bool) -> None:
    """Say a supervisor's line as ``up`` does: ``up: ...``, on stderr when it gives up."""
    print(f"up: {line}", file=sys.stderr if error else sys.stdout, flush=True)


class Supervisor:
    """Starts the children, restarts those that crash (``after_exit``), stops them all on ``stop()``.

    ``ended`` is set when an essential child is given up on or leaves (``end_reason``, ``end_code``);
    ``left`` holds every child not running any more, with why.
    """

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        policy: RestartPolicy,
        *,
        launcher: Launcher | None = None,
        clock: Clock | None = None,
        say: Callable[[str, bool], None] = print_line,
        note: Callable[[Note], None] | None = None,
        stop_grace_s: float = 10.0,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self._specs = list(specs)
        self._policy = policy
        self._launcher: Launcher = launcher or ProcessLauncher()
        self._clock: Clock = clock or SystemClock()
        self._say = say
        self._note = note or (lambda _: None)
        self._stop_grace_s = stop_grace_s
        self._children: dict[str, Child] = {}
        self._history: dict[str, CrashHistory] = {s.name: CrashHistory() for s in specs}
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self.ended = asyncio.Event()
        self.end_reason = ""
        self.end_code = 0
        self.left: dict[str, str] = {}

    def pid(self, name: str) -> int | None:
        """The pid of the child ``name`` runs as now (None before it started)."""
        child = self._children.get(name)
        return child.pid if child is not None else None

    def restarts(self, name: str) -> int:
        """How many times ``name`` was restarted."""
        return self._history[name].restarts

    async def start(self) -> None:
        """Start every child, stage by stage, then watch them; ``StartFailed`` from a child's ``ready``
        (the children started so far are left to ``stop``)."""
        for stage in sorted({s.stage for s in self._specs}):
            for spec in self._specs:
                if spec.stage == stage:
                    self._children[spec.name] = await self._launcher.start(spec)
            for spec in self._specs:
                if spec.stage == stage and spec.ready is not None:
                    await spec.ready(self._children[spec.name])
        self._watchers = [asyncio.ensure_future(self._watch(s)) for s in self._specs]

    async def stop(self) -> None:
        """Stop supervising (no exit from now on is a crash), then the children, the last stage first."""
        self._stopping.set()
        for stage in sorted({s.stage for s in self._specs}, reverse=True):
            names = [s.name for s in self._specs if s.stage == stage and s.name in self._children]
            children = [self._children[name] for name in names]
            await self._launcher.stop(children, self._stop_grace_s)
        # Each watcher returns once its child exits or its restart wait sees the stop; bounded anyway.
        if self._watchers:
            _, pending = await asyncio.wait(self._watchers, timeout=self._stop_grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self._watchers, return_exceptions=True)

    async def _watch(self, spec: ChildSpec) -> None:
        try:
            await self._supervise(spec)
        except Exception as exc:  # a bug here must not pass for a healthy child
            line = f"supervising {spec.name} failed: {exc!r}; it is not restarted any more"
            self._say(line, True)
            self.left[spec.name] = line
            if self._ends(spec) and not self.ended.is_set():
                self.end_reason, self.end_code = line, 1
                self.ended.set()

    def _ends(self, spec: ChildSpec) -> bool:
        """Whether ``spec`` having left ends the supervisor: it is essential and no essential child of
        its group is still there (running, or waiting for its restart)."""
        if not spec.essential:
            return False
        group = spec.group or spec.name
        return all(s.name in self.left for s in self._specs if s.essential and (s.group or s.name) == group)

    async def _supervise(self, spec: ChildSpec) -> None:
        while True:
            child = self._children[spec.name]
            started = self._clock.monotonic()
            code = await child.wait()
            if self._stopping.is_set():
                return
            now = self._clock.monotonic()
            verdict = after_exit(self._policy, self._history[spec.name], code, up_s=now - started, now=now)
            self._history[spec.name] = verdict.history
            if verdict.action == "restart":
                self._say(exit_line(spec.name, code, verdict, spec.consequence), False)
            # Restarted or not, nothing it started may live on (nor hold the ports a restart needs).
            await self._launcher.reap(child)
            if spec.cleanup is not None:
                await spec.cleanup()
            if verdict.action != "restart":
                self._finish(spec, code, verdict)
                return
            restart_at = now + verdict.delay_s
            if await wait_event(self._clock, self._stopping, max(0.0, restart_at - self._clock.monotonic())):
                return
            try:
                child = await self._launcher.start(spec)
            except OSError as exc:  # the command itself is gone: nothing to retry
                self._finish(spec, code, Verdict("give_up", verdict.history, reason=f"cannot restart: {exc}"))
                return
            self._children[spec.name] = child
            if self._stopping.is_set():  # stopped while it started: ``stop`` did not see it
                await self._launcher.stop([child], self._stop_grace_s)
                return
            message = f"exited (code {code}); restarted after {verdict.delay_s:g} s"
            self._note(Note(spec.name, "restarted", message, code, verdict.history.restarts))

    def _finish(self, spec: ChildSpec, code: int, verdict: Verdict) -> None:
        """A child left for good: say so, note it (unless it stopped on its own, or nobody is left to
        note it to), end the supervisor if it was the last essential one of its group."""
        self.left[spec.name] = ""
        ends = self._ends(spec)
        consequence = spec.last_consequence if ends and spec.last_consequence else spec.consequence
        line = exit_line(spec.name, code, verdict, consequence)
        self._say(line, code != 0)
        self.left[spec.name] = line
        if code != 0 and not ends:  # the end of the last orchestrator is the end of the event log too
            message = f"{verdict.reason}; gave up: {consequence}"
            self._note(Note(spec.name, "gave_up", message, code, verdict.history.restarts))
        if ends and not self.ended.is_set():
            self.end_reason, self.end_code = line, 0 if code == 0 else 1
            self.ended.set()


# --- the event log ------------------------------------------------------------------------------


class EventLog:
    """Posts notes to the orchestrator's event log in order, each to the first of ``bases`` that answers
    (``/health/live``: after its own restart, that is the new one). With replicas any of them will
    do: a follower forwards the note to the leader, and one that cannot now (a failover under way)
    is asked again. A note not posted within ``wait_s`` is said and dropped, never fatal."""

    def __init__(
        self,
        bases: str | Sequence[str],
        token: str,
        *,
        wait_s: float = 60.0,
        say: Callable[[str, bool], None] = print_line,
    ) -> None:
        self._bases = [bases] if isinstance(bases, str) else list(bases)
        if not self._bases:
            raise ValueError("EventLog needs at least one orchestrator URL")
        self._token = token
        self._wait_s = wait_s  # how long a note waits for an orchestrator to take it
        self._say = say
        self._queue: asyncio.Queue[Note] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.posted = 0

    def note(self, note: Note) -> None:
        """Queue ``note`` for posting."""
        self._queue.put_nowait(note)
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Stop posting (notes still queued are dropped)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                note = await self._queue.get()
                try:
                    await self._post(http, note)
                except Exception as exc:  # supervision goes on whatever the event log does
                    what = f"{note.process} {note.action}"
                    self._say(f"could not note '{what}' in the event log: {exc!r}", True)

    async def _post(self, http: aiohttp.ClientSession, note: Note) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_s
        busy = ""
        while True:
            for base in list(self._bases):
                answer = await self._post_to(http, base, note)
                if answer is None:
                    # The one that took it goes first next time.
                    self._bases.remove(base)
                    self._bases.insert(0, base)
                    self.posted += 1
                    return
                busy = answer or busy
            if loop.time() > deadline:
                why = f" (last: {busy})" if busy else ""
                raise TimeoutError(f"the orchestrator did not answer within {self._wait_s:g} s{why}")
            await asyncio.sleep(0.05)  # real I/O paced, not a decision: the loop's clock

    async def _post_to(self, http: aiohttp.ClientSession, base: str, note: Note) -> str | None:
        """None once ``base`` took the note; "" while it does not answer, the reason while it answers
        a failover's status (a follower with no leader yet, or whose leader just died). Any other
        refusal raises."""
        if not await self._answers(http, base):
            return ""
        url = f"{base}/admin/v1/events"
        try:
            async with http.post(url, json=note.to_json(), headers=admin_headers(self._token)) as resp:
                if resp.status == 201:
                    return None
                text = (await resp.text())[:200]
        except aiohttp.ClientConnectorError:
            return ""  # gone between the two calls: another may take it (a later error may have
            # reached it, and is raised rather than posted twice)
        if resp.status in _FAILOVER:
            return f"{url}: {resp.status} {text}"
        raise RuntimeError(f"POST {url}: {resp.status} {text}")

    async def _answers(self, http: aiohttp.ClientSession, base: str) -> bool:
        try:
            async with http.get(f"{base}/health/live") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
