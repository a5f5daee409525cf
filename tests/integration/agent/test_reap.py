"""An engine's workers, orphaned when it dies, are reaped when it is restarted, not when the agent exits.

vLLM's API server runs its engine core (and that its workers) as child processes. When the server is
killed, the agent adopts them (it is their subreaper) and kills them with the engine's group; each
was left a zombie until the agent exited, one more per crash. The supervisor runs here in a process
of its own, which becomes a subreaper as the agent does (pytest's own process must not).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_disagg.runtime import child_env

DEADLINE_S = 60.0

# A supervisor whose engine forks a worker (as vLLM's server forks its engine core): the engine is
# SIGKILLed, the supervisor restarts it, and the process's zombie children are printed.
SUPERVISED = """
import asyncio, json, os, signal, sys, time
from pathlib import Path
import aiohttp
from tests.helpers import free_port
from vllm_disagg.agent.engine import EngineSupervisor
from vllm_disagg.agent.engine_command import EngineCommand
from vllm_disagg.clock import SystemClock
from vllm_disagg.config import AgentConfig
from vllm_disagg.runtime import become_subreaper

ENGINE = '''
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()} {worker.pid}\\\\n")
time.sleep(600)
'''

class Forking(EngineCommand):
    kind = "forking"
    def argv(self, cfg):
        return [sys.executable, "-c", ENGINE, sys.argv[1]]

def started():
    path = Path(sys.argv[1])
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []

def children():
    tasks = Path(f"/proc/{os.getpid()}/task").glob("*/children")
    return [int(child) for t in tasks for child in t.read_text().split()]

def zombie_children():
    stat = lambda pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return [pid for pid in children() if stat(pid)[0] == "Z"]

async def until(condition):
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)

async def main():
    become_subreaper()
    cfg = AgentConfig(agent_id="a", role="both", engine_port=free_port(), scrape_interval_s=0.05,
                      stop_grace_s=0.5, restart_backoff_s=0.05)
    async with aiohttp.ClientSession() as http:
        supervisor = EngineSupervisor(cfg, http, SystemClock(), command=Forking())
        task = asyncio.create_task(supervisor.run())
        await until(lambda: len(started()) == 1)
        engine, worker = started()[0]
        os.kill(engine, signal.SIGKILL)  # the worker is orphaned, adopted by this process
        await until(lambda: len(started()) == 2)  # the engine was restarted: its old group is gone
        report = {"worker": worker, "zombies": zombie_children(), "children": len(children())}
        print(json.dumps(report))
        await supervisor.stop()
        task.cancel()

asyncio.run(main())
"""


def test_a_dead_engines_adopted_workers_are_reaped_when_it_is_restarted(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", SUPERVISED, str(tmp_path / "pids")],
        cwd=root,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["zombies"] == [], f"the first engine's worker {report['worker']} was left a zombie"
    assert report["children"] == 1  # the new engine only: its predecessor and the old worker reaped
