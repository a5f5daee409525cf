"""``up --replicas 3``: a local replicated control plane on the etcd ``up`` starts itself.

Every process is real: ``up``, its etcd, three orchestrator replicas, two agents and their simulated
engines. Requests go through each replica's own port; the replicas agree on one leader (each one's
``GET /admin/v1/replicas``); the leader SIGKILLed is restarted by ``up`` while another replica takes
over and requests through the others never fail; a SIGTERM to ``up`` ends everything, the etcd last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.up_support import engine_pids
from tests.helpers import ADMIN, cli_argv, eventually, eventually_sync, free_ports, http_json
from vllm_disagg.sim_engine.textgen import expected_text

MODEL = "sim-model"
REPLICAS = 3
READY_S = 180.0  # etcd, three replicas, two agents and two engines starting on a loaded 2-core machine
RECOVERY_S = 60.0
LEASE_TTL_S = 2  # etcd's minimum: the dead leader's lease expires 2 to 2.5 s after its last renewal
# Longer than the lease: the survivors elect a leader before the restarted replica is back to
# campaign, so "another replica leads" does not race the restart.
RESTART_BACKOFF_S = 3


@dataclass
class Replicated:
    """A running ``up --replicas 3`` (``log`` is shown when a test fails: tests/e2e/conftest.py)."""

    proc: subprocess.Popen[bytes]
    log: Path
    bases: list[str]
    engine_ports: list[int]
    home: Path  # VLLM_DISAGG_HOME: up's state (keys, the etcd's data) is under it

    def said(self, line: str) -> bool:
        return line in self.log.read_text(errors="replace").splitlines()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Replicated]:
    port, zmq_port = free_ports(REPLICAS), free_ports(REPLICAS)
    engine_base = free_ports(2, (0, 1000, 2000, 3000))
    home, log = tmp_path / "home", tmp_path / "up.log"
    argv = cli_argv(
        "up", "--engine", "sim", "--prefill", "1", "--decode", "1", "--replicas", str(REPLICAS),
        "--port", str(port), "--zmq-port", str(zmq_port), "--engine-base-port", str(engine_base),
        "--lease-ttl-s", str(LEASE_TTL_S), "--restart-backoff-s", str(RESTART_BACKOFF_S),
        # Not the fast detection other tests ask for: a starved agent missing a heartbeat would fail
        # requests this test expects to succeed through the failover.
        "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "3.0", "--stop-grace-s", "5",
    )  # fmt: skip
    env = {**os.environ, "VLLM_DISAGG_HOME": str(home)}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    running = Replicated(
        proc,
        log,
        [f"http://127.0.0.1:{port + i}" for i in range(REPLICAS)],
        [engine_base, engine_base + 1],
        home,
    )
    try:
        eventually_sync(
            lambda: running.said("vllm-disagg up: all 2 instances ready; Ctrl-C stops"), timeout=READY_S
        )
        yield running
    finally:
        if proc.poll() is None:  # the test stops it itself; this is for a test that failed first
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def replicas_view(base: str) -> dict[str, Any]:
    status, body = http_json(f"{base}/admin/v1/replicas", headers=ADMIN, timeout=2.0)
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def agreed_leader(
    bases: list[str], after_epoch: int = 0, *, all_listed: bool = True
) -> tuple[str, int] | None:
    """(leader, epoch) once every replica of ``bases`` answers, names the same leader in the same epoch
    (later than ``after_epoch``) and, when ``all_listed``, lists all three replicas; None until then."""
    views = [replicas_view(base) for base in bases]
    leaders = {(v["leader"], v["epoch"]) for v in views}
    if len(leaders) != 1:
        return None
    leader, epoch = leaders.pop()
    if not leader or epoch <= after_epoch:
        return None
    if all_listed and any(len(v["replicas"]) != REPLICAS for v in views):
        return None
    assert [v["role"] for v in views] == ["leader" if v["self"] == leader else "follower" for v in views]
    return str(leader), int(epoch)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if text in Path(f"/proc/{entry}/cmdline").read_text(errors="replace") and running(int(entry)):
                    found.append(int(entry))
    return found


def replica_pid(up: Replicated, replica_id: str) -> int | None:
    """The pid of ``up``'s child serving as ``replica_id``."""
    needle = f"\x00--replica-id\x00{replica_id}\x00"
    for pid in descendants(up.proc.pid):
        with contextlib.suppress(OSError):
            if needle in "\x00" + Path(f"/proc/{pid}/cmdline").read_text(errors="replace") and running(pid):
                return pid
    return None


async def complete(http: aiohttp.ClientSession, base: str, prompt: str) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, raw.decode(errors="replace")
        return 200, json.loads(raw)["choices"][0]["text"]


def supervisor_events(base: str) -> list[dict[str, Any]]:
    status, body = http_json(f"{base}/admin/v1/events?follow=false", headers=ADMIN)
    assert status == 200, body
    events = [json.loads(line[6:]) for line in str(body).splitlines() if line.startswith("data: ")]
    return [e for e in events if e.get("kind") == "supervisor"]


async def test_three_replicas_serve_agree_on_a_leader_survive_its_kill_and_stop_leaving_nothing(
    cluster: Replicated,
) -> None:
    up = cluster
    async with aiohttp.ClientSession() as http:
        for i, base in enumerate(up.bases):
            assert await complete(http, base, f"through replica {i}") == (
                200,
                expected_text(f"through replica {i}", 4),
            )
    leader, epoch = await eventually(lambda: agreed_leader(up.bases), timeout=RECOVERY_S, what="one leader")
    await eventually(
        lambda: up.said(f"vllm-disagg up: leader: {leader} (epoch {epoch}) {up.bases[int(leader[-1])]}"),
        timeout=RECOVERY_S,
        what="up saying who leads",
    )
    killed = replica_pid(up, leader)
    assert killed is not None
    others = [base for i, base in enumerate(up.bases) if f"replica-{i}" != leader]
    outcomes: list[tuple[int, str, str]] = []  # (status, text, prompt) through the other replicas
    done = asyncio.Event()

    async def load(http: aiohttp.ClientSession) -> None:
        n = 0
        while not done.is_set():
            n += 1
            prompt = f"during the failover {n}"
            status, text = await complete(http, others[n % len(others)], prompt)
            outcomes.append((status, text, prompt))
            await asyncio.sleep(0.05)  # paced: a client's trickle, not a benchmark

    async with aiohttp.ClientSession() as http:
        trickle = asyncio.ensure_future(load(http))
        try:
            os.kill(killed, signal.SIGKILL)
            kill_time = time.monotonic()
            restart_line = (
                f"up: orchestrator {leader} exited (code -9); restarting in {RESTART_BACKOFF_S} s (restart 1)"
            )
            elected, _ = await eventually(
                lambda: agreed_leader(others, after_epoch=epoch, all_listed=False),
                timeout=RECOVERY_S,
                what="a new leader the other replicas know",
            )
            elected_s = time.monotonic() - kill_time
            await eventually(lambda: up.said(restart_line), timeout=RECOVERY_S, what="the restart line")
            new_leader, new_epoch = await eventually(
                lambda: agreed_leader(up.bases, after_epoch=epoch),
                timeout=RECOVERY_S,
                what="a new leader every replica (the restarted one too) knows",
            )
            agreed_s = time.monotonic() - kill_time
        finally:
            done.set()
            await trickle
        print(
            f"leader failover: {elected} leads {elected_s:.2f} s after the kill (the others agreeing); the "
            f"killed one back and agreeing {agreed_s:.2f} s after; {len(outcomes)} requests meanwhile"
        )
        assert elected != leader, "another replica leads"
        assert replica_pid(up, leader) not in (None, killed), "up restarted the killed replica"
        assert outcomes and all(s == 200 and t == expected_text(p, 4) for s, t, p in outcomes), [
            o for o in outcomes if o[0] != 200
        ][:5]
        await eventually(
            lambda: up.said(
                f"vllm-disagg up: leader: {new_leader} (epoch {new_epoch}) {up.bases[int(new_leader[-1])]}"
            ),
            timeout=RECOVERY_S,
            what="up saying who leads now",
        )
        restarted_base = up.bases[int(leader[-1])]

        async def served_by_the_restarted_replica() -> bool:
            return (await complete(http, restarted_base, "back again"))[0] == 200

        await eventually(
            served_by_the_restarted_replica, timeout=RECOVERY_S, what="the restarted replica serving"
        )

    # up noted the restart through a replica that answered; it lands in the leader's event log.
    def noted() -> list[dict[str, Any]]:
        return [
            e
            for e in supervisor_events(up.bases[int(new_leader[-1])])
            if (e["process"], e["action"], e["exit_code"]) == (f"orchestrator {leader}", "restarted", -9)
        ]

    await eventually(noted, timeout=RECOVERY_S, what="the restart in the new leader's event log")

    children = descendants(up.proc.pid)
    assert len(children) >= 1 + REPLICAS + 2 + 2, "etcd, the replicas, the agents and their engines"
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=90) == 0
    assert [pid for pid in children if running(pid)] == []
    assert processes_naming(str(up.home)) == [], "no etcd (its data dir), replica or agent (their keys) left"
    assert [pid for pid in engine_pids(up.engine_ports) if running(pid)] == [], "no engine left"
    lines = up.log.read_text(errors="replace").splitlines()
    assert [line for line in lines if "restarting in" in line or "giving up" in line] == [restart_line]
    assert lines[-1] == "vllm-disagg up: stopped"
