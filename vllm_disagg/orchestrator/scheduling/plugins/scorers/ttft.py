"""ttft-scorer: a lower predicted time to first token scores higher.

``score = slo_s / (slo_s + predicted)``, where ``predicted`` is ``predict.ttft_s`` (the one TTFT
formula: queue time, then the backlog and this prompt's uncached tokens at the measured prefill rate;
docs/scheduler.md, Predictions). A candidate predicted to meet the SLO exactly scores 0.5; an idle one
with the whole prompt cached scores 1. The metrics come from the instance's last heartbeat; the
in-flight count is the gateway's own, which covers requests sent since.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, Term
from vllm_disagg.orchestrator.scheduling.plugins import check_real
from vllm_disagg.orchestrator.scheduling.predict import ttft_s
from vllm_disagg.orchestrator.scheduling.terms import column
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

TYPE = "ttft-scorer"


@dataclass(frozen=True, slots=True)
class Params:
    """``slo_s``: the TTFT target (score 0.5 there); ``default_prefill_tokens_per_s``: when unmeasured."""

    slo_s: float = 1.0
    default_prefill_tokens_per_s: float = 4096

    def __post_init__(self) -> None:
        check_real(TYPE, "slo_s", self.slo_s, gt=0.0)
        check_real(TYPE, "default_prefill_tokens_per_s", self.default_prefill_tokens_per_s, gt=0.0)


class TtftScorer:
    """Scores ``slo / (slo + predict.ttft_s)``."""

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
        slo, default = self.params.slo_s, self.params.default_prefill_tokens_per_s

        def ttft(m: MetricsSnapshot, f: int, k: int, n: int, inv: float) -> float:
            p = ttft_s(m, f, k, n, default)
            return slo / (slo + p) if p >= 0.0 else 0.0  # a prediction below 0 or NaN: the worst

        return ttft


PLUGIN = PluginSpec(TYPE, Params, TtftScorer, "scorer")
