"""Every plugin type by its ``TYPE`` name: what the config builds profiles from."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec
from vllm_disagg.orchestrator.scheduling.plugins import pairing
from vllm_disagg.orchestrator.scheduling.plugins.deciders import kv_pool, uncached_tokens
from vllm_disagg.orchestrator.scheduling.plugins.filters import kv_compat, ready, role, slo
from vllm_disagg.orchestrator.scheduling.plugins.filters import kv_usage as kv_usage_filter
from vllm_disagg.orchestrator.scheduling.plugins.filters import topology as topology_filter
from vllm_disagg.orchestrator.scheduling.plugins.pickers import max_score, power_of_two, weighted_random
from vllm_disagg.orchestrator.scheduling.plugins.scorers import kv_usage as kv_usage_scorer
from vllm_disagg.orchestrator.scheduling.plugins.scorers import prefix, queue, tpot, ttft
from vllm_disagg.orchestrator.scheduling.plugins.scorers import topology as topology_scorer

_SPECS: tuple[PluginSpec, ...] = (
    role.PLUGIN,
    ready.PLUGIN,
    kv_compat.PLUGIN,
    kv_usage_filter.PLUGIN,
    slo.PLUGIN,
    topology_filter.PLUGIN,
    queue.PLUGIN,
    kv_usage_scorer.PLUGIN,
    ttft.PLUGIN,
    tpot.PLUGIN,
    prefix.PLUGIN,
    topology_scorer.PLUGIN,
    max_score.PLUGIN,
    power_of_two.PLUGIN,
    weighted_random.PLUGIN,
    uncached_tokens.PLUGIN,
    kv_pool.PLUGIN,
    pairing.PLUGIN,
)

PLUGIN_SPECS: Mapping[str, PluginSpec] = MappingProxyType({spec.type: spec for spec in _SPECS})
