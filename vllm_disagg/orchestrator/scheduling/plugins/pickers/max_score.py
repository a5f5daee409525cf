"""max-score-picker: the candidate with the highest total; exact ties broken by the request id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext

TYPE = "max-score-picker"


@dataclass(frozen=True, slots=True)
class Params:
    """max-score-picker has no parameters."""


class MaxScorePicker:
    """Picks the highest total; among exact ties, ``ctx.random(0)`` chooses."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def pick(self, ctx: ProfileContext, totals: Sequence[float]) -> int:
        """The index of a highest total."""
        best = max(totals)
        if totals.count(best) == 1:  # the common case, in C: no list of the tied
            return totals.index(best)
        tied = [i for i, t in enumerate(totals) if t == best]
        # Without the tie-break every request would land on the first of equally idle instances.
        return tied[int(ctx.random(0) * len(tied))]


PLUGIN = PluginSpec(TYPE, Params, MaxScorePicker, "picker")
