"""power-of-two-picker: draw two distinct candidates by the request id; the higher total wins.

The power of two choices: nearly as well balanced as always taking the best, without sending a
burst of requests that arrive between two heartbeats all to the same instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext

TYPE = "power-of-two-picker"


@dataclass(frozen=True, slots=True)
class Params:
    """power-of-two-picker has no parameters."""


class PowerOfTwoPicker:
    """Draws indices with ``ctx.random(0)`` and ``ctx.random(1)``; the higher total (first on a tie)."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def pick(self, ctx: ProfileContext, totals: Sequence[float]) -> int:
        """The index of the better of two distinct draws; 0 when there is one candidate."""
        n = len(totals)
        if n == 1:
            return 0
        first = int(ctx.random(0) * n)
        second = int(ctx.random(1) * (n - 1))
        if second >= first:  # draw from the other n - 1 so the two are distinct
            second += 1
        return second if totals[second] > totals[first] else first


PLUGIN = PluginSpec(TYPE, Params, PowerOfTwoPicker, "picker")
