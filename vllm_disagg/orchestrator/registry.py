"""The one owner of mutable instance state; everything else reads immutable snapshots.

States of an instance (one per agent id)::

    joining   Hello accepted, engine not (or no longer) ready      never routed to
    ready     heartbeat says engine "ready" and nobody is draining  routed to
    draining  the agent or an operator drains it                    never routed to (new requests)
    dead      heartbeat timeout, Goodbye, or engine "stopped"       never routed to; kept for the admin API

A dead instance comes back only through a new Hello (a new session). Every method is synchronous and
cheap: the control plane calls them per frame, the gateway per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, MetricsSnapshot, Role

InstanceState = Literal["joining", "ready", "draining", "dead"]
INSTANCE_STATES: tuple[InstanceState, ...] = ("joining", "ready", "draining", "dead")

# Roles that may serve each leg of a request.
PREFILL_ROLES: frozenset[Role] = frozenset(("prefill", "both"))
DECODE_ROLES: frozenset[Role] = frozenset(("decode", "both"))

_EMPTY_METRICS = MetricsSnapshot()
_REGISTRY_IDS = itertools.count(1)


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


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    """What the scheduler and the admin API see: instances, in-flight counts, and per-model indexes."""

    version: int  # changes with every change to any instance (a heartbeat's metrics included)
    # Changes only when an instance joins, leaves, or changes state (ready, draining, dead...); with
    # ``registry_id`` it keys caches of anything that depends on who is there, not on metrics.
    membership: int
    registry_id: int
    instances: tuple[InstanceView, ...]
    by_id: Mapping[str, InstanceView]
    in_flight: Mapping[str, int]
    known_models: frozenset[str]  # served by an instance in any state, dead included
    by_model: Mapping[str, tuple[InstanceView, ...]]  # model -> its instances in any state, by agent id
    ready_prefill: Mapping[str, tuple[InstanceView, ...]]  # model -> ready instances that can prefill
    ready_decode: Mapping[str, tuple[InstanceView, ...]]  # model -> ready instances that can decode

    def in_flight_of(self, agent_id: str) -> int:
        """Gateway requests outstanding on an instance."""
        return self.in_flight.get(agent_id, 0)

    def ready_models(self) -> list[str]:
        """Models at least one ready instance serves, sorted."""
        return sorted(set(self.ready_prefill) | set(self.ready_decode))


@dataclass(slots=True)
class _Instance:
    """The registry's private, mutable record."""

    agent_id: str
    info: InstanceInfo
    session: int
    joined_at: float
    last_heartbeat: float
    state: InstanceState = "joining"
    engine_state: EngineState = "starting"
    agent_draining: bool = False
    admin_draining: bool = False
    heartbeats: int = 0
    metrics: MetricsSnapshot = field(default_factory=MetricsSnapshot)
    dead_reason: str = ""

    def derive_state(self) -> InstanceState:
        """The state a live session is in, from what the agent and the operator said last."""
        if self.engine_state == "stopped":
            return "dead"
        if self.agent_draining or self.admin_draining:
            return "draining"
        return "ready" if self.engine_state == "ready" else "joining"

    def view(self) -> InstanceView:
        return InstanceView(
            agent_id=self.agent_id,
            info=self.info,
            state=self.state,
            session=self.session,
            engine_state=self.engine_state,
            agent_draining=self.agent_draining,
            admin_draining=self.admin_draining,
            joined_at=self.joined_at,
            last_heartbeat=self.last_heartbeat,
            heartbeats=self.heartbeats,
            metrics=self.metrics,
            dead_reason=self.dead_reason,
        )


class Registry:
    """Instances by agent id, their state machine, and the gateway's in-flight counts."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        self._timeout = heartbeat_timeout_s
        self._instances: dict[str, _Instance] = {}
        self._in_flight: dict[str, int] = {}
        self._requests_total: dict[str, int] = {}  # by agent id, over all its sessions
        self._version = 0
        self._membership = 0
        self._id = next(_REGISTRY_IDS)
        # Views are rebuilt per changed instance, not per snapshot: a snapshot of 1,024 instances after
        # one heartbeat costs a few dict/tuple copies, not 1,024 new views.
        self._views: dict[str, InstanceView] = {}
        self._groups: _Groups | None = None  # agent ids per model / ready role; rebuilt on membership
        self._cached: RegistrySnapshot | None = None
        self._cached_in_flight: dict[str, int] | None = None

    @property
    def heartbeat_timeout_s(self) -> float:
        """No heartbeat for this long and an instance is dead."""
        return self._timeout

    def _changed(self, inst: _Instance, membership: bool) -> None:
        self._views[inst.agent_id] = inst.view()
        self._version += 1
        self._cached = None
        if membership:
            self._membership += 1
            self._groups = None

    def hello(self, agent_id: str, info: InstanceInfo, now: float) -> InstanceView:
        """Start a new session for ``agent_id`` (first time, after death, or an agent that restarted)."""
        old = self._instances.get(agent_id)
        inst = _Instance(
            agent_id=agent_id,
            info=info,
            session=(old.session + 1) if old else 1,
            joined_at=now,
            last_heartbeat=now,
        )
        self._instances[agent_id] = inst
        self._changed(inst, membership=True)
        return self._views[agent_id]

    def heartbeat(self, agent_id: str, hb: Heartbeat, now: float) -> InstanceView | None:
        """Record a heartbeat; None when ``agent_id`` has no live session (it must say Hello again)."""
        inst = self._instances.get(agent_id)
        if inst is None or inst.state == "dead":
            return None
        before = (inst.state, inst.agent_draining)
        inst.last_heartbeat = now
        inst.heartbeats += 1
        inst.metrics = hb.metrics
        inst.engine_state = hb.engine_state
        inst.agent_draining = hb.draining
        inst.state = inst.derive_state()
        if inst.state == "dead":
            inst.dead_reason = "engine stopped"
        self._changed(inst, membership=(inst.state, inst.agent_draining) != before)
        return self._views[agent_id]

    def goodbye(self, agent_id: str, reason: str = "") -> InstanceView | None:
        """The agent left on purpose; None when it was not known."""
        inst = self._instances.get(agent_id)
        if inst is None:
            return None
        if inst.state != "dead":
            self._kill(inst, f"goodbye: {reason}" if reason else "goodbye")
        return self._views[agent_id]

    def expire(self, now: float) -> list[str]:
        """Mark dead every live instance silent for ``heartbeat_timeout_s`` or more; their ids."""
        dead = [
            inst
            for inst in self._instances.values()
            if inst.state != "dead" and now - inst.last_heartbeat >= self._timeout
        ]
        for inst in dead:
            self._kill(inst, f"no heartbeat for {now - inst.last_heartbeat:.3f}s")
        return [inst.agent_id for inst in dead]

    def _kill(self, inst: _Instance, reason: str) -> None:
        inst.state = "dead"
        inst.dead_reason = reason
        self._changed(inst, membership=True)

    def set_admin_drain(self, agent_id: str, draining: bool) -> InstanceView:
        """An operator drains (or undrains) an instance; takes effect for the very next request."""
        inst = self._instances[agent_id]
        inst.admin_draining = draining
        if inst.state != "dead":
            inst.state = inst.derive_state()
        self._changed(inst, membership=True)
        return self._views[agent_id]

    def get(self, agent_id: str) -> InstanceView | None:
        """One instance, or None."""
        return self._views.get(agent_id)

    def is_live(self, agent_id: str) -> bool:
        """True when ``agent_id`` has a session that is not dead."""
        inst = self._instances.get(agent_id)
        return inst is not None and inst.state != "dead"

    def requests_total(self, agent_id: str) -> int:
        """Requests the gateway has sent to ``agent_id`` since the orchestrator started."""
        return self._requests_total.get(agent_id, 0)

    def acquire(self, agent_id: str) -> None:
        """The gateway sends a request to ``agent_id``; pair with ``release`` in a ``finally``."""
        self._in_flight[agent_id] = self._in_flight.get(agent_id, 0) + 1
        self._cached_in_flight = None
        self._requests_total[agent_id] = self._requests_total.get(agent_id, 0) + 1

    def release(self, agent_id: str) -> None:
        """A request sent to ``agent_id`` is over (success, failure or cancellation)."""
        count = self._in_flight.get(agent_id, 0)
        if count <= 1:
            self._in_flight.pop(agent_id, None)
        else:
            self._in_flight[agent_id] = count - 1
        self._cached_in_flight = None

    def snapshot(self) -> RegistrySnapshot:
        """An immutable view; the instance part is rebuilt only when something changed."""
        cached = self._cached
        if cached is None:
            cached = self._cached = self._build()
            self._cached_in_flight = None
        if self._cached_in_flight is None:
            self._cached_in_flight = dict(self._in_flight)
            cached = self._cached = _with_in_flight(cached, self._cached_in_flight)
        return cached

    def _build(self) -> RegistrySnapshot:
        views = self._views
        groups = self._groups
        if groups is None:
            groups = self._groups = _Groups.of(views.values())
        pick = views.__getitem__
        return RegistrySnapshot(
            version=self._version,
            membership=self._membership,
            registry_id=self._id,
            instances=tuple(views.values()),
            by_id=MappingProxyType(dict(views)),
            in_flight=MappingProxyType({}),
            known_models=groups.known_models,
            by_model=MappingProxyType({m: tuple(map(pick, ids)) for m, ids in groups.by_model.items()}),
            ready_prefill=MappingProxyType({m: tuple(map(pick, ids)) for m, ids in groups.prefill.items()}),
            ready_decode=MappingProxyType({m: tuple(map(pick, ids)) for m, ids in groups.decode.items()}),
        )


@dataclass(frozen=True, slots=True)
class _Groups:
    """Agent ids grouped the ways snapshots index them; valid until membership changes."""

    known_models: frozenset[str]
    by_model: Mapping[str, tuple[str, ...]]  # every state, sorted by agent id
    prefill: Mapping[str, tuple[str, ...]]  # ready and prefill-capable
    decode: Mapping[str, tuple[str, ...]]  # ready and decode-capable

    @staticmethod
    def of(views: Iterable[InstanceView]) -> _Groups:
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
        return _Groups(
            known_models=frozenset(by_model),
            by_model={m: tuple(sorted(ids)) for m, ids in by_model.items()},
            prefill={m: tuple(ids) for m, ids in prefill.items()},
            decode={m: tuple(ids) for m, ids in decode.items()},
        )


def _with_in_flight(snap: RegistrySnapshot, in_flight: dict[str, int]) -> RegistrySnapshot:
    # A new outer object sharing the (immutable) instance indexes: O(1) apart from the count copy.
    return RegistrySnapshot(
        version=snap.version,
        membership=snap.membership,
        registry_id=snap.registry_id,
        instances=snap.instances,
        by_id=snap.by_id,
        in_flight=MappingProxyType(in_flight),
        known_models=snap.known_models,
        by_model=snap.by_model,
        ready_prefill=snap.ready_prefill,
        ready_decode=snap.ready_decode,
    )
