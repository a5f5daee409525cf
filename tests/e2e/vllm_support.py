"""One plain vLLM process for the e2e tests: free ports for it, start it, wait for it, leave nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.e2e.up_support import port_free
from tests.helpers import eventually_sync, free_port, http_json
from vllm_disagg.agent.vllm_command import VllmEngineCommand
from vllm_disagg.config import AgentConfig
from vllm_disagg.procfs import group_members
from vllm_disagg.runtime import die_with_parent

START_TIMEOUT_S = 900.0  # two cold vLLM starts side by side on 2 cores took 92 s; leave room


def free_engine_ports(n: int) -> int:
    """A base port where n engines, their NIXL side channels (+1000) and KV event ports (+2000) are free."""
    while True:
        base = free_port()
        if base + 2000 + n < 65535 and all(
            port_free(base + k + d) for k in range(n) for d in (0, 1000, 2000)
        ):
            return base


@contextlib.contextmanager
def running_vllm(cfg: AgentConfig, log: Path) -> Iterator[str]:
    """The engine ``cfg`` describes, started as the agent would; yields its base URL once healthy.

    On exit its process group gets SIGTERM (SIGKILL after 30 s) and is waited for until empty.
    """
    command = VllmEngineCommand()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command.argv(cfg), env={**os.environ, **command.env(cfg)}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    base = f"http://127.0.0.1:{cfg.engine_port}"
    try:
        eventually_sync(
            lambda: proc.poll() is None and http_json(f"{base}/health")[0] == 200,
            timeout=START_TIMEOUT_S, interval=0.5, what=f"vLLM ready (log {log})",
        )  # fmt: skip
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        eventually_sync(lambda: not group_members({proc.pid}), timeout=30, what="vLLM's process group gone")
