"""One plain vLLM process for the e2e tests: free ports for it, start it, wait for it, leave nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e.vllm.engine_slots import engine_slots
from tests.helpers import (
    ADMIN,
    cli_argv,
    eventually_sync,
    free_ports,
    http_json,
    sse_text,
    stop_process_group,
)
from vllm_disagg import jsonutil
from vllm_disagg.agent.vllm_command import VllmEngineCommand
from vllm_disagg.config import AgentConfig
from vllm_disagg.procfs import group_members
from vllm_disagg.runtime import die_with_parent

START_TIMEOUT_S = 900.0  # two cold vLLM starts side by side on 2 cores took 92 s; leave room


def engine_client(total_s: float | None = None) -> aiohttp.ClientSession:
    """A client session for tests that ask vLLM itself: a new connection per request. vLLM's server
    closes a connection idle for 5 s; a test's loop stalled that long (a starved host) would reuse the
    pooled one as it closes ("Can not write request body"). The gateway keeps to the same rule
    (``upstream.py``)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=total_s)
    )


def free_engine_ports(n: int) -> int:
    """A base port where n engines, their NIXL side channels (+1000) and KV event ports (+2000) are free."""
    return free_ports(n, (0, 1000, 2000))


@contextlib.contextmanager
def running_vllm(cfg: AgentConfig, log: Path) -> Iterator[str]:
    """The engine ``cfg`` describes, started as the agent would; yields its base URL once healthy.

    On exit its process group gets SIGTERM (SIGKILL after 30 s) and is waited for until empty.
    """
    with running_vllms([(cfg, log)]) as (base,):
        yield base


def _engine_preexec() -> None:
    """As ``up`` runs engines: dying with the test, and niced (two engines spinning on this box's two
    cores otherwise starve the orchestrator and agents of CPU for seconds)."""
    die_with_parent()
    os.nice(10)


@contextlib.contextmanager
def running_vllms(
    engines: list[tuple[AgentConfig, Path]], env: Mapping[str, Mapping[str, str]] | None = None
) -> Iterator[tuple[str, ...]]:
    """Several engines started side by side (a cold start is a minute or more here); their base URLs
    once all are healthy. ``env``: more variables for an engine, by agent id. On exit each process
    group is stopped as ``running_vllm`` does."""
    with engine_slots(len(engines), ", ".join(cfg.agent_id for cfg, _ in engines)):
        yield from _started(engines, env or {})


def _started(
    engines: list[tuple[AgentConfig, Path]], env: Mapping[str, Mapping[str, str]]
) -> Iterator[tuple[str, ...]]:
    command = VllmEngineCommand()
    procs: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    try:
        for cfg, log in engines:
            with log.open("wb") as out:
                more = env.get(cfg.agent_id, {})
                proc = subprocess.Popen(
                    command.argv(cfg), env={**os.environ, **command.env(cfg), **more}, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_engine_preexec,
                )  # fmt: skip
            procs.append((proc, f"http://127.0.0.1:{cfg.engine_port}", log))

        def healthy(proc: subprocess.Popen[bytes], base: str, log: Path) -> bool:
            if proc.poll() is not None:  # it will never be ready: say why now, not after the timeout
                raise AssertionError(
                    f"vLLM exited with {proc.returncode} before it was ready:\n{log.read_text()[-3000:]}"
                )
            with contextlib.suppress(Exception):  # not listening yet
                return http_json(f"{base}/health")[0] == 200
            return False

        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(procs)
        while waiting:
            waiting = [p for p in waiting if not healthy(*p)]
            if waiting and time.monotonic() > deadline:
                raise AssertionError(
                    f"vLLM not ready after {START_TIMEOUT_S}s (logs {[p[2] for p in waiting]})"
                )
            if waiting:
                time.sleep(0.5)  # polling a condition with a deadline
        yield tuple(base for _, base, _ in procs)
    finally:
        for proc, _, _ in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc, _, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        pids = {proc.pid for proc, _, _ in procs}
        eventually_sync(lambda: not group_members(pids), timeout=30, what="vLLM's process groups gone")


# --- requests and the 1P1D cluster the real-vLLM tests share ----------------------------------------

MODEL = "tiny"
BLOCK = 128  # vLLM's block size on CPU
MAX_TOKENS = 16
JSON = {"Content-Type": "application/json"}


def _words() -> list[str]:
    text = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    return [w for w in text.split() if w.isascii()]


@dataclass(frozen=True)
class Case:
    """One request: route, body, and how to read its text."""

    name: str
    chat: bool
    stream: bool
    prompt: str

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        body["stream"] = self.stream
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body

    @property
    def route(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def prompts_for(model_dir: Path, n: int, first_tokens: int) -> list[str]:
    """``n`` different prompts of a little over ``first_tokens`` tokens each (more than two blocks)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    words = _words()
    prompts = []
    for i in range(n):
        chosen: list[str] = [f"Request {i}:"]
        j = i * 37
        while len(tokenizer.encode(" ".join(chosen), add_special_tokens=False)) < first_tokens + 4 * (i % 8):
            chosen.append(words[j % len(words)])
            j += 1
        prompts.append(" ".join(chosen))
    return prompts


async def ask(session: aiohttp.ClientSession, base: str, case: Case) -> tuple[str, dict[str, Any], Any]:
    """The generated text, the usage (non-stream only) and the response headers."""
    async with session.post(base + case.route, data=jsonutil.dumps(case.body()), headers=JSON) as resp:
        raw = await resp.read()
        assert resp.status == 200, (case.name, resp.status, raw[:500])
        headers = resp.headers
    if case.stream:
        return sse_text(raw, chat=case.chat), {}, headers
    body = jsonutil.loads(raw)
    choice = body["choices"][0]
    return (choice["message"]["content"] if case.chat else choice["text"]), body["usage"], headers


def up_1p1d_argv(model_dir: Path, port: int, zmq_port: int, engine_base: int) -> list[str]:
    """``vllm-disagg up`` for 1P1D real vLLM on the tiny model, tolerant of this machine's stalls."""
    return cli_argv(
        "up", "--engine", "vllm", "--model", str(model_dir), "--served-model-name", MODEL,
        "--prefill", "1", "--decode", "1",
        "--port", str(port), "--zmq-port", str(zmq_port), "--engine-base-port", str(engine_base),
        "--ready-timeout-s", str(START_TIMEOUT_S), "--stop-grace-s", "20",
        # The first NIXL handshakes of the CPU build stall this whole 2-core machine, agents and
        # engines' accept loops included, for up to 22 s (seen in CI): these tests prove correctness
        # and recovery, not latency. Failure detection speed is tested on simulated engines; a killed
        # engine is reported by its agent at once whatever the heartbeat timeout.
        "--heartbeat-timeout-s", "60", "--connect-timeout-s", "60", "--health-timeout-s", "20",
    )  # fmt: skip


@dataclass
class Answers:
    """What one plain vLLM answered for each case, and each non-streamed case's prompt tokens."""

    texts: dict[str, str]
    prompt_tokens: dict[str, int]


@dataclass
class UpCluster:
    """A running ``vllm-disagg up`` with real vLLM engines."""

    proc: subprocess.Popen[bytes]
    base: str  # the gateway
    log: Path  # shown when a test fails (tests/e2e/conftest.py)

    def instances(self) -> dict[str, dict[str, Any]]:
        """The admin API's instances, by agent id."""
        status, body = http_json(f"{self.base}/admin/v1/instances", headers=ADMIN)
        assert status == 200, body
        return {i["agent_id"]: i for i in body["instances"]}


@contextlib.contextmanager
def running_up(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``vllm-disagg up`` with ``argv``, once it says every instance is ready; stopped on exit (its
    whole process group, engines included). A start that fails raises with the log's last lines."""
    with engine_slots(_engines_in(argv), "up"):
        yield from _up(argv, log)


def _engines_in(argv: list[str]) -> int:
    """How many engines ``up`` with ``argv`` runs: its ``--prefill`` and ``--decode`` counts."""
    return sum(int(argv[argv.index(flag) + 1]) for flag in ("--prefill", "--decode") if flag in argv)


def _up(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        eventually_sync(
            lambda: proc.poll() is not None or "instances ready" in log.read_text(),
            timeout=START_TIMEOUT_S + 60, interval=0.5, what="up ready",
        )  # fmt: skip
        assert proc.poll() is None, f"up exited with {proc.returncode}: {log.read_text()[-5000:]}"
        yield proc
    finally:
        stop_process_group(proc, timeout=120)
