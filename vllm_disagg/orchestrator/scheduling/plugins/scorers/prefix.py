"""prefix-scorer: the share of the prompt already in an instance's prefix cache, in [0, 1]."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.registry import InstanceView
from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext

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
        request = ctx.request
        cached = request.cached_tokens
        prompt_len = request.prompt_len
        if not cached or prompt_len <= 0:
            return [0.0] * len(candidates)
        # The prompt length may be an estimate, so a cache can hold "more" than the whole prompt.
        get = cached.get
        inv = 1.0 / prompt_len
        return [
            (1.0 if (n := get(c.agent_id, 0)) >= prompt_len else n * inv if n > 0 else 0.0)
            for c in candidates
        ]

    def fused_term(self) -> tuple[str, Mapping[str, float]]:
        """``score`` of one candidate as a term of the profile's fused pass (``framework.FusedScorer``)."""
        return (
            "(1.0 if k >= n else k * inv) if k > 0 and n > 0 else 0.0",
            {},
        )


PLUGIN = PluginSpec(TYPE, Params, PrefixScorer, "scorer")
