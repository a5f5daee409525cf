"""A real etcd server for tests: one member on free loopback ports, its data in a test's directory.

Debian's ``etcd-server`` package provides the binary (``make setup-test``: its ``system-tools`` target
installs it). The server can be stopped, SIGKILLed, frozen (SIGSTOP: it accepts connections into the
kernel's backlog and answers nothing, which is what an unreachable etcd looks like to a client) and
started again on the same data directory and ports, keys and leases kept.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_ports
from vllm_disagg.runtime import die_with_parent

READY_TIMEOUT_S = 30.0  # a fresh member elects itself in about a second; a loaded 2-core machine is slower
STOP_TIMEOUT_S = 10.0


class EtcdMissing(RuntimeError):
    """The ``etcd`` binary is not on PATH."""


def etcd_binary() -> str:
    """The ``etcd`` binary's path; raises EtcdMissing, naming how to install it, when there is none."""
    path = shutil.which("etcd")
    if path is None:
        raise EtcdMissing(
            "the etcd server binary is not on PATH: run `make setup-test` "
            "(its system-tools target installs Debian's etcd-server)"
        )
    return path


class EtcdServer:
    """One etcd member as a child process; ``url`` is its client URL (the v3 JSON gateway too)."""

    def __init__(self, data_dir: Path, *, name: str = "test") -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.name = name
        base = free_ports(2)
        self.client_port, self.peer_port = base, base + 1
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        """The command line: a one-member cluster on loopback, warnings and worse logged."""
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-outputs", "stderr",
            "--log-level", "warn",
        ]  # fmt: skip

    def launch(self) -> None:
        """Start the process (on the same data directory and ports as before); not yet ready."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"etcd at {self.url} is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )

    def healthy(self) -> bool:
        """Whether the member answers ``/health`` as healthy (it has a leader: itself); raises if the
        process died."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"etcd exited ({code}); its log:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                return resp.status == 200 and b'"true"' in resp.read()
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll ``/health`` until it says healthy, or fail after ``timeout_s`` with the server's log."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd at {self.url} not healthy after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.05)

    async def wait_ready_async(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """``wait_ready`` for a test's event loop (the check itself runs in a thread)."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self.healthy):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd at {self.url} not healthy after {timeout_s} s:\n{self.log_tail()}")
            await asyncio.sleep(0.05)

    def start(self) -> None:
        """Start it and wait until it is healthy."""
        self.launch()
        self.wait_ready()

    async def start_async(self) -> None:
        """``start`` without blocking the test's event loop."""
        self.launch()
        await self.wait_ready_async()

    def restart(self) -> None:
        """Stop it (if running) and start it again on the same data directory and ports."""
        self.stop()
        self.start()

    async def restart_async(self) -> None:
        """``restart`` without blocking the test's event loop (stopping waits in a thread)."""
        await asyncio.to_thread(self.stop)
        await self.start_async()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; a frozen process is thawed first."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: etcd dies without a word, as on a crash."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP: connections still open, nothing answers (an unreachable etcd)."""
        assert self.proc is not None and self.proc.poll() is None, "etcd is not running"
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        assert self.proc is not None and self.proc.poll() is None, "etcd is not running"
        os.kill(self.proc.pid, signal.SIGCONT)

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"


def running_etcd(data_dir: Path) -> Iterator[EtcdServer]:
    """A started ``EtcdServer`` in ``data_dir``, killed afterwards: the body of every test's ``etcd``
    fixture. Fails (not skips) when the binary is missing: these tests are part of every run."""
    try:
        server = EtcdServer(data_dir)
    except EtcdMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    server.start()
    try:
        yield server
    finally:
        server.kill()
