"""An orchestrator SIGKILLed under load and started again: every process real, engines simulated.

``vllm-disagg orchestrator`` and two ``vllm-disagg agent --engine sim`` processes (one prefill, one
decode, each launching its engine). Requests are in flight when the orchestrator is SIGKILLed: each
ends at once with a connection error (or a 5xx), none hangs. The engines keep running; once the
orchestrator is started again the agents register again on their own, new requests succeed within
seconds, and ``/admin/v1/scheduler`` shows the prefill instance's blocks as before, resent by its agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, cli_argv, eventually, free_port
from vllm_disagg import jsonutil

pytestmark = pytest.mark.slow

MODEL = "sim-model"
BLOCK = 16
DECODE_STEP_S = 0.05  # in-flight streams of 200 tokens last 10 s
RECOVERY_S = 5.0  # the promise: new requests succeed within this long of the restart
DEADLINE_S = 60.0  # starting Python processes on a loaded 2-core machine
JSON = {"Content-Type": "application/json"}


class Process:
    """A ``vllm-disagg`` child process with its output in a file."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(cli_argv(*args), stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> set[int]:
        pids: set[int] = set()
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in children.read_text().split())
        return pids

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Deployment:
    """An orchestrator and its two agents, each a process, on fixed ports."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.zmq = f"tcp://127.0.0.1:{free_port()}"
        self.orchestrator = self.start_orchestrator()
        agent = ("agent", "--engine", "sim", "--orchestrator", self.zmq, "--model", MODEL)
        self.agents = {
            "prefill-0": Process(
                tmp / "prefill-0.log", *agent, "--agent-id", "prefill-0", "--role", "prefill",
                "--engine-port", str(free_port()), "--kv-events-port", str(free_port()),
            ),
            "decode-0": Process(
                tmp / "decode-0.log", *agent, "--agent-id", "decode-0", "--role", "decode",
                "--engine-port", str(free_port()), "--kv-events-port", str(free_port()),
                "--decode-step-s", str(DECODE_STEP_S),
            ),
        }  # fmt: skip

    def start_orchestrator(self) -> Process:
        return Process(
            self.tmp / "orchestrator.log", "orchestrator", "--port", str(self.port),
            "--zmq-endpoint", self.zmq, "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "3",
            "--no-preload-tokenizer-libs",
        )  # fmt: skip

    def engines(self) -> dict[str, set[int]]:
        return {agent_id: agent.children() for agent_id, agent in self.agents.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def kill(self) -> None:
        for process in (self.orchestrator, *self.agents.values()):  # engines die with their agents
            process.kill()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    running = Deployment(tmp_path)
    try:
        yield running
    finally:
        running.kill()


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    """GET an admin route (with the token)."""
    async with http.get(url, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def complete(http: aiohttp.ClientSession, base: str, prompt: str, request_id: str) -> int:
    body = jsonutil.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2})
    async with http.post(
        f"{base}/v1/completions", data=body, headers={**JSON, "X-Request-Id": request_id}
    ) as resp:
        await resp.read()
        return resp.status


async def prefill_cached(http: aiohttp.ClientSession, base: str, prompt: str, request_id: str) -> int:
    """Send ``prompt``; how many of its tokens the scheduler saw cached on prefill-0."""
    assert await complete(http, base, prompt, request_id) == 200
    record = await get_json(http, f"{base}/admin/v1/requests/{request_id}")
    cached: dict[str, int] = record["explanation"]["request"]["cached_tokens"]
    return cached.get("prefill-0", 0)


def full(prompt: str) -> int:
    return len(prompt.encode()) // BLOCK * BLOCK


async def in_flight(http: aiohttp.ClientSession, base: str, i: int) -> str:
    """A long request through the gateway; how it ended once the orchestrator is gone."""
    stream = i % 2 == 0
    body = {"model": MODEL, "prompt": long_prompt(i), "max_tokens": 200, "stream": stream}
    try:
        async with http.post(f"{base}/v1/completions", data=jsonutil.dumps(body), headers=JSON) as resp:
            if resp.status >= 500:
                return f"status {resp.status}"
            assert resp.status == 200, await resp.text()
            await resp.read()
            return "completed"
    except aiohttp.ClientError as exc:  # the orchestrator's sockets closed with it
        return type(exc).__name__


def long_prompt(i: int) -> str:
    return f"In flight {i}: " + "tell me a long story. " * 4


async def test_a_sigkilled_orchestrator_fails_requests_in_flight_cleanly_and_recovers_with_its_index(
    deployment: Deployment,
) -> None:
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)
    ) as http:

        async def ready() -> bool | None:
            instances = (await get_json(http, f"{deployment.base}/admin/v1/instances"))["instances"]
            return sum(i["state"] == "ready" for i in instances) == 2 or None

        try:
            await eventually(ready, timeout=DEADLINE_S, interval=0.1, what="both instances ready")
        except AssertionError:
            raise AssertionError(deployment.logs()) from None
        engines = deployment.engines()
        assert all(len(pids) == 1 for pids in engines.values()), engines

        # Fences: the agent forwards its engine's events in order, so once a new prompt scores as
        # cached, everything the engine published before it is in the index. (The first ones may
        # go unheard: a subscriber misses what is published while it joins.)
        fences = itertools.count()
        checks = itertools.count()

        async def fenced() -> bool | None:
            n = next(fences)
            prompt = f"Fence {n}: " + "the index is up to date. " * 3
            assert await complete(http, deployment.base, prompt, f"fence-{n}") == 200
            cached = await eventually(
                lambda: prefill_cached(http, deployment.base, prompt, f"check-{next(checks)}"),
                timeout=5,
                what="the fence indexed",
            )
            return cached == full(prompt) or None

        await eventually(fenced, timeout=DEADLINE_S, what="a fence indexed")
        requests = [asyncio.ensure_future(in_flight(http, deployment.base, i)) for i in range(4)]

        async def decoding() -> bool | None:
            instances = (await get_json(http, f"{deployment.base}/admin/v1/instances"))["instances"]
            return any(i["agent_id"] == "decode-0" and i["in_flight"] == 4 for i in instances) or None

        # On the decode instance: their prefill legs are done, their blocks stored on prefill-0.
        await eventually(decoding, timeout=DEADLINE_S, what="4 requests decoding")
        await eventually(fenced, timeout=DEADLINE_S, what="a fence indexed with requests in flight")
        scheduler = await get_json(http, f"{deployment.base}/admin/v1/scheduler")
        before = scheduler["kv_index"]["instances"]["prefill-0"]
        assert before >= 4 * 6  # the fence and in-flight prompts' blocks at least

        deployment.orchestrator.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*requests), DEADLINE_S)
        assert time.monotonic() - killed < 20  # ended with the orchestrator, not by a client timeout
        assert all(o != "completed" for o in outcomes), outcomes  # 10 s streams cannot have finished
        assert all(o.startswith(("status 5", "Client", "Server")) for o in outcomes), outcomes
        deployment.orchestrator.proc.wait()

        deployment.orchestrator = deployment.start_orchestrator()

        async def listening() -> bool:
            async with http.get(f"{deployment.base}/health") as resp:
                return resp.status in (200, 503)

        await eventually(listening, timeout=DEADLINE_S, interval=0.05, what="the orchestrator listening")
        restarted = time.monotonic()
        attempts = itertools.count()

        async def served() -> bool | None:
            status = await complete(http, deployment.base, "hi again", f"after-{next(attempts)}")
            return status == 200 or None

        await eventually(served, timeout=DEADLINE_S, interval=0.05, what="a request served after the restart")
        assert time.monotonic() - restarted < RECOVERY_S, deployment.logs()

        async def reindexed() -> bool:
            scheduler = await get_json(http, f"{deployment.base}/admin/v1/scheduler")
            return bool(scheduler["kv_index"]["instances"].get("prefill-0") == before)

        await eventually(reindexed, timeout=DEADLINE_S, what="prefill-0's blocks indexed again")
        assert deployment.engines() == engines  # the engines ran on, untouched
        await eventually(ready, timeout=DEADLINE_S, interval=0.1, what="both instances ready again")
        assert await prefill_cached(http, deployment.base, long_prompt(1), "repeat") == full(long_prompt(1))
    assert "resyncing the orchestrator's KV index" in deployment.agents["prefill-0"].output()
