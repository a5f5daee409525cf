"""The etcd that ``up --replicas N`` starts when it is given none (``--etcd embedded``).

One member on loopback, on two ports free when ``up`` starts (client and peer), its data in ``up``'s
state directory. It is one more supervised child: started first, waited for (``GET /health`` says
healthy once the member has elected itself) before any replica starts, restarted on the same ports and
data directory if it crashes, and stopped last, after the replicas have resigned and left. A new ``up``
starts it on an empty directory: like a single orchestrator, a local cluster begins with no state.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.cli.supervise import Child, ChildSpec, StartFailed
from vllm_disagg.errors import ConfigError

READY_TIMEOUT_S = 60.0  # a fresh member elects itself in about a second; a loaded 2-core host is slower
_POLL_S = 0.05
STAGE = -1  # before the orchestrator replicas (stage 0) and the agents: stopped after them


def etcd_binary() -> str:
    """The ``etcd`` server binary on PATH (``ConfigError`` naming how to get one)."""
    path = shutil.which("etcd")
    if path is None:
        raise ConfigError(
            "--etcd embedded needs the etcd server binary on PATH: install Debian's etcd-server "
            "(`make system-tools`), or give --etcd URL of a running etcd"
        )
    return path


def free_port(host: str) -> int:
    """A TCP port nothing listens on at ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class EmbeddedEtcd:
    """One etcd member as ``up``'s child: where it listens and keeps its data."""

    binary: str
    data_dir: str
    client_port: int
    peer_port: int
    host: str = "127.0.0.1"

    @classmethod
    def plan(cls, data_dir: Path, host: str = "127.0.0.1") -> EmbeddedEtcd:
        """A member on two free ports of ``host``, its data in ``data_dir``."""
        client = free_port(host)
        peer = free_port(host)
        while peer == client:
            peer = free_port(host)
        return cls(etcd_binary(), str(data_dir), client, peer, host)

    @property
    def url(self) -> str:
        """Its client URL: what the replicas get as ``--etcd``."""
        return f"http://{self.host}:{self.client_port}"

    def argv(self) -> list[str]:
        """A one-member cluster; errors logged (to ``up``'s stderr: its warnings are about a
        production setup, e.g. unsigned auth tokens, that a local cluster does not have)."""
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            self.binary,
            "--name", "up",
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"up={peer}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-outputs", "stderr",
            "--log-level", "error",
        ]  # fmt: skip

    def reset(self) -> None:
        """An empty data directory: a new cluster, nothing left from an earlier ``up``."""
        shutil.rmtree(self.data_dir, ignore_errors=True)
        Path(self.data_dir).mkdir(parents=True, mode=0o700)

    def child(self) -> ChildSpec:
        """The supervised child: first to start, waited for, last to stop."""
        return ChildSpec(
            "etcd",
            tuple(self.argv()),
            stage=STAGE,
            consequence="no leader without it: operators' writes are refused, routing goes on",
            ready=self.wait_healthy,
        )

    async def wait_healthy(self, child: Child, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Return once ``/health`` says healthy; ``StartFailed`` if the process exits first or
        ``timeout_s`` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
            while not await self._healthy(http):
                if child.returncode is not None:
                    raise StartFailed(f"etcd exited (code {child.returncode}) before it was healthy")
                if loop.time() > deadline:
                    raise StartFailed(f"etcd at {self.url} not healthy within {timeout_s:g} s")
                await asyncio.sleep(_POLL_S)  # polling a process, not a decision: the loop's clock

    async def _healthy(self, http: aiohttp.ClientSession) -> bool:
        try:
            async with http.get(f"{self.url}/health") as resp:
                body = jsonutil.loads(await resp.read()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False
        return isinstance(body, dict) and body.get("health") == "true"
