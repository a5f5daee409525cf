"""A local cluster of simulated engines started through ``vllm-disagg up``, for the e2e tests."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import (
    ADMIN,
    cli_argv,
    eventually_sync,
    free_port,
    free_ports,
    http_json,
    stop_process_group,
)


@dataclass
class Cluster:
    """A running ``up`` process and where it listens."""

    proc: subprocess.Popen[bytes]
    base: str
    engine_ports: list[int]
    log: Path

    def instances(self) -> list[dict[str, Any]]:
        status, body = http_json(f"{self.base}/admin/v1/instances", headers=ADMIN)
        assert status == 200, body
        items = body["instances"] if isinstance(body, dict) else body
        assert isinstance(items, list)
        return items


def engine_pids(ports: list[int]) -> list[int]:
    """Pids of every process whose command line names one of these engine ports."""
    needles = {f"--port\x00{p}\x00" for p in ports} | {f"--engine-port\x00{p}\x00" for p in ports}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_text(errors="replace")
        except OSError:
            continue
        if any(n in cmdline + "\x00" for n in needles):
            pids.append(int(entry))
    return pids


def start_up(
    tmp_path: Path, prefill: int, decode: int, *extra: str, env: dict[str, str] | None = None
) -> Cluster:
    """``up --engine sim`` with ``extra`` flags (and ``env``), once every instance is ready."""
    # Engine ports follow base_port; up puts their KV-event ports 2000 above.
    port, zmq_port, base_port = free_port(), free_port(), free_ports(prefill + decode, (0, 1000, 2000))
    log = tmp_path / "up.log"
    argv = cli_argv(
        "up", "--engine", "sim", "--prefill", str(prefill), "--decode", str(decode),
        "--port", str(port), "--zmq-port", str(zmq_port), "--engine-base-port", str(base_port),
        "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "1.0", "--stop-grace-s", "5",
        *extra,
    )  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    cluster = Cluster(proc, f"http://127.0.0.1:{port}", [base_port + i for i in range(prefill + decode)], log)
    try:
        eventually_sync(
            lambda: "instances ready" in log.read_text(), timeout=120, what=f"up ready (log: {log})"
        )
    except AssertionError:
        stop(cluster)
        raise AssertionError(log.read_text()) from None
    return cluster


def stop(cluster: Cluster) -> int | None:
    return stop_process_group(cluster.proc, timeout=60)
