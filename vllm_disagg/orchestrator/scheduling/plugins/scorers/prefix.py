"""prefix-scorer: the share of the prompt already in an instance's prefix cache, in [0, 1]."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, Term
from vllm_disagg.orchestrator.scheduling.terms import column
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

TYPE = "prefix-scorer"


@dataclass(frozen=True, slots=True)
class Params:
    """prefix-scorer has no parameters."""


class PrefixScorer:
    """Scores ``cached_tokens[id] / prompt_len`` clamped to [0, 1]; 0 for an empty prompt."""

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
        return _prefix


def _prefix(m: MetricsSnapshot, f: int, k: int, n: int, inv: float) -> float:
    # The prompt length may be an estimate, so a cache can hold "more" than the whole prompt.
    return (1.0 if k >= n else k * inv) if k > 0 and n > 0 else 0.0


PLUGIN = PluginSpec(TYPE, Params, PrefixScorer, "scorer")
