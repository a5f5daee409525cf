"""``up --replicas N``: a local replicated control plane, and what ``up`` asks of it over HTTP.

With ``--replicas N`` (or ``--etcd``) ``up`` starts N orchestrator replicas on one etcd (given, or
one it starts itself: ``local_etcd.py``), replica ``i`` on the HTTP port ``--port + i``, the agents'
port ``--zmq-port + i`` and the peer port ``--peer-port + i`` (0: any free one), with the replica id
``replica-i``; every agent connects to every replica. ``ReplicaSet`` is that shape and each replica's
flags; ``LeaderWatch`` says which replica leads. ``fetch_instances`` and ``wait_ready`` poll the admin
API of every orchestrator ``up`` runs, one or many.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.cli.local_etcd import EmbeddedEtcd
from vllm_disagg.cli.supervise import ChildSpec
from vllm_disagg.config import ReplicaConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import admin_headers

EMBEDDED = "embedded"
_POLL_S = 0.05  # readiness: an instance is announced within this of its Welcome
LEADER_POLL_S = 0.25  # who leads: a failover takes the lease's TTL, seconds


@dataclass(frozen=True)
class ReplicaSet:
    """The orchestrator replicas of a local cluster and the etcd they share."""

    count: int
    etcd: tuple[str, ...]  # its client URLs (the embedded one's, when ``up`` starts it)
    cluster: str
    peer_port: int = 0  # the first replica's; replica i listens on + i. 0: each picks a free one
    lease_ttl_s: int = ReplicaConfig.lease_ttl_s
    embedded: EmbeddedEtcd | None = None  # the etcd ``up`` starts itself; None: ``etcd`` runs already

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"--replicas must be at least 1, got {self.count}")
        # The orchestrator's own checks, before anything starts: URLs, names, the TTL, the port.
        ReplicaConfig(
            etcd=self.etcd,
            cluster=self.cluster,
            replica_id=self.replica_id(self.count - 1),
            peer_port=self.peer_port + self.count - 1 if self.peer_port else 0,
            lease_ttl_s=self.lease_ttl_s,
        )

    @staticmethod
    def replica_id(index: int) -> str:
        """Replica ``index``'s id: ``replica-0``, ``replica-1``, ..."""
        return f"replica-{index}"

    def peer_ports(self) -> list[int]:
        """The replicas' peer ports; empty when each picks a free one."""
        return [self.peer_port + i for i in range(self.count)] if self.peer_port else []

    def flags(self, index: int, host: str) -> list[str]:
        """The replica flags of replica ``index`` bound to ``host`` (``vllm-disagg orchestrator --etcd
        ...``): the others reach it there, on loopback when it binds a wildcard (agents do too)."""
        advertise_host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        return [
            "--etcd", ",".join(self.etcd),
            "--cluster", self.cluster,
            "--replica-id", self.replica_id(index),
            "--advertise-host", advertise_host,
            "--peer-port", str(self.peer_port + index if self.peer_port else 0),
            "--lease-ttl-s", str(self.lease_ttl_s),
        ]  # fmt: skip

    def check_ports(self, port: int, zmq_port: int, engine_ports: Sequence[int]) -> None:
        """``ConfigError`` when two port ranges overlap (an engine uses its port + 1000, 2000, 3000)."""
        n = self.count
        clash = port_clash(
            {
                "the replicas' HTTP ports (--port + i)": range(port, port + n),
                "the agents' ports (--zmq-port + i)": range(zmq_port, zmq_port + n),
                "the peer ports (--peer-port + i)": self.peer_ports(),
                "the engines' ports (--engine-base-port, + 1000, 2000, 3000)": [
                    p + offset for p in engine_ports for offset in (0, 1000, 2000, 3000)
                ],
            }
        )
        if clash:
            raise ConfigError(f"port {clash}")

    def children(self, argv: Callable[[int], list[str]], env: Mapping[str, str]) -> list[ChildSpec]:
        """What ``up`` supervises for them: the embedded etcd, first to start and last to stop, then each
        replica (``argv(i)``). Giving up on one leaves the others serving; on the last, ends ``up``."""
        etcd = [self.embedded.child()] if self.embedded else []
        return etcd + [
            ChildSpec(
                f"orchestrator {self.replica_id(i)}",
                tuple(argv(i)),
                env=env,
                essential=True,
                group="orchestrator replicas",
                consequence="the other replicas serve on",
                last_consequence="no replica left: stopping the cluster",
            )
            for i in range(self.count)
        ]

    def lines(self, bases: Sequence[str], agents: Sequence[str]) -> list[str]:
        """``up``'s start-up lines about them: the etcd, and where each replica listens."""
        if self.embedded is None:
            etcd = ",".join(self.etcd)
        else:
            etcd = (
                f"{self.embedded.url} (embedded: started and stopped by up, data in {self.embedded.data_dir})"
            )
        return [f"  etcd: {etcd}"] + [
            f"  {self.replica_id(i)}: gateway {base}/v1/completions  admin {base}/admin/v1/replicas  "
            f"agents {zmq}"
            for i, (base, zmq) in enumerate(zip(bases, agents, strict=True))
        ]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """``up``'s replica flags."""
    group.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="orchestrator replicas, on HTTP ports --port, --port+1, ... (and --zmq-port+i, --peer-port+i); "
        "more than one needs etcd: --etcd, else one started by up (docs/operations.md)",
    )
    group.add_argument(
        "--etcd",
        default="",
        metavar="URL[,URL...]|embedded",
        help="the replicas' etcd; 'embedded' (the default with --replicas > 1): up starts one on free "
        "loopback ports, its data under up's state directory, emptied at each start",
    )
    group.add_argument("--cluster", default="", help="the replicas' cluster name in etcd (default: up-PORT)")
    group.add_argument(
        "--peer-port",
        type=int,
        default=0,
        help="the first replica's peer port (replica i: + i); 0: each picks a free one",
    )
    group.add_argument(
        "--lease-ttl-s",
        type=int,
        default=ReplicaConfig.lease_ttl_s,
        help="the leader's etcd lease: a new leader takes over about this long after the old one died",
    )


def replica_set_from_args(args: argparse.Namespace, state_dir: Path) -> ReplicaSet | None:
    """The replicas the flags ask for; None for one orchestrator without etcd (the default, as
    before replicas existed). No ``--etcd`` with ``--replicas`` > 1 means ``embedded``."""
    etcd = args.etcd.strip()
    if args.replicas == 1 and not etcd:
        return None
    embedded = None
    if etcd in ("", EMBEDDED):
        embedded = EmbeddedEtcd.plan(state_dir / "etcd")
        urls: tuple[str, ...] = (embedded.url,)
    else:
        urls = tuple(url.strip() for url in etcd.split(",") if url.strip())
    return ReplicaSet(
        count=args.replicas,
        etcd=urls,
        cluster=args.cluster or f"up-{args.port}",
        peer_port=args.peer_port,
        lease_ttl_s=args.lease_ttl_s,
        embedded=embedded,
    )


def port_clash(ports: Mapping[str, Iterable[int]]) -> str:
    """The first port two uses share, said as ``"8001: replica HTTP and engine"``; "" when none."""
    seen: dict[int, str] = {}
    for what, numbers in ports.items():
        for port in numbers:
            if not 0 < port <= 65535:
                return f"{port}: {what} is not a TCP port"
            if port in seen and seen[port] != what:
                return f"{port}: {seen[port]} and {what}"
            seen[port] = what
    return ""


# --- asking the orchestrators -------------------------------------------------------------------


async def fetch_instances(
    session: aiohttp.ClientSession, base: str, token: str
) -> list[dict[str, object]] | None:
    """The admin API's instance list, or None while the orchestrator is not answering."""
    try:
        async with session.get(f"{base}/admin/v1/instances", headers=admin_headers(token)) as resp:
            if resp.status != 200:
                return None
            body = jsonutil.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):  # a busy orchestrator may answer late
        return None
    items = body.get("instances") if isinstance(body, dict) else body
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else None


async def wait_ready(
    bases: Sequence[str],
    token: str,
    agent_ids: Iterable[str],
    timeout_s: float,
    on_ready: Callable[[dict[str, object]], None] | None,
    failed: Callable[[], bool],
) -> bool:
    """Poll each orchestrator's admin API until every one sees every instance ready (True), or
    ``timeout_s`` passes or ``failed()`` (False); ``on_ready`` hears of each instance once, when a
    first one sees it ready. An orchestrator not answering (starting, restarting) is "not yet"."""
    deadline = time.monotonic() + timeout_s
    waiting = {base: set(agent_ids) for base in bases}
    announced: set[str] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while any(waiting.values()):
            for base, left in waiting.items():
                for item in (await fetch_instances(session, base, token) or []) if left else []:
                    agent_id = str(item.get("agent_id", ""))
                    if agent_id in left and item.get("state") == "ready":
                        left.discard(agent_id)
                        if agent_id not in announced and on_ready:
                            on_ready(item)
                        announced.add(agent_id)
            if not any(waiting.values()):
                break
            if time.monotonic() > deadline or failed():
                return False
            await asyncio.sleep(_POLL_S)
    return True


@dataclass(frozen=True)
class Leader:
    """Who leads, as a replica said: its id, epoch and gateway URL."""

    replica_id: str
    epoch: int
    http: str


def leader_of(described: Any) -> Leader | None:
    """The leader in a ``GET /admin/v1/replicas`` answer; None while none is known, or while the
    answering replica has not yet read the leader's card (where it serves): a leader is told with
    its URL or not at all."""
    if not isinstance(described, dict):
        return None
    leader, epoch = described.get("leader"), described.get("epoch")
    if not isinstance(leader, str) or not leader or not isinstance(epoch, int) or epoch <= 0:
        return None
    replicas = described.get("replicas")
    cards = [r for r in replicas if isinstance(r, dict)] if isinstance(replicas, list) else []
    http = next((str(r.get("http", "")) for r in cards if r.get("id") == leader), "")
    return Leader(leader, epoch, http) if http else None


class LeaderWatch:
    """Says which replica leads once one is known, and again at each new term (``GET
    /admin/v1/replicas`` on the first replica that answers; a later epoch is a newer term, so an
    answer from a replica behind the news never says an old leader again)."""

    def __init__(self, bases: Sequence[str], token: str, say: Callable[[str], None]) -> None:
        self._bases = list(bases)
        self._token = token
        self._say = say
        self.leader: Leader | None = None

    async def run(self) -> None:
        """Until cancelled."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while True:
                seen = await self._ask(http)
                if seen is not None and (self.leader is None or seen.epoch > self.leader.epoch):
                    self.leader = seen
                    self._say(f"leader: {seen.replica_id} (epoch {seen.epoch}) {seen.http}")
                await asyncio.sleep(LEADER_POLL_S)  # polling other processes: the loop's clock

    async def _ask(self, http: aiohttp.ClientSession) -> Leader | None:
        for base in self._bases:
            try:
                url = f"{base}/admin/v1/replicas"
                async with http.get(url, headers=admin_headers(self._token)) as resp:
                    if resp.status != 200:
                        continue
                    leader = leader_of(jsonutil.loads(await resp.read()))
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
            if leader is not None:
                return leader
        return None
