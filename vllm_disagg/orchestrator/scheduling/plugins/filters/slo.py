"""slo-filter: keeps candidates predicted to meet the request's own SLO (``x-slo-ttft-ms`` in the
prefill profile, ``x-slo-tpot-ms`` in the decode profile; see ``predict``). Soft: when no candidate is
predicted to meet it, all are kept and the request is served best effort (the gateway counts it).
A request without an SLO passes every candidate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins import check_real
from vllm_disagg.orchestrator.scheduling.predict import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_TPOT_S,
    predicted_tpot,
    predicted_ttft,
)
from vllm_disagg.orchestrator.state.views import InstanceView

TYPE = "slo-filter"


@dataclass(frozen=True, slots=True)
class Params:
    """The predictions' fallbacks for unmeasured instances (the ttft- and tpot-scorers' defaults)."""

    default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    default_tpot_s: float = DEFAULT_TPOT_S

    def __post_init__(self) -> None:
        check_real(TYPE, "default_prefill_tokens_per_s", self.default_prefill_tokens_per_s, gt=0.0)
        check_real(TYPE, "default_tpot_s", self.default_tpot_s, gt=0.0)


class SloFilter:
    """Prefill profile: predicted TTFT within ``slo_ttft_s``; decode profile: predicted TPOT within
    ``slo_tpot_s``; everyone when nobody is."""

    TYPE: ClassVar[str] = TYPE
    PER_REQUEST: ClassVar[bool] = True  # the SLO is the request's
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    @staticmethod
    def applies(request: SchedulingRequest) -> bool:
        """Only requests with a target are filtered (the scheduler skips this filter for the rest)."""
        return request.slo_ttft_s is not None or request.slo_tpot_s is not None

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """The candidates predicted to meet the SLO this profile decides; all if none or no SLO."""
        request = ctx.request
        in_flight = ctx.snapshot.in_flight.get
        if ctx.profile == "prefill" and request.slo_ttft_s is not None:
            slo, rate = request.slo_ttft_s, self.params.default_prefill_tokens_per_s
            kept = [
                c for c in candidates if predicted_ttft(c, request, in_flight(c.agent_id, 0), rate) <= slo
            ]
        elif ctx.profile == "decode" and request.slo_tpot_s is not None:
            slo, default = request.slo_tpot_s, self.params.default_tpot_s
            kept = [c for c in candidates if predicted_tpot(c, in_flight(c.agent_id, 0), default) <= slo]
        else:
            return candidates
        return kept or candidates


PLUGIN = PluginSpec(TYPE, Params, SloFilter, "filter")
