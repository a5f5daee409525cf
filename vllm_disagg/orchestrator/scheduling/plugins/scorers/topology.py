"""topology-scorer: prefers a prefill and a decode instance in one transfer domain (``preferred``
topology, per model; docs/scheduler.md, "Topology").

In the prefill profile a P scores 1 in the chosen D's domain, ``zoneScore`` in its zone only, else 0.
In the decode profile (or against a pinned P) a D scores the same against the best ready P it could
be paired with: 1 where one shares its domain, ``zoneScore`` where one shares only its zone. Unlabeled
instances score 0, and so does every candidate of a model not listed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.scheduling.plugins import check_real
from vllm_disagg.orchestrator.scheduling.plugins.filters.topology import (
    ALL_MODELS,
    PrefillDomains,
    check_topology_params,
    covers,
    has_partner,
)
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import LABEL_DOMAIN, LABEL_KEY, LABEL_ZONE

TYPE = "topology-scorer"


@dataclass(frozen=True, slots=True)
class Params:
    """The models scored (every one by default), the labels naming a domain and a zone, and the score
    of a pair that shares only a zone."""

    models: tuple[str, ...] = (ALL_MODELS,)
    domain_key: str = LABEL_DOMAIN
    zone_key: str = LABEL_ZONE
    zone_score: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", check_topology_params(TYPE, self.models, self.domain_key))
        if not isinstance(self.zone_key, str) or not LABEL_KEY.fullmatch(self.zone_key):
            raise ValueError(f"{TYPE}: zoneKey must be a label key such as 'zone', got {self.zone_key!r}")
        check_real(TYPE, "zone_score", self.zone_score, ge=0.0, le=1.0)


class TopologyScorer:
    """1 for a pair in one domain, ``zone_score`` for one in one zone only, else 0."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("_domains", "_zones", "name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params
        self._domains = PrefillDomains(params.domain_key)
        self._zones = PrefillDomains(params.zone_key)

    def score(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[float]:
        """One score per candidate in [0, 1]."""
        p = self.params
        if not covers(p.models, ctx.request.model):
            return [0.0] * len(candidates)
        partner = ctx.partner
        if partner is not None:
            labels = partner.info.labels
            domain, zone = labels.get(p.domain_key), labels.get(p.zone_key)
            return [
                1.0
                if domain is not None and c.info.labels.get(p.domain_key) == domain
                else p.zone_score
                if zone is not None and c.info.labels.get(p.zone_key) == zone
                else 0.0
                for c in candidates
            ]
        if ctx.profile != "decode":
            return [0.0] * len(candidates)
        domains = self._domains.of(ctx.snapshot, ctx.request.model)
        zones = self._zones.of(ctx.snapshot, ctx.request.model)
        return [
            1.0
            if has_partner(domains, p.domain_key, c)
            else p.zone_score
            if has_partner(zones, p.zone_key, c)
            else 0.0
            for c in candidates
        ]


PLUGIN = PluginSpec(TYPE, Params, TopologyScorer, "scorer")
