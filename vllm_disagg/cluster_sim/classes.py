"""Who sends a trace's requests, and how urgent each is: the priority classes and tenants that the
admission queue orders by (docs/sim.md, "Admission").

``--priority-mix 0.2:-1,0.6:0,0.2:1`` (share:priority) and ``--tenants a:1:0.75,b:1:0.25``
(name:weight:share of the requests) describe a mix; ``with_classes`` assigns it to a trace's requests
from a seed, deterministically and lazily in arrival order, so that a longer trace extends a shorter
one. Priorities and tenants come from separate streams (changing one mix leaves the other's draws as
they were), and every turn of a multi-turn session keeps its first turn's class and tenant: a
conversation is one client's.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from vllm_disagg.cluster_sim.trace import Trace, TraceRequest

T = TypeVar("T")
_TENANT = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # what the gateway accepts in ``x-tenant-id``
_SUM_TOLERANCE = 1e-6


def _share(text: str, what: str) -> float:
    try:
        share = float(text)
    except ValueError:
        raise ValueError(f"{what}: the share {text!r} is not a number") from None
    if not 0 < share <= 1:
        raise ValueError(f"{what}: a share is in (0, 1], got {text}")
    return share


def _check_sum(shares: Sequence[float], what: str) -> None:
    total = sum(shares)
    if abs(total - 1) > _SUM_TOLERANCE:
        raise ValueError(f"{what}: the shares add up to {total:g}, not 1")


@dataclass(frozen=True, slots=True)
class PriorityMix:
    """Each priority's share of the requests."""

    shares: tuple[tuple[float, int], ...]  # (share, priority)

    def __post_init__(self) -> None:
        priorities = [p for _, p in self.shares]
        if len(set(priorities)) != len(priorities):
            raise ValueError(f"priority mix: a priority is named twice: {priorities}")
        _check_sum([s for s, _ in self.shares], "priority mix")

    @classmethod
    def parse(cls, text: str) -> PriorityMix:
        """``SHARE:PRIORITY[,...]``, e.g. ``0.2:-1,0.6:0,0.2:1``."""
        shares: list[tuple[float, int]] = []
        for part in text.split(","):
            share, sep, priority = part.strip().partition(":")
            try:
                value = int(priority)
            except ValueError:
                value = None
            if not sep or value is None:
                raise ValueError(f"priority mix: {part!r} is not SHARE:PRIORITY (e.g. 0.2:-1)")
            shares.append((_share(share, "priority mix"), value))
        return cls(tuple(shares))


@dataclass(frozen=True, slots=True)
class TenantMix:
    """Each tenant's weight in the fair sharing and share of the requests."""

    tenants: tuple[tuple[str, float, float], ...]  # (name, weight, share)

    def __post_init__(self) -> None:
        names = [n for n, _, _ in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenants: a tenant is named twice: {names}")
        _check_sum([s for _, _, s in self.tenants], "tenants")

    @classmethod
    def parse(cls, text: str) -> TenantMix:
        """``NAME:WEIGHT:SHARE[,...]``, e.g. ``a:1:0.75,b:1:0.25``."""
        tenants: list[tuple[str, float, float]] = []
        for part in text.split(","):
            fields = part.strip().split(":")
            if len(fields) != 3 or not _TENANT.fullmatch(fields[0]):
                raise ValueError(f"tenants: {part!r} is not NAME:WEIGHT:SHARE (e.g. a:1:0.75)")
            name, weight, share = fields
            try:
                value = float(weight)
            except ValueError:
                value = 0.0
            if not 0 < value < float("inf"):
                raise ValueError(f"tenants: {name}'s weight must be a number > 0, got {weight!r}")
            tenants.append((name, value, _share(share, "tenants")))
        return cls(tuple(tenants))

    def weights(self) -> tuple[tuple[str, float], ...]:
        """(name, weight) of each tenant, as ``AdmissionConfig.tenant_weights`` takes them."""
        return tuple((name, weight) for name, weight, _ in self.tenants)


class _Draw(Generic[T]):
    """One value per request from a stream, by share; a session's turns all get its first turn's."""

    def __init__(self, seed: str, values: Sequence[T], shares: Sequence[float]) -> None:
        self._rng = random.Random(seed)
        self._values = list(values)
        self._cumulative: list[float] = []
        total = 0.0
        for share in shares:
            total += share
            self._cumulative.append(total)
        self._sessions: dict[str, T] = {}

    def __call__(self, session: str) -> T:
        if session and session in self._sessions:
            return self._sessions[session]
        u = self._rng.random() * self._cumulative[-1]
        value = self._values[min(bisect.bisect_right(self._cumulative, u), len(self._values) - 1)]
        if session:
            self._sessions[session] = value
        return value


def with_classes(trace: Trace, priorities: PriorityMix | None, tenants: TenantMix | None, seed: int) -> Trace:
    """``trace`` with each request's priority and tenant drawn from the mixes (None: left as they are,
    priority 0 and tenant ``default`` unless the trace set them)."""
    if priorities is None and tenants is None:
        return trace
    priority = (
        _Draw(f"{seed}/priority", [p for _, p in priorities.shares], [s for s, _ in priorities.shares])
        if priorities
        else None
    )
    tenant = (
        _Draw(f"{seed}/tenant", [n for n, _, _ in tenants.tenants], [s for _, _, s in tenants.tenants])
        if tenants
        else None
    )
    requests: list[TraceRequest] = []
    for r in trace.requests:
        p = priority(r.session) if priority is not None else r.priority
        t = tenant(r.session) if tenant is not None else r.tenant
        requests.append(dataclasses.replace(r, priority=p, tenant=t))
    return Trace(trace.name, requests, trace.description)
