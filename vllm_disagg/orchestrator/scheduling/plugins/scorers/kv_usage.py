"""kv-usage-scorer: an emptier KV cache scores higher: ``1 - kv_cache_usage``, clamped to [0, 1]."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, Term
from vllm_disagg.orchestrator.scheduling.terms import column
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

TYPE = "kv-usage-scorer"


@dataclass(frozen=True, slots=True)
class Params:
    """kv-usage-scorer has no parameters."""


class KvUsageScorer:
    """Scores ``1 - kv_cache_usage`` clamped to [0, 1]."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def score(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[float]:
        """One score per candidate in [0, 1]."""
        return column(self.term(), ctx, candidates)

    def term(self) -> Term:
        """The score of one candidate (``framework.TermScorer``)."""
        return _kv_usage


def _kv_usage(m: MetricsSnapshot, f: int, k: int, n: int, inv: float) -> float:
    # Written so that a NaN usage (a broken scrape) lands in a branch and never leaks out as a score.
    u = m.kv_cache_usage
    return 1.0 - u if 0.0 < u < 1.0 else (0.0 if u >= 1.0 else 1.0)


PLUGIN = PluginSpec(TYPE, Params, KvUsageScorer, "scorer")
