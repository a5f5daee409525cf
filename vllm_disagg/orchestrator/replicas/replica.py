"""This orchestrator as one replica of a cluster in etcd: its election, its membership, its link.

Keys, under ``/vllm-disagg/<cluster>/``: ``leader`` (the election, ``etcd/election.py``: whoever holds it
leads, in the epoch of its ``create_revision``) and ``replicas/<id>`` (each replica's membership, on its
lease). Both hold this replica's card (``Card``: its id and where to reach it), so a follower knows where
to forward an operator's write, and every replica where its peers' link listens.

``Replication`` owns the etcd client and these tasks; what the rest of the orchestrator reads is the
``Leadership`` it keeps up to date (state/leadership.py) and ``describe()`` (admin API, status,
``/health``). It never decides anything about instances: every replica hears every agent itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from vllm_disagg import jsonutil
from vllm_disagg.clock import Clock
from vllm_disagg.config import ReplicaConfig
from vllm_disagg.etcd.client import EtcdClient
from vllm_disagg.etcd.election import Election
from vllm_disagg.etcd.members import Members
from vllm_disagg.orchestrator.control.kv_moves import KvMover, MoveResult, failed
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.replicas.intent import DurableIntent, Weights
from vllm_disagg.orchestrator.replicas.peers import PeerLink
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.leadership import Leadership, LeaderView
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.curve import ServerCurve

log = logging.getLogger(__name__)
PREFIX = "/vllm-disagg/"


def cluster_prefix(cluster: str) -> str:
    """Every key of ``cluster`` starts with this."""
    return f"{PREFIX}{cluster}/"


def default_replica_id(port: int) -> str:
    """``HOST-PORT``: unique per replica on a host, readable in status."""
    return f"{socket.gethostname()}-{port}"[:64]


def advertised(host: str, bind_host: str) -> str:
    """The host peers reach this replica at: ``host`` when given, else the bind host unless it is a
    wildcard (then this host's name)."""
    if host:
        return host
    if bind_host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostname()
    return bind_host


def with_host(url: str, host: str) -> str:
    """``url`` with its host replaced (a bound wildcard or loopback address made reachable)."""
    parts = urlsplit(url)
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True, slots=True)
class Card:
    """Where to reach a replica: what it writes in etcd for the others."""

    replica_id: str
    http: str  # the gateway's base URL (the OpenAI API, /health, /metrics)
    admin: str  # the admin API's base URL (the gateway's unless it has its own listener)
    peer: str  # the replicas' link (tcp://host:port)
    agents: str  # the agents' ZeroMQ endpoint

    def encode(self) -> bytes:
        return jsonutil.dumps(
            {
                "id": self.replica_id,
                "http": self.http,
                "admin": self.admin,
                "peer": self.peer,
                "agents": self.agents,
            }
        )

    @classmethod
    def decode(cls, replica_id: str, raw: bytes) -> Card:
        """A card as another replica wrote it; fields it lacks read as ""."""
        try:
            data = jsonutil.loads(raw)
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}

        def text(name: str) -> str:
            value = data.get(name)
            return value if isinstance(value, str) else ""

        return cls(replica_id, text("http"), text("admin"), text("peer"), text("agents"))


class Replication:
    """Runs this replica's election, membership and link, and mirrors the election into ``Leadership``."""

    def __init__(
        self,
        settings: ReplicaConfig,
        replica_id: str,
        leadership: Leadership,
        registry: Registry,
        clock: Clock,
        events: EventLog,
        metrics: OrchestratorMetrics,
        *,
        peer_endpoint: str,
        curve: ServerCurve | None = None,
        kv_mover: KvMover | None = None,
        weights: Callable[[], dict[str, dict[str, float]]] | None = None,
        set_weights: Callable[[Weights], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.replica_id = replica_id
        self.leadership = leadership
        self._clock = clock
        self._events = events
        self._metrics = metrics
        self._client = EtcdClient(settings.etcd)
        self.link = PeerLink(
            settings.cluster, replica_id, peer_endpoint, registry, clock, curve=curve, kv_mover=kv_mover
        )
        prefix = cluster_prefix(settings.cluster)
        self.intent = DurableIntent(
            self._client,
            prefix,
            f"{prefix}leader",
            leadership,
            registry,
            clock,
            weights=weights,
            set_weights=set_weights,
        )
        self.card: Card | None = None
        self._election: Election | None = None
        self._members: Members | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self._was_leader = False

    async def start(self, card: Card) -> None:
        """Join the cluster with ``card`` (its URLs are known once the listeners are bound)."""
        self.card = card
        prefix = cluster_prefix(self.settings.cluster)
        ttl = self.settings.lease_ttl_s
        value = card.encode()
        self._election = Election(
            self._client, f"{prefix}leader", self.replica_id, value, ttl_s=ttl, clock=self._clock
        )
        self._members = Members(
            self._client, f"{prefix}replicas/", self.replica_id, value, ttl_s=ttl, clock=self._clock
        )
        self._election.watch(self._changed.set)
        self._members.watch(self._changed.set)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._election.run(), name="replica-election"),
            loop.create_task(self._members.run(), name="replica-members"),
            loop.create_task(self.link.run(), name="replica-link"),
            loop.create_task(self.intent.run(), name="replica-intent"),
            loop.create_task(self._mirror(), name="replica-mirror"),
        ]
        for task in self._tasks:
            task.add_done_callback(_log_crash)

    async def _mirror(self) -> None:
        """Carry the election's and the membership's news into ``Leadership`` and the link."""
        while True:
            self._apply()
            await self._changed.wait()
            self._changed.clear()

    def _apply(self) -> None:
        election, members = self._election, self._members
        assert election is not None and members is not None
        leader = election.leader
        leading = election.is_leader
        paused = ""
        if not election.etcd_ok:
            paused = "etcd unreachable: leader actions wait for it"
        elif leader is None:
            paused = "no leader: an election is under way"
        self.leadership.update(
            LeaderView(
                is_leader=leading,
                epoch=election.epoch,
                leader_id=leader.replica_id if leader is not None else "",
                since=leader.since if leader is not None else 0.0,
                etcd_ok=election.etcd_ok,
                paused=paused,
            )
        )
        if leading != self._was_leader:
            self._was_leader = leading
            what = f"leads in epoch {election.epoch}" if leading else "no longer leads"
            log.warning("replica %s %s", self.replica_id, what)
            self._events.publish("leader", replica=self.replica_id, leading=leading, epoch=election.epoch)
        cards = self.cards()
        self.link.connect_to({rid: card.peer for rid, card in cards.items()})
        leader_epoch = leader.epoch if leader is not None else 0
        self._metrics.replica(
            leader=leading,
            epoch=leader_epoch,
            etcd_up=election.etcd_ok,
            paused=bool(paused),
            peers=len(self.link.peers),
        )

    def cards(self) -> dict[str, Card]:
        """Every member's card, as etcd lists them (this replica's own included)."""
        if self._members is None:
            return {}
        return {rid: Card.decode(rid, m.value) for rid, m in self._members.members().items()}

    def leader_card(self) -> Card | None:
        """The leader's card (None when no leader is known, or it is this replica)."""
        election = self._election
        if election is None or election.leader is None or election.is_leader:
            return None
        if election.leader.replica_id == self.replica_id:
            return None  # a key of ours on a lease we lost (etcd came back): nobody to forward to
        return Card.decode(election.leader.replica_id, election.leader.value)

    def describe(self) -> dict[str, Any]:
        """The replicas as this one sees them: for the admin API, ``vllm-disagg status`` and /health."""
        view = self.leadership.view
        cards = self.cards()
        heard = self.link.heard()
        return {
            "cluster": self.settings.cluster,
            "self": self.replica_id,
            "role": "leader" if view.is_leader else "follower",
            "leader": view.leader_id or None,
            "epoch": self._election.leader.epoch if self._election and self._election.leader else 0,
            "leader_since": view.since or None,
            "etcd": {"ok": view.etcd_ok, "endpoints": list(self.settings.etcd)},
            "leader_actions": "running"
            if view.is_leader
            else (view.paused or f"{view.leader_id} leads them"),
            "replicas": [
                {
                    "id": rid,
                    "leader": rid == view.leader_id,
                    "http": card.http,
                    "admin": card.admin,
                    "peer": card.peer,
                    "agents": card.agents,
                    "linked": rid == self.replica_id or rid in self.link.peers,
                    "in_flight": sum(heard.get(rid, {}).values()) if rid != self.replica_id else None,
                }
                for rid, card in sorted(cards.items())
            ],
        }

    async def close(self) -> None:
        """Leave: resign (a follower takes over at once, not after the lease's TTL), drop membership."""
        # Each is one etcd call, bounded by the client's own timeout; a little more here, so a silent
        # etcd ends the call rather than this wait.
        bound = self._client.timeout_s + 1.0
        with contextlib.suppress(Exception):
            if self._election is not None:
                await asyncio.wait_for(self._election.resign(), bound)
        with contextlib.suppress(Exception):
            if self._members is not None:
                await asyncio.wait_for(self._members.leave(), bound)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()
        await self._client.close()


class ForwardingKvMover:
    """KV moves from any replica: the leader carries them out itself, a follower asks the leader."""

    def __init__(self, own: KvMover, replication: Replication, timeout_s: float) -> None:
        self._own = own
        self._replication = replication
        self._timeout_s = timeout_s

    async def move(self, holder: str, receiver: str, keys: Sequence[str]) -> MoveResult:
        """Move here when leading, else through the leader; never raises."""
        leadership = self._replication.leadership
        if leadership.is_leader:
            return await self._own.move(holder, receiver, keys)
        leader = leadership.view.leader_id
        if not leader:
            return failed("unavailable", "no replica leads now", len(keys))
        return await self._replication.link.ask_move(leader, holder, receiver, keys, self._timeout_s)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("replica task %s died", task.get_name(), exc_info=task.exception())
