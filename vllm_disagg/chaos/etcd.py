"""A throwaway local etcd for ``vllm-disagg chaos --replicas``: one member on free loopback ports, its
data in a new temporary directory, stopped and removed with the run.

The same start as the tests' ``tests/etcd_support.py`` (Debian's ``etcd-server`` provides the binary):
a one-member cluster on 127.0.0.1, ready once ``GET /health`` says ``{"health": "true"}`` (the member
has elected itself).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import IO

import aiohttp

from vllm_disagg.cli.local_etcd import EmbeddedEtcd
from vllm_disagg.errors import ConfigError
from vllm_disagg.runtime import die_with_parent

STOP_GRACE_S = 5.0


def etcd_binary() -> str:
    """The ``etcd`` binary; ``ConfigError`` naming how to get one when it is not on PATH."""
    path = shutil.which("etcd")
    if path is None:
        raise ConfigError(
            "--replicas needs an etcd server binary on PATH (Debian: apt-get install etcd-server; "
            "or `make setup-test`)"
        )
    return path


class LocalEtcd:
    """One etcd member as a child process, started as ``up`` starts its own (``EmbeddedEtcd``);
    ``url`` is its client URL."""

    def __init__(self, client_port: int, peer_port: int, log: IO[bytes]) -> None:
        self.binary = etcd_binary()
        self.client_port, self.peer_port = client_port, peer_port
        self._log = log
        self.data_dir = ""
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        return EmbeddedEtcd(self.binary, self.data_dir, self.client_port, self.peer_port).argv()

    async def start(self, timeout_s: float) -> bool:
        """Start it; True once healthy, False if it exited or was not healthy within ``timeout_s``."""
        self.data_dir = tempfile.mkdtemp(prefix="vllm-disagg-chaos-etcd-")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
            while time.monotonic() < deadline and self.proc.returncode is None:
                try:
                    async with http.get(f"{self.url}/health") as resp:
                        if resp.status == 200 and b'"true"' in await resp.read():
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after a grace period; the data directory goes."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self.data_dir:
            shutil.rmtree(Path(self.data_dir), ignore_errors=True)
