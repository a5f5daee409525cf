"""tpot-scorer: a lower predicted time per output token scores higher.

``predicted = (tpot_s, else the default) * (num_running + in_flight + 1) / max(1, num_running)``: the
measured inter-token latency scaled by how much bigger the batch gets once the requests the gateway
has sent and this one join it ("else" when ``tpot_s`` is unmeasured or zero).
``score = slo_s / (slo_s + predicted)``, 0.5 at the SLO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.registry import InstanceView
from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.scheduling.plugins import check_real

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
    """Scores ``slo / (slo + predicted TPOT)``; see the module docstring for the prediction."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def score(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[float]:
        """One score per candidate in (0, 1]."""
        in_flight = ctx.snapshot.in_flight.get
        slo = self.params.slo_s
        default = self.params.default_tpot_s
        # ``tpot_s or default``: an unmeasured (None) and a zero reading alike fall back.
        return [
            slo
            / (
                slo
                + ((m := c.metrics).tpot_s or default)
                * ((running := m.num_running) + in_flight(c.agent_id, 0) + 1)
                / (running if running > 1 else 1)
            )
            for c in candidates
        ]

    def fused_term(self) -> tuple[str, Mapping[str, float]]:
        """``score`` of one candidate as a term of the profile's fused pass (``framework.FusedScorer``)."""
        return (
            "{slo} / ({slo} + (m.tpot_s or {default})"
            " * ((running := m.num_running) + f + 1) / (running if running > 1 else 1))",
            {"slo": self.params.slo_s, "default": self.params.default_tpot_s},
        )


PLUGIN = PluginSpec(TYPE, Params, TpotScorer, "scorer")
