"""``up`` restarts what it starts: a SIGKILLed agent or orchestrator comes back, a crash loop is given up
on with the reason, and a stop of ``up`` is never taken for a crash.

Every process is real (``up``, the orchestrator, agents, simulated engines); the children are found
as ``up``'s, by their command lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.up_support import Cluster, start_up, stop
from tests.helpers import ADMIN, eventually, http_json
from vllm_disagg.cli.supervise import session_leaders_with
from vllm_disagg.sim_engine.textgen import expected_text

MODEL = "sim-model"
RECOVERY_S = 60.0  # starting Python processes on a loaded 2-core machine


@dataclass(frozen=True)
class UpLog:
    """Where ``start_up`` writes ``up``'s output: a fixture with a ``log`` is shown when a test fails
    (tests/e2e/conftest.py)."""

    log: Path


@pytest.fixture
def up_log(tmp_path: Path) -> UpLog:
    return UpLog(tmp_path / "up.log")


def up_child(cluster: Cluster, *words: str) -> int | None:
    """The pid of ``up``'s child whose command line holds ``words`` in a row, None if none does."""
    needle = "\x00" + "\x00".join(words) + "\x00"
    for children in Path(f"/proc/{cluster.proc.pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            for pid in children.read_text().split():
                with contextlib.suppress(OSError):
                    cmdline = "\x00" + Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    if needle in cmdline and stat[0] != "Z":
                        return int(pid)
    return None


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def said(cluster: Cluster, line: str) -> bool:
    return line in cluster.log.read_text(errors="replace").splitlines()


def supervisor_events(cluster: Cluster) -> list[dict[str, Any]]:
    """The ``supervisor`` events in the event log of the orchestrator serving now."""
    status, body = http_json(f"{cluster.base}/admin/v1/events?follow=false", headers=ADMIN)
    assert status == 200, body
    events = [json.loads(line[6:]) for line in str(body).splitlines() if line.startswith("data: ")]
    return [e for e in events if e.get("kind") == "supervisor"]


def instance(cluster: Cluster, agent_id: str) -> dict[str, Any] | None:
    return next((i for i in cluster.instances() if i["agent_id"] == agent_id), None)


async def complete(http: aiohttp.ClientSession, base: str, prompt: str) -> tuple[int, str, str]:
    """One completion: (status, text, decode instance)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, raw.decode(errors="replace"), ""
        return 200, json.loads(raw)["choices"][0]["text"], resp.headers.get("X-Disagg-Decode", "")


def supervisor_lines(cluster: Cluster) -> list[str]:
    """What ``up``'s supervisor said: restarts, and giving up."""
    lines = cluster.log.read_text(errors="replace").splitlines()
    return [
        line for line in lines if line.startswith("up: ") and ("restarting in" in line or "giving up" in line)
    ]


async def test_a_sigkilled_agent_comes_back_with_its_id_in_a_new_session_and_serves(
    tmp_path: Path, up_log: UpLog
) -> None:
    running = start_up(tmp_path, prefill=1, decode=1)
    try:
        before = instance(running, "decode-0")
        assert before is not None and before["state"] == "ready"
        port = int(before["url"].rsplit(":", 1)[1])
        agent = up_child(running, "--agent-id", "decode-0")
        [engine] = session_leaders_with(("--port", str(port)))
        assert agent is not None
        killed = time.monotonic()
        os.kill(agent, signal.SIGKILL)

        await eventually(
            lambda: said(running, "up: agent decode-0 exited (code -9); restarting in 0.5 s (restart 1)"),
            timeout=RECOVERY_S,
            what="the restart line",
        )

        def back() -> bool:
            now = instance(running, "decode-0")
            return now is not None and now["state"] == "ready" and now["session"] > before["session"]

        await eventually(back, timeout=RECOVERY_S, what="decode-0 ready again in a new session")
        print(f"agent restart: decode-0 ready again {time.monotonic() - killed:.2f} s after the kill")
        again = up_child(running, "--agent-id", "decode-0")
        assert again not in (None, agent)
        assert gone(engine), "the old engine is gone"
        assert len(session_leaders_with(("--port", str(port)))) == 1, "one engine on its port: the new one"
        [event] = supervisor_events(running)
        assert (event["process"], event["action"], event["exit_code"], event["restarts"]) == (
            "agent decode-0",
            "restarted",
            -9,
            1,
        )
        async with aiohttp.ClientSession() as http:
            for i in range(5):
                prompt = f"after the restart {i}"
                assert await complete(http, running.base, prompt) == (
                    200,
                    expected_text(prompt, 4),
                    "decode-0",
                )
    finally:
        assert stop(running) == 0
    assert supervisor_lines(running) == [
        "up: agent decode-0 exited (code -9); restarting in 0.5 s (restart 1)"
    ], "one restart, and none when up stopped"


async def test_a_sigkilled_orchestrator_comes_back_on_its_port_and_the_agents_register_again(
    tmp_path: Path, up_log: UpLog
) -> None:
    running = start_up(tmp_path, prefill=1, decode=1)
    outcomes: list[tuple[float, int]] = []  # (when sent, status; 0: no connection)
    done = asyncio.Event()

    async def trickle(http: aiohttp.ClientSession) -> None:
        n = 0
        while not done.is_set():
            n += 1
            sent = time.monotonic()
            try:
                status, text, _ = await complete(http, running.base, f"trickle {n}")
                assert status != 200 or text == expected_text(f"trickle {n}", 4)
            except aiohttp.ClientError:
                status = 0
            outcomes.append((sent, status))
            await asyncio.sleep(0.05)  # a trickle, paced: 20 requests a second at most

    # force_close: each request a new connection, as a client meeting a restarted server would make.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        load = asyncio.ensure_future(trickle(http))
        try:
            await eventually(lambda: any(s == 200 for _, s in outcomes), timeout=30, what="requests served")
            old = up_child(running, "orchestrator")
            assert old is not None
            killed = time.monotonic()
            os.kill(old, signal.SIGKILL)
            await eventually(
                lambda: said(running, "up: orchestrator exited (code -9); restarting in 0.5 s (restart 1)"),
                timeout=RECOVERY_S,
                what="the restart line",
            )

            def both_ready() -> bool:
                states = {i["agent_id"]: i["state"] for i in running.instances()}
                return states == {"prefill-0": "ready", "decode-0": "ready"}

            await eventually(both_ready, timeout=RECOVERY_S, what="the agents registered again")
            registered = time.monotonic()
            assert up_child(running, "orchestrator") not in (None, old)
            await eventually(
                lambda: any(t > killed and s == 200 for t, s in outcomes), timeout=RECOVERY_S, what="served"
            )
        finally:
            done.set()
            await load
        failed = [(t - killed, s) for t, s in outcomes if t > killed and s != 200]
        served = [t - killed for t, s in outcomes if t > killed and s == 200]
        refused = [t for t, s in failed if s == 0]
        print(
            f"orchestrator restart: first success {served[0]:.2f} s after the kill; no connection until "
            f"{max(refused, default=0):.2f} s ({len(refused)} requests), then {len(failed) - len(refused)} "
            f"answered {sorted({s for _, s in failed if s})}"
        )
        assert all(t + killed < registered for t, _ in failed), "once both registered again, nothing fails"
        for i in range(3):
            assert (await complete(http, running.base, f"after {i}"))[:2] == (
                200,
                expected_text(f"after {i}", 4),
            )
    try:
        events = supervisor_events(running)
        assert [(e["process"], e["action"], e["exit_code"]) for e in events] == [
            ("orchestrator", "restarted", -9)
        ], "noted in the new orchestrator's event log"
    finally:
        assert stop(running) == 0
    assert supervisor_lines(running) == [
        "up: orchestrator exited (code -9); restarting in 0.5 s (restart 1)"
    ], "one restart, and none when up stopped"


# Started by every Python process ``up`` starts (PYTHONPATH): agent decode-0 exits 1 at once while
# the marker file exists, as an agent crashing at start-up would.
CRASHING_AGENT = """
import os
_argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
if b"agent" in _argv and b"decode-0" in _argv and os.path.exists({marker!r}):
    os._exit(1)
"""


async def test_an_agent_crashing_again_and_again_is_given_up_on_and_the_cluster_serves_on(
    tmp_path: Path, up_log: UpLog
) -> None:
    marker = tmp_path / "crash-decode-0"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CRASHING_AGENT.format(marker=str(marker)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    running = start_up(tmp_path, 1, 2, "--max-crashes", "3", "--crash-window-s", "60", env=env)
    try:
        agent = up_child(running, "--agent-id", "decode-0")
        assert agent is not None
        marker.touch()
        os.kill(agent, signal.SIGKILL)
        give_up = (
            "up: agent decode-0 crashed 3 times in 60 s (last: code 1); "
            "giving up: its instance leaves routing"
        )
        await eventually(lambda: said(running, give_up), timeout=RECOVERY_S, what="up gives up")
        assert said(running, "up: agent decode-0 exited (code -9); restarting in 0.5 s (restart 1)")
        assert said(running, "up: agent decode-0 exited (code 1); restarting in 1 s (restart 2)")

        def agent_events() -> list[dict[str, Any]] | None:  # up posts each after it says it
            events = [e for e in supervisor_events(running) if e["process"] == "agent decode-0"]
            return events if any(e["action"] == "gave_up" for e in events) else None

        events = await eventually(agent_events, timeout=RECOVERY_S, what="the give-up event posted")
        assert [(e["action"], e["exit_code"], e["restarts"]) for e in events] == [
            ("restarted", -9, 1),
            ("restarted", 1, 2),
            ("gave_up", 1, 2),
        ]
        assert "crashed 3 times in 60 s" in events[-1]["message"]
        assert up_child(running, "--agent-id", "decode-0") is None and running.proc.poll() is None
        await eventually(
            lambda: (instance(running, "decode-0") or {}).get("state") == "dead",
            timeout=RECOVERY_S,
            what="decode-0 out of routing",
        )
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                prompt = f"without decode-0 {i}"
                assert await complete(http, running.base, prompt) == (
                    200,
                    expected_text(prompt, 4),
                    "decode-1",
                )
    finally:
        assert stop(running) == 0
    assert supervisor_lines(running) == [
        "up: agent decode-0 exited (code -9); restarting in 0.5 s (restart 1)",
        "up: agent decode-0 exited (code 1); restarting in 1 s (restart 2)",
        give_up,
    ], "nothing else restarted, and nothing when up stopped"
