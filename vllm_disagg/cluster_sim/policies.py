"""The routing policies the simulator compares: what toy proxies do, and ours.

Baselines always disaggregate (a P and a D per request) and know nothing of caches or latency:

- ``round-robin``: P and D in turn;
- ``random``: P and D at random (seeded by the request id: replayable);
- ``least-loaded``: the P and the D with the fewest requests in flight from the gateway;
- ``power-of-two``: of two random instances per role, the less loaded.

``ours`` is the orchestrator's plugin scheduler with its configured plugins (``--scheduler-config``
or the shipped default), with the planner when one is given. Each baseline is a ``Scheduler``, so
the simulator drives all of them through the same ``route_request`` and retry picks.

``VARIANTS`` are ours' scheduler (that config) without the planner, for the topology evidence
(docs/benchmarks.md): ``today`` without pairing nor topology scoring (P and D ranked apart), ``joint``
with its transfer pairing (P and D chosen together on learned link rates), ``joint-topo`` with the
pairing and the topology-scorer weighted 1 in both profiles.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace

from vllm_disagg.errors import ConfigError, ModelNotFound, NoCapacity
from vllm_disagg.orchestrator.scheduling.config import SchedulerConfig
from vllm_disagg.orchestrator.scheduling.framework import Decision, Scheduler, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

Pick = Callable[[Sequence[InstanceView], SchedulingRequest, RegistrySnapshot, str], InstanceView]


def _draw(request: SchedulingRequest, salt: str) -> int:
    key = f"{request.request_id}/{salt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


class _Baseline:
    """A P and a D by ``pick`` among the ready instances of each pool; always disaggregated."""

    name = "baseline"

    def __init__(self, pick: Pick) -> None:
        self._pick = pick

    def _choose(
        self, pool: Sequence[InstanceView], request: SchedulingRequest, snapshot: RegistrySnapshot, role: str
    ) -> InstanceView | None:
        candidates = [v for v in pool if v.agent_id not in request.exclude]
        return self._pick(candidates, request, snapshot, role) if candidates else None

    def decide(self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float) -> Decision:
        if request.model not in snapshot.known_models:
            raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")
        d = self._choose(snapshot.ready_decode.get(request.model, ()), request, snapshot, "decode")
        if d is None:
            raise NoCapacity(f"no decode instance of {request.model!r} is ready")
        p = self._choose(snapshot.ready_prefill.get(request.model, ()), request, snapshot, "prefill")
        if p is None or p.agent_id == d.agent_id:
            return Decision("colocated", None, d.agent_id)
        return Decision("disaggregated", p.agent_id, d.agent_id)

    def pick_prefill(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, decode: str
    ) -> str | None:
        pool = [v for v in snapshot.ready_prefill.get(request.model, ()) if v.agent_id != decode]
        p = self._choose(pool, request, snapshot, "prefill-retry")
        return p.agent_id if p is not None else None

    def pick_decode(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, prefill: str | None
    ) -> str | None:
        d = self._choose(snapshot.ready_decode.get(request.model, ()), request, snapshot, "decode-retry")
        return d.agent_id if d is not None else None


class RoundRobin(_Baseline):
    """Each pool in turn (a counter per role, as a proxy keeps one)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        super().__init__(self._turn)

    def _turn(
        self, pool: Sequence[InstanceView], r: SchedulingRequest, s: RegistrySnapshot, role: str
    ) -> InstanceView:
        n = self._next.get(role, 0)
        self._next[role] = n + 1
        return pool[n % len(pool)]


def _random(
    pool: Sequence[InstanceView], r: SchedulingRequest, s: RegistrySnapshot, role: str
) -> InstanceView:
    return pool[_draw(r, role) % len(pool)]


def _least(
    pool: Sequence[InstanceView], r: SchedulingRequest, s: RegistrySnapshot, role: str
) -> InstanceView:
    return min(pool, key=lambda v: (s.in_flight_of(v.agent_id), _draw(r, role + v.agent_id)))


def _two(pool: Sequence[InstanceView], r: SchedulingRequest, s: RegistrySnapshot, role: str) -> InstanceView:
    a, b = pool[_draw(r, role + "/1") % len(pool)], pool[_draw(r, role + "/2") % len(pool)]
    return a if s.in_flight_of(a.agent_id) <= s.in_flight_of(b.agent_id) else b


class RandomPolicy(_Baseline):
    name = "random"

    def __init__(self) -> None:
        super().__init__(_random)


class LeastLoaded(_Baseline):
    name = "least-loaded"

    def __init__(self) -> None:
        super().__init__(_least)


class PowerOfTwo(_Baseline):
    name = "power-of-two"

    def __init__(self) -> None:
        super().__init__(_two)


BASELINES: dict[str, Callable[[], Scheduler]] = {
    "round-robin": RoundRobin,
    "random": RandomPolicy,
    "least-loaded": LeastLoaded,
    "power-of-two": PowerOfTwo,
}
POLICIES = (*BASELINES, "ours")


def make_scheduler(policy: str, scheduler: PluginScheduler | None = None) -> Scheduler:
    """The scheduler of ``policy`` (``ours``: ``scheduler``, or the shipped default)."""
    if policy == "ours":
        return scheduler or PluginScheduler()
    factory = BASELINES.get(policy)
    if factory is None:
        raise ValueError(f"unknown policy {policy!r}; one of {list(POLICIES)}")
    return factory()


VARIANTS = ("today", "joint", "joint-topo")
_TOPOLOGY_SCORER = "topology-scorer"


def variant_config(name: str, config: SchedulerConfig) -> SchedulerConfig:
    """``config`` as the variant ``name`` (``VARIANTS``)."""
    if name != "today" and config.pairing is None:
        raise ConfigError(f"policy {name}: the scheduler config has no pairing")
    weight = 1.0 if name == "joint-topo" else 0.0
    profiles = {
        key: replace(
            profile,
            scorers=tuple(
                (ref, weight if config.plugins[ref].type == _TOPOLOGY_SCORER else w)
                for ref, w in profile.scorers
            ),
        )
        for key, profile in config.profiles.items()
    }
    return replace(config, profiles=profiles, pairing=None if name == "today" else config.pairing)


def scheduler_for(policy: str, config: SchedulerConfig) -> Scheduler:
    """The scheduler of ``policy``: a baseline, ours on ``config``, or a variant of it."""
    if policy in VARIANTS:
        return PluginScheduler(variant_config(policy, config))
    return make_scheduler(policy, PluginScheduler(config) if policy == "ours" else None)
