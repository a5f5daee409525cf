"""The simulated cluster's KV links: what a P->D transfer takes, the slow-link faults, and what the
decode engines' NIXL counters show the registry, which learns the links from them as in production
(``orchestrator.state.link_rates``).

Without a topology a transfer takes the profile's ``transfer_s`` of the whole prompt, slowed by the
faults on its way, and nothing is learned (the engines report no KV counters), as before topologies.
With one (``topology.Topology``) it moves the prompt tokens D does not cache (the KV index's count
when the request was decided) at the pair's link rate: ``link_latency_s + tokens x
kv_transfer_s_per_token + tokens x kv_bytes_per_token / rate``, times the slowdown. The gateway's
``kv_sent`` goes to the registry as the decode leg is dispatched, and D's counters
(``kv_in_bytes``, ``kv_in_seconds``) grow by the transfer at once, so D's next heartbeat carries the
sample (the simulator knows the transfer's duration up front; a real engine counts it when done).
"""

from __future__ import annotations

from vllm_disagg.cluster_sim.engine import Engine
from vllm_disagg.cluster_sim.faults import SlowLinks
from vllm_disagg.cluster_sim.profile import EngineProfile
from vllm_disagg.cluster_sim.topology import Location, Topology, labels_of
from vllm_disagg.cluster_sim.virtual_clock import EventLoop
from vllm_disagg.orchestrator.state.registry import Registry

_NEW_REVISION = "-r2"  # a rollout's instance, ``<old id>-r2``, takes its predecessor's place


class Network:
    """Transfer times, slow links, and the links' learning, for one simulated cluster."""

    __slots__ = ("_loop", "_registry", "profile", "slow", "topology", "where")

    def __init__(
        self,
        profile: EngineProfile,
        topology: Topology | None,
        instances: tuple[int, int],  # (prefill, decode) at the start
        registry: Registry,
        loop: EventLoop,
    ) -> None:
        self.profile, self.topology = profile, topology
        self.where: dict[str, Location] = topology.place(*instances) if topology is not None else {}
        self.slow = SlowLinks(self.where)
        self._registry, self._loop = registry, loop

    def location(self, agent_id: str) -> Location | None:
        """The GPU ``agent_id`` runs on, if the cluster has a topology."""
        if not self.where:
            return None
        return self.where.get(agent_id) or self.where.get(agent_id.removesuffix(_NEW_REVISION))

    def labels(self, agent_id: str) -> dict[str, str]:
        """The topology labels of ``agent_id``'s Hello (none without a topology)."""
        location = self.location(agent_id)
        return labels_of(location) if location is not None else {}

    def start(self, engine: Engine) -> None:
        """With a topology, ``engine`` reports KV counters from 0 on (the links are learned)."""
        if self.topology is not None and engine.kv_in_bytes is None:
            engine.kv_in_bytes = engine.kv_in_seconds = 0.0

    def fault(self, target: str, factor: float, for_s: float | None) -> None:
        """A slow-link fault from now, for ``for_s`` (None: for good)."""
        self.slow.slow(target, factor)
        if for_s is not None:
            self._loop.after(for_s, lambda: self.slow.restore(target))

    def pull(self, p: str, d: Engine, tokens: int, cached: int, now: float) -> float:
        """Seconds until ``d`` has the KV of a ``tokens``-token prompt from ``p``, ``cached`` of them
        already in ``d``'s cache; the registry hears of the send and ``d``'s counters count it."""
        factor = self.slow.factor(p, d.agent_id)
        topology, profile = self.topology, self.profile
        if topology is None:
            return profile.transfer_s(tokens, factor)
        lp, ld = self.location(p), self.location(d.agent_id)
        rate = topology.gbps(lp, ld) if lp is not None and ld is not None else topology.rack_gbps
        moved = max(0, tokens - cached)
        nbytes = moved * topology.kv_bytes_per_token
        seconds = factor * (
            profile.link_latency_s + moved * profile.kv_transfer_s_per_token + nbytes * 8 / (rate * 1e9)
        )
        if moved and d.kv_in_bytes is not None and d.kv_in_seconds is not None:
            self._registry.kv_sent(p, d.agent_id, moved, now)
            d.kv_in_bytes += nbytes
            d.kv_in_seconds += seconds
        return seconds
