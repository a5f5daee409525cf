"""kv-usage-filter: keeps instances whose KV cache usage is below a ceiling."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.scheduling.plugins import check_real
from vllm_disagg.orchestrator.state.views import InstanceView

TYPE = "kv-usage-filter"


@dataclass(frozen=True, slots=True)
class Params:
    """``ceiling``: keep instances with ``kv_cache_usage`` strictly below it (0 < ceiling <= 1)."""

    ceiling: float = 0.95

    def __post_init__(self) -> None:
        check_real(TYPE, "ceiling", self.ceiling, gt=0.0, le=1.0)


class KvUsageFilter:
    """Keeps candidates with ``metrics.kv_cache_usage < ceiling``."""

    TYPE: ClassVar[str] = TYPE
    # Reads metrics, which every heartbeat moves: run per request, on the sampled candidates.
    PER_REQUEST: ClassVar[bool] = True
    PER_CANDIDATE: ClassVar[bool] = True  # each candidate's own usage: a ranked walk may filter one at a time
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """Candidates whose KV cache is less full than the ceiling."""
        ceiling = self.params.ceiling
        return [c for c in candidates if c.metrics.kv_cache_usage < ceiling]


PLUGIN = PluginSpec(TYPE, Params, KvUsageFilter, "filter")
