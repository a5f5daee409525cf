"""tpot-scorer: a lower predicted time per output token scores higher.

``score = slo_s / (slo_s + predicted)``, 0.5 at the SLO, where ``predicted`` is ``predict.tpot_s`` (the
one TPOT formula: the measured inter-token latency scaled by how much bigger the batch gets once the
requests the gateway has sent and this one join it; docs/scheduler.md, Predictions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, Term
from vllm_disagg.orchestrator.scheduling.plugins import check_real
from vllm_disagg.orchestrator.scheduling.predict import tpot_s
from vllm_disagg.orchestrator.scheduling.terms import column
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

TYPE = "tpot-scorer"


@dataclass(frozen=True, slots=True)
class Params:
    """``slo_s``: the TPOT target (score 0.5 there); ``default_tpot_s``: when unmeasured."""

    slo_s: float = 0.05
    default_tpot_s: float = 0.02

    def __post_init__(self) -> None:
        check_real(TYPE, "slo_s", self.slo_s, gt=0.0)
        check_real(TYPE, "default_tpot_s", self.default_tpot_s, gt=0.0)


class TpotScorer:
    """Scores ``slo / (slo + predict.tpot_s)``."""

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
        slo, default = self.params.slo_s, self.params.default_tpot_s

        def tpot(m: MetricsSnapshot, f: int, k: int, n: int, inv: float) -> float:
            p = tpot_s(m, f, k, n, default)
            return slo / (slo + p) if p >= 0.0 else 0.0  # a prediction below 0 or NaN: the worst

        return tpot


PLUGIN = PluginSpec(TYPE, Params, TpotScorer, "scorer")
