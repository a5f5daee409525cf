"""ttft-scorer: a lower predicted time to first token scores higher.

For each candidate::

    backlog   = (num_waiting + in_flight) * (mean_prompt_tokens, else this request's prompt_len)
    uncached  = max(0, prompt_len - cached_tokens[id])
    predicted = (queue_s, else 0) + (backlog + uncached) / (prefill_tokens_per_s, else the default)
    score     = slo_s / (slo_s + predicted)

"else" applies when the metric is unmeasured (None) or zero, and to the prefill rate of an engine
handed more prompt tokens over KV transfer than it computed (``predict.prefill_rate`` says why). A
candidate predicted to meet the SLO exactly scores 0.5; an idle one with the whole prompt cached
scores 1. The metrics come from the instance's last heartbeat; ``in_flight`` is the gateway's own
count, which covers requests sent since. Running requests add nothing: they are past prefill, and
chunked prefill interleaves with decode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.registry import InstanceView
from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.scheduling.plugins import check_real

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
    """Scores ``slo / (slo + predicted TTFT)``; see the module docstring for the prediction."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def score(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[float]:
        """One score per candidate in (0, 1]."""
        request = ctx.request
        prompt_len = request.prompt_len if request.prompt_len > 0 else 0
        in_flight = ctx.snapshot.in_flight.get
        slo = self.params.slo_s
        default = self.params.default_prefill_tokens_per_s
        # One comprehension per case, inlined, because this is the costliest scorer per candidate.
        # ``x or fallback`` treats an unmeasured (None) and a zero reading alike: neither means anything.
        if not request.cached_tokens:
            return [
                slo
                / (
                    slo
                    + ((m := c.metrics).queue_s or 0.0)
                    + (
                        (m.num_waiting + in_flight(c.agent_id, 0)) * (m.mean_prompt_tokens or prompt_len)
                        + prompt_len
                    )
                    / (
                        t
                        if (t := m.prefill_tokens_per_s)
                        and t > 0.0
                        and (m.prompt_tokens_transferred or 0) <= (m.prompt_tokens_computed or 0)
                        else default
                    )
                )
                for c in candidates
            ]
        cached = request.cached_tokens.get
        return [
            slo
            / (
                slo
                + ((m := c.metrics).queue_s or 0.0)
                + (
                    (m.num_waiting + in_flight(a := c.agent_id, 0)) * (m.mean_prompt_tokens or prompt_len)
                    + (u if (u := prompt_len - cached(a, 0)) > 0 else 0)
                )
                / (
                    t
                    if (t := m.prefill_tokens_per_s)
                    and t > 0.0
                    and (m.prompt_tokens_transferred or 0) <= (m.prompt_tokens_computed or 0)
                    else default
                )
            )
            for c in candidates
        ]

    def fused_term(self) -> tuple[str, Mapping[str, float]]:
        """``score`` of one candidate as a term of the profile's fused pass (``framework.FusedScorer``)."""
        return (
            "{slo} / ({slo} + (m.queue_s or 0.0)"
            " + ((m.num_waiting + f) * (m.mean_prompt_tokens or n) + (u if (u := n - k) > 0 else 0))"
            " / (t if (t := m.prefill_tokens_per_s) and t > 0.0"
            " and (m.prompt_tokens_transferred or 0) <= (m.prompt_tokens_computed or 0) else {default}))",
            {"slo": self.params.slo_s, "default": self.params.default_prefill_tokens_per_s},
        )


PLUGIN = PluginSpec(TYPE, Params, TtftScorer, "scorer")
