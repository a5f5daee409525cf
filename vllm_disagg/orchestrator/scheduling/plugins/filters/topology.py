"""topology-filter: never pairs a prefill and a decode instance across transfer domains (``required``
topology, per model; docs/scheduler.md, "Topology").

An instance's domain is its ``InstanceInfo.labels[domainKey]`` (an NVLink island, say). For the models
listed, the prefill profile keeps only P's in the chosen D's domain, and the decode profile keeps only
D's whose domain holds a ready prefill instance of the model (or, with a pinned prefill instance, only
D's in its domain). An unlabeled instance is never paired. Where no D has such a P, the decode profile
keeps every D and the prefill profile then finds none: the request is served colocated, and the
explanation says why each P was filtered (``reasons``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, SchedulingRequest
from vllm_disagg.orchestrator.state.views import PREFILL_ROLES, InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import LABEL_DOMAIN, LABEL_KEY

TYPE = "topology-filter"
ALL_MODELS = "*"


def check_topology_params(plugin: str, models: object, domain_key: object) -> tuple[str, ...]:
    """The model list as a tuple; ``ValueError`` for a list that is not of names or a bad label key."""
    if not isinstance(models, list | tuple) or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"{plugin}: models must be a list of model names (or '*'), got {models!r}")
    if not isinstance(domain_key, str) or not LABEL_KEY.fullmatch(domain_key):
        raise ValueError(f"{plugin}: domainKey must be a label key such as 'domain', got {domain_key!r}")
    return tuple(models)


@dataclass(frozen=True, slots=True)
class Params:
    """The models whose P and D must share a domain (``*``: every model; none by default) and the
    label that names the domain."""

    models: tuple[str, ...] = ()
    domain_key: str = LABEL_DOMAIN

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", check_topology_params(TYPE, self.models, self.domain_key))


def covers(models: tuple[str, ...], model: str) -> bool:
    """Whether a plugin configured for ``models`` applies to ``model``."""
    return ALL_MODELS in models or model in models


class PrefillDomains:
    """Domain -> the ready prefill instances of a model in it, kept per registry membership version
    (roles, states, drain flags and labels are membership fields)."""

    __slots__ = ("_key", "_memo", "_of")

    def __init__(self, key: str) -> None:
        self._key = key
        self._memo: dict[str, Mapping[str, frozenset[str]]] = {}
        self._of: tuple[int, int] = (0, -1)

    def of(self, snapshot: RegistrySnapshot, model: str) -> Mapping[str, frozenset[str]]:
        """The model's ready prefill instances by domain (unlabeled ones are in none)."""
        of = (snapshot.registry_id, snapshot.membership)
        if of != self._of:
            self._memo.clear()
            self._of = of
        hit = self._memo.get(model)
        if hit is None:
            found: dict[str, set[str]] = {}
            by_id, key = snapshot.by_id, self._key
            for agent_id in snapshot.model_ids.get(model, ()):
                v = by_id[agent_id]
                domain = v.info.labels.get(key)
                if domain and v.info.role in PREFILL_ROLES and _ready(v):
                    found.setdefault(domain, set()).add(agent_id)
            hit = self._memo[model] = {d: frozenset(ids) for d, ids in found.items()}
        return hit


def _ready(v: InstanceView) -> bool:
    return v.state == "ready" and not v.agent_draining and not v.admin_draining


def has_partner(domains: Mapping[str, frozenset[str]], key: str, d: InstanceView) -> bool:
    """Whether a ready prefill instance other than ``d`` shares ``d``'s domain."""
    ids = domains.get(d.info.labels.get(key, ""))
    return ids is not None and (len(ids) > 1 or d.agent_id not in ids)


class TopologyFilter:
    """P and D of the listed models only within one domain; unlabeled instances never paired."""

    TYPE: ClassVar[str] = TYPE
    PER_REQUEST: ClassVar[bool] = True  # the partner is the request's
    __slots__ = ("_domains", "name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params
        self._domains = PrefillDomains(params.domain_key)

    def applies(self, request: SchedulingRequest) -> bool:
        """Only the listed models' requests are filtered (the others leave no stage)."""
        return covers(self.params.models, request.model)

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """Candidates in the partner's domain; without a partner (the decode profile), the D's with a
        ready P in their domain, or every D when none has one (the request is then colocated)."""
        key, partner = self.params.domain_key, ctx.partner
        if not self.applies(ctx.request):  # as when the scheduler skips it (a pinned pair is checked)
            return candidates
        if partner is not None:
            domain = partner.info.labels.get(key)
            if domain is None:
                return []
            return [c for c in candidates if c.info.labels.get(key) == domain]
        if ctx.profile != "decode":
            return candidates
        domains = self._domains.of(ctx.snapshot, ctx.request.model)
        kept = [c for c in candidates if has_partner(domains, key, c)]
        return kept or candidates

    def reasons(self, ctx: ProfileContext, dropped: Sequence[InstanceView]) -> dict[str, str]:
        """Why each of ``dropped`` was filtered, for the explanation."""
        key, partner = self.params.domain_key, ctx.partner
        if partner is None:
            return {v.agent_id: f"no ready prefill instance shares its {key}" for v in dropped}
        domain = partner.info.labels.get(key)
        if domain is None:
            return {v.agent_id: f"{partner.agent_id} has no {key} label" for v in dropped}
        return {
            v.agent_id: f"not in {partner.agent_id}'s {key} {domain}"
            if v.info.labels.get(key)
            else f"no {key} label"
            for v in dropped
        }


PLUGIN = PluginSpec(TYPE, Params, TopologyFilter, "filter")
