"""What the registry hands out: immutable views of instances and snapshots of them all.

The scheduler, the planner, the admin API and the gateway read these and never the registry's own
records, so every decision sees one consistent instant and can be a pure function of it. A gateway
worker's replica of the registry (``gateway/workers/replica.py``) builds the same snapshots from the
views the orchestrator sends it (``SnapshotSource``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from vllm_disagg.orchestrator.state import health
from vllm_disagg.orchestrator.state.changes import ChangeLog, ChangeMark
from vllm_disagg.orchestrator.state.health import CLOSED, Breaker, InstanceState
from vllm_disagg.orchestrator.state.in_flight import InFlight
from vllm_disagg.orchestrator.state.link_table import EMPTY_LINKS, LinkTable
from vllm_disagg.protocol.messages import EngineState, InstanceInfo, MetricsSnapshot, Role

# Roles that may serve each leg of a request.
PREFILL_ROLES: frozenset[Role] = frozenset(("prefill", "both"))
DECODE_ROLES: frozenset[Role] = frozenset(("decode", "both"))

REGISTRY_IDS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """An immutable picture of one instance at snapshot time (in-flight counts live in the snapshot)."""

    agent_id: str
    info: InstanceInfo
    state: InstanceState
    session: int  # increments with every Hello, so a comeback is visible
    engine_state: EngineState
    agent_draining: bool  # the agent's heartbeat says so
    admin_draining: bool  # an operator drained it through the admin API
    joined_at: float  # monotonic time of the session's Hello
    last_heartbeat: float  # monotonic; the Hello counts as the first sign of life
    heartbeats: int
    metrics: MetricsSnapshot
    dead_reason: str
    admin_cordoned: bool = False
    breaker: Breaker = CLOSED
    late: bool = False  # no heartbeat for ``suspect_after_s``
    protocol: str = ""  # "major.minor" its agent speaks
    role_pinned: bool = False  # an operator set its role: the planner leaves it there
    kv_link_ready: bool = True  # False: its engine is ready, its KV link still to prove (``instance``)

    @property
    def suspect_reason(self) -> str:
        """Why it is suspect ("" when it is not)."""
        if self.state != "suspect":
            return ""
        return health.suspect_reason(engine_state=self.engine_state, late=self.late, breaker=self.breaker)


class GatewayRegistry(Protocol):
    """What the gateway asks of a registry: the ``Registry`` itself, or a gateway worker's replica of it
    (``orchestrator.workers``), which forwards what changes state to the orchestrator's."""

    def snapshot(self) -> RegistrySnapshot: ...
    def get(self, agent_id: str) -> InstanceView | None: ...
    def acquire(self, agent_id: str) -> None: ...
    def release(self, agent_id: str) -> None: ...
    def hold(self, agent_id: str) -> None: ...
    def unhold(self, agent_id: str) -> None: ...
    def leg_succeeded(self, agent_id: str, partner: str | None = None) -> None: ...
    def leg_failed(
        self, agent_id: str, now: float, partner: str | None = None, *, instance_fault: bool = True
    ) -> None: ...
    def audit_dispatch(
        self, decode: str, request_id: str, prefill: str, tokens: int, now: float, key: int | None = None
    ) -> int | None: ...
    def audit_done(self, decode: str, key: int, now: float, *, answered: bool) -> None: ...
    def kv_sent(self, prefill: str, decode: str, tokens: int, now: float) -> None: ...


# Not frozen: one is built per decision (``with_in_flight``: the gateway's counts move with every
# request), and a frozen dataclass of these 15 fields cost 2.2 µs to build against 0.4 (each field set
# through ``object.__setattr__``). Nothing mutates one: its owner builds a new one.
@dataclass(slots=True)
class RegistrySnapshot:
    """What the scheduler and the admin API see: instances, in-flight counts, and per-model indexes.

    A heartbeat changes one instance's view, so a snapshot is rebuilt for every few requests in a busy
    cluster: only ``by_id`` is copied then. The per-model id tuples last as long as the membership,
    and the tuples of views (``by_model``, ``ready_prefill``, ``ready_decode``, ``instances``) are
    built on first use (at 1,024 instances building them all took 57 µs per snapshot).
    """

    version: int  # changes with every change to any instance (a heartbeat's metrics included)
    # Changes only when an instance joins, leaves, or changes state (ready, draining, dead...); with
    # ``registry_id`` it keys caches of anything that depends on who is there, not on metrics.
    membership: int
    registry_id: int
    by_id: Mapping[str, InstanceView]  # in join order
    in_flight: Mapping[str, int]
    known_models: frozenset[str]  # served by an instance in any state, dead included
    model_ids: Mapping[str, tuple[str, ...]]  # model -> its instances in any state, by agent id
    prefill_ids: Mapping[str, tuple[str, ...]]  # model -> ready instances that can prefill
    decode_ids: Mapping[str, tuple[str, ...]]  # model -> ready instances that can decode
    # (prefill id, decode id) pairs whose link breaker lets no request through now.
    blocked_links: frozenset[tuple[str, str]] = frozenset()
    # The view tuples built so far, shared by the snapshots that differ only in in-flight counts.
    _built: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Gateway requests on an instance that have ended since its newest metrics were scraped (at least;
    # ``in_flight.InFlight.ended``): what its scraped queue has lost since (``predict.queued_now``).
    ended_since_scrape: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    links: LinkTable = EMPTY_LINKS  # learned P->D transfer rates (``link_table``)
    # How far its source's log of changed instances went (``changes.py``); None: not known.
    changes: ChangeMark | None = None

    @property
    def instances(self) -> tuple[InstanceView, ...]:
        """Every instance, in join order."""
        built = self._built.get("instances")
        if built is None:
            built = self._built["instances"] = tuple(self.by_id.values())
        return built

    @property
    def by_model(self) -> Mapping[str, tuple[InstanceView, ...]]:
        """Model -> its instances in any state, by agent id."""
        return self._views_of("by_model", self.model_ids)

    @property
    def ready_prefill(self) -> Mapping[str, tuple[InstanceView, ...]]:
        """Model -> ready instances that can prefill."""
        return self._views_of("ready_prefill", self.prefill_ids)

    @property
    def ready_decode(self) -> Mapping[str, tuple[InstanceView, ...]]:
        """Model -> ready instances that can decode."""
        return self._views_of("ready_decode", self.decode_ids)

    def _views_of(
        self, name: str, ids: Mapping[str, tuple[str, ...]]
    ) -> Mapping[str, tuple[InstanceView, ...]]:
        built = self._built.get(name)
        if built is None:
            pick = self.by_id.__getitem__
            built = self._built[name] = MappingProxyType({m: tuple(map(pick, i)) for m, i in ids.items()})
        return built

    @property
    def pool_members(self) -> Mapping[str, tuple[str, ...]]:
        """Agent whose KV pool several engines share (one per host) -> the other instances using it."""
        built = self._built.get("pool_members")
        if built is None:
            members: dict[str, list[str]] = {}
            for v in self.by_id.values():
                if v.info.kv_pool_node:
                    members.setdefault(v.info.kv_pool_node, []).append(v.agent_id)
            built = self._built["pool_members"] = MappingProxyType({o: tuple(m) for o, m in members.items()})
        return built

    def in_flight_of(self, agent_id: str) -> int:
        """Gateway requests outstanding on an instance."""
        return self.in_flight.get(agent_id, 0)

    def ready_models(self) -> list[str]:
        """Models at least one ready instance serves, sorted."""
        return sorted(set(self.prefill_ids) | set(self.decode_ids))


def pool_of(view: InstanceView) -> str:
    """The agent whose KV pool ``view``'s engine uses: its host's shared one, or its own agent's."""
    return view.info.kv_pool_node or view.agent_id


class SnapshotSource:
    """Views kept copy-on-write and the snapshots built from them, cached until something changes: the
    ``Registry``'s, and a gateway worker's replica of it. A subclass says the in-flight counts."""

    def __init__(self) -> None:
        self._version = 0
        self._membership = 0
        self._id = next(REGISTRY_IDS)
        # Views are rebuilt per changed instance, not per snapshot: a snapshot of 1,024 instances after
        # one heartbeat costs a few dict/tuple copies, not 1,024 new views.
        self._views: dict[str, InstanceView] = {}
        # Copy-on-write: the last snapshot shares ``_views`` (no 1,024-entry copy per snapshot); the next
        # change copies it first (``_own_views``), so a snapshot never sees a later change. The copy then
        # falls in heartbeat handling, not in a request's decision.
        self._views_shared = False
        self._groups: IdGroups | None = None  # agent ids per model / ready role; rebuilt on membership
        self._blocked: frozenset[tuple[str, str]] = frozenset()
        self._cached: RegistrySnapshot | None = None
        self._cached_in_flight: dict[str, int] | None = None
        # Gateway requests per instance: this process's (legs and held decisions) and others' as told.
        self._flight = InFlight()
        self._link_table = EMPTY_LINKS  # what ``link_rates`` learned, as of the last change
        self._changes = ChangeLog()  # instances whose view or in-flight count changed

    def _use_links(self, table: LinkTable) -> None:
        """Snapshots carry ``table`` from now on (a new snapshot only when it is a new table)."""
        if table is not self._link_table:
            self._link_table = table
            self._version += 1
            self._cached = None

    def _own_views(self) -> dict[str, InstanceView]:
        """``_views``, copied first if a snapshot shares it."""
        if self._views_shared:
            self._views = dict(self._views)
            self._views_shared = False
        return self._views

    def _scraped(self, agent_id: str) -> None:
        """``agent_id``'s metrics come from a new scrape: its ``ended_since_scrape`` starts over."""
        self._flight.scraped(agent_id)
        self._cached_in_flight = None

    def snapshot(self) -> RegistrySnapshot:
        """An immutable view; the instance part is rebuilt only when something changed."""
        cached = self._cached
        if cached is None:
            cached = self._cached = self._build()
            self._cached_in_flight = None
        if self._cached_in_flight is None:
            self._cached_in_flight = self._flight.counts()  # a new dict: the snapshot keeps it
            ended = self._flight.ended()
            cached = self._cached = with_in_flight(
                cached, self._cached_in_flight, ended, self._changes.mark()
            )
        return cached

    def _note_counts(self, before: Mapping[str, int], after: Mapping[str, int]) -> None:
        """In-flight counts from elsewhere went from ``before`` to ``after``: note who changed."""
        self._changes.note_all(a for a in before.keys() | after.keys() if before.get(a) != after.get(a))

    def _build(self) -> RegistrySnapshot:
        views = self._views
        self._views_shared = True
        groups = self._groups
        if groups is None:
            groups = self._groups = IdGroups.of(views.values())
        return RegistrySnapshot(
            version=self._version,
            membership=self._membership,
            registry_id=self._id,
            by_id=MappingProxyType(views),
            in_flight={},
            known_models=groups.known_models,
            model_ids=groups.by_model,
            prefill_ids=groups.prefill,
            decode_ids=groups.decode,
            blocked_links=self._blocked,
            links=self._link_table,
        )


def sum_counts(first: Mapping[str, int], second: Mapping[str, int]) -> dict[str, int]:
    """Two in-flight count maps added up."""
    counts = dict(first)
    for agent_id, n in second.items():
        counts[agent_id] = counts.get(agent_id, 0) + n
    return counts


@dataclass(frozen=True, slots=True)
class IdGroups:
    """Agent ids grouped the ways snapshots index them; valid until membership changes."""

    known_models: frozenset[str]
    by_model: Mapping[str, tuple[str, ...]]  # every state, sorted by agent id
    prefill: Mapping[str, tuple[str, ...]]  # ready and prefill-capable
    decode: Mapping[str, tuple[str, ...]]  # ready and decode-capable

    @staticmethod
    def of(views: Iterable[InstanceView]) -> IdGroups:
        by_model: dict[str, list[str]] = {}
        prefill: dict[str, list[str]] = {}
        decode: dict[str, list[str]] = {}
        for v in views:
            model = v.info.model
            by_model.setdefault(model, []).append(v.agent_id)
            if v.state != "ready":
                continue
            if v.info.role in PREFILL_ROLES:
                prefill.setdefault(model, []).append(v.agent_id)
            if v.info.role in DECODE_ROLES:
                decode.setdefault(model, []).append(v.agent_id)
        return IdGroups(
            known_models=frozenset(by_model),
            by_model=MappingProxyType({m: tuple(sorted(ids)) for m, ids in by_model.items()}),
            prefill=MappingProxyType({m: tuple(ids) for m, ids in prefill.items()}),
            decode=MappingProxyType({m: tuple(ids) for m, ids in decode.items()}),
        )


def with_in_flight(
    snap: RegistrySnapshot,
    in_flight: dict[str, int],
    ended: dict[str, int] | None = None,
    changes: ChangeMark | None = None,
) -> RegistrySnapshot:
    # A new outer object sharing the (immutable) instance indexes: O(1) apart from the count copy.
    return RegistrySnapshot(
        version=snap.version,
        membership=snap.membership,
        registry_id=snap.registry_id,
        by_id=snap.by_id,
        # The dict itself, the snapshot's alone (``InFlight.counts`` builds a new one), not a read-only
        # proxy: the scheduler reads it per candidate, and a proxy's ``get`` is a method call through
        # the proxy (twice a dict's instructions here). Its type says Mapping: nobody writes to it.
        in_flight=in_flight,
        known_models=snap.known_models,
        model_ids=snap.model_ids,
        prefill_ids=snap.prefill_ids,
        decode_ids=snap.decode_ids,
        blocked_links=snap.blocked_links,
        _built=snap._built,
        ended_since_scrape=MappingProxyType(ended or {}),
        links=snap.links,
        changes=changes,
    )
