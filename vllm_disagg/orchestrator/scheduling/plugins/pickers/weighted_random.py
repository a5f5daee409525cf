"""weighted-random-picker: a candidate with probability proportional to its total."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext

TYPE = "weighted-random-picker"


@dataclass(frozen=True, slots=True)
class Params:
    """weighted-random-picker has no parameters."""


class WeightedRandomPicker:
    """Picks index i with probability ``totals[i] / sum(totals)`` (negative totals count as 0)."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def pick(self, ctx: ProfileContext, totals: Sequence[float]) -> int:
        """An index drawn with ``ctx.random(0)``; uniform when no total is positive."""
        weights = [t if t > 0.0 else 0.0 for t in totals]
        total = sum(weights)
        r = ctx.random(0)
        if not total > 0.0:
            return int(r * len(totals))
        target = r * total
        acc = 0.0
        last = 0
        for i, w in enumerate(weights):
            if w > 0.0:
                acc += w
                last = i
                if target < acc:
                    return i
        return last  # rounding left ``target`` a hair above the running sum: the last weighted one


PLUGIN = PluginSpec(TYPE, Params, WeightedRandomPicker, "picker")
