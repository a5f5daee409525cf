"""``up``'s supervisor on real processes and real signals, and its notes to a real HTTP event log."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.helpers import eventually, free_port
from vllm_disagg.cli.supervise import (
    ChildSpec,
    EventLog,
    Note,
    RestartPolicy,
    Supervisor,
    end_groups,
    session_leaders_with,
)

FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_crashes=3, window_s=60)


def python(code: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code, *args)


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class Said:
    """What a supervisor said, line by line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, bool]] = []

    def __call__(self, line: str, error: bool) -> None:
        self.lines.append((line, error))

    def text(self) -> list[str]:
        return [line for line, _ in self.lines]


async def test_a_child_that_exits_1_at_once_is_restarted_then_given_up_with_the_reason() -> None:
    said, notes = Said(), list[Note]()
    spec = ChildSpec(
        "orchestrator", python("raise SystemExit(1)"), essential=True, consequence="stopping the cluster"
    )
    supervisor = Supervisor([spec], FAST, say=said, note=notes.append, stop_grace_s=2)
    await supervisor.start()
    try:
        await eventually(supervisor.ended.is_set, timeout=30, what="the supervisor gives up")
    finally:
        await supervisor.stop()
    assert said.text() == [
        "orchestrator exited (code 1); restarting in 0.05 s (restart 1)",
        "orchestrator exited (code 1); restarting in 0.1 s (restart 2)",
        "orchestrator crashed 3 times in 60 s (last: code 1); giving up: stopping the cluster",
    ]
    assert (supervisor.end_code, supervisor.end_reason) == (1, said.text()[-1])
    assert [(n.action, n.restarts) for n in notes] == [("restarted", 1), ("restarted", 2)]


# A child that leaves two processes behind when it is SIGKILLed: one in its own process group, one
# leading its own (as an agent's engine does) that ignores SIGTERM. It writes their pids to argv[1].
LEAVES_PROCESSES = """
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
grandchild = subprocess.Popen(sleeper)
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
engine = subprocess.Popen([sys.executable, "-c", stubborn, "--port", sys.argv[2]], start_new_session=True)
open(sys.argv[1], "a").write(f"{grandchild.pid} {engine.pid}\\n")
time.sleep(120)
"""


@pytest.fixture
def pids(tmp_path: Path) -> Iterator[Path]:
    """The file the children write their pids to; every pid in it is SIGKILLed at the end."""
    path = tmp_path / "pids"
    try:
        yield path
    finally:
        for pid in path.read_text().split() if path.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


async def test_a_sigkilled_child_is_restarted_once_what_it_left_running_is_gone(pids: Path) -> None:
    port = str(free_port())
    said = Said()
    ended_first: list[bool] = []

    async def end_engine() -> None:
        ended_first.append(True)
        await end_groups(session_leaders_with(("--port", port)), grace_s=0.5)

    spec = ChildSpec("agent a", python(LEAVES_PROCESSES, str(pids), port), cleanup=end_engine)
    supervisor = Supervisor([spec], FAST, say=said, stop_grace_s=2)
    await supervisor.start()
    try:

        def spawned(n: int) -> Callable[[], list[list[int]] | None]:
            def probe() -> list[list[int]] | None:
                lines = pids.read_text().splitlines() if pids.exists() else []
                return [[int(p) for p in line.split()] for line in lines] if len(lines) >= n else None

            return probe

        [[grandchild, engine]] = await eventually(spawned(1), timeout=30, what="the child's processes")
        assert session_leaders_with(("--port", port)) == [engine]
        first = supervisor.pid("agent a")
        assert first is not None
        os.kill(first, signal.SIGKILL)
        runs = await eventually(spawned(2), timeout=30, what="the restarted child's processes")
        assert ended_first == [True]
        assert gone(grandchild), "its process group was SIGKILLed"
        assert gone(engine), "the process it left on its port was SIGKILLed after ignoring SIGTERM"
        assert session_leaders_with(("--port", port)) == [runs[1][1]], "one engine on the port: the new one"
        assert supervisor.pid("agent a") not in (None, first) and supervisor.restarts("agent a") == 1
        assert said.text() == ["agent a exited (code -9); restarting in 0.05 s (restart 1)"]
    finally:
        await supervisor.stop()
    assert len(said.lines) == 1, "a stop is no crash"


async def test_a_child_that_exits_0_is_left_and_a_stop_kills_without_a_restart() -> None:
    said = Said()
    specs = [
        ChildSpec("agent done", python("raise SystemExit(0)"), consequence="its instance leaves routing"),
        ChildSpec("agent sleeper", python("import time; time.sleep(120)")),
    ]
    supervisor = Supervisor(specs, FAST, say=said, stop_grace_s=2)
    await supervisor.start()
    try:
        await eventually(lambda: "agent done" in supervisor.left, timeout=30, what="the clean exit")
        sleeper = supervisor.pid("agent sleeper")
        assert sleeper is not None
    finally:
        await supervisor.stop()
    assert said.text() == [
        "agent done exited (code 0): it stopped on its own; not restarting: its instance leaves routing"
    ]
    assert gone(sleeper)


# --- the event log ------------------------------------------------------------------------------


class FakeOrchestrator:
    """``/health/live`` and ``POST /admin/v1/events``: records each note; ``refuse`` answers 400."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.notes: list[tuple[str, dict[str, Any]]] = []
        self.refuse = False
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health/live", self._live)
        app.router.add_post("/admin/v1/events", self._event)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _event(self, request: web.Request) -> web.Response:
        if self.refuse:
            return web.json_response({"error": {"message": "no"}}, status=400)
        self.notes.append((request.headers.get("Authorization", ""), await request.json()))
        return web.json_response({}, status=201)


async def test_a_note_waits_for_the_orchestrator_to_answer_and_a_refused_one_does_not_stop_the_next() -> None:
    port = free_port()
    said = Said()
    log = EventLog(f"http://127.0.0.1:{port}", "secret", say=said)
    orchestrator = FakeOrchestrator(port)
    restarted = Note("orchestrator", "restarted", "exited (code -9); restarted after 0.5 s", -9, 1)
    try:
        log.note(restarted)  # nothing listens yet: the orchestrator is restarting
        await orchestrator.start()
        await eventually(lambda: orchestrator.notes, timeout=10, what="the note")
        assert orchestrator.notes == [("Bearer secret", restarted.to_json())]
        orchestrator.refuse = True
        log.note(Note("agent a", "gave_up", "crashed 5 times in 60 s", 1, 4))
        await eventually(lambda: said.lines, timeout=10, what="the refusal said")
        assert "could not note 'agent a gave_up' in the event log" in said.lines[0][0] and said.lines[0][1]
        orchestrator.refuse = False
        log.note(Note("agent b", "restarted", "exited (code -9); restarted after 0.5 s", -9, 1))
        await eventually(lambda: len(orchestrator.notes) == 2, timeout=10, what="the next note")
        assert log.posted == 2
    finally:
        await log.close()
        await orchestrator.close()


async def test_a_note_for_an_orchestrator_that_never_answers_is_dropped_with_a_line() -> None:
    said = Said()
    log = EventLog(f"http://127.0.0.1:{free_port()}", "secret", wait_s=0.2, say=said)
    try:
        log.note(Note("agent a", "restarted", "exited (code -9); restarted after 0.5 s", -9, 1))
        await eventually(lambda: said.lines, timeout=10, what="the note given up")
        assert "did not answer within 0.2 s" in said.lines[0][0]
    finally:
        await log.close()
