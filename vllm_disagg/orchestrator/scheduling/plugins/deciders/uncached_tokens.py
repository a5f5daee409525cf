"""uncached-tokens-decider: disaggregate only when enough of the prompt is not cached on the decoder.

A prompt mostly in the decode instance's prefix cache prefills there in little time; shipping its KV
from a prefill instance would cost more than it saves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import ModeChoice, PluginSpec, ProfileContext
from vllm_disagg.orchestrator.scheduling.plugins import check_int
from vllm_disagg.orchestrator.scheduling.predict import uncached_tokens
from vllm_disagg.orchestrator.state.views import InstanceView

TYPE = "uncached-tokens-decider"

NO_PREFILL = "no prefill instance is ready"


@dataclass(frozen=True, slots=True)
class Params:
    """``threshold``: fewer uncached prompt tokens than this run colocated (>= 0; 0: always split)."""

    threshold: int = 0

    def __post_init__(self) -> None:
        check_int(TYPE, "threshold", self.threshold, ge=0)


class UncachedTokensDecider:
    """Colocated without a ready prefill instance or below the threshold; else disaggregated."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def choose(self, ctx: ProfileContext, decode: InstanceView, prefill_ready: bool) -> ModeChoice:
        """The mode, with a reason that names the numbers it compared."""
        if not prefill_ready:
            return ModeChoice("colocated", NO_PREFILL)
        request = ctx.request
        threshold = self.params.threshold
        uncached = uncached_tokens(decode, request)
        if uncached < threshold:
            return ModeChoice(
                "colocated", f"only {uncached} uncached prompt tokens (below threshold {threshold})"
            )
        return ModeChoice(
            "disaggregated",
            f"{uncached} uncached prompt tokens of {request.prompt_len} on {decode.agent_id} "
            f"(threshold {threshold})",
        )


PLUGIN = PluginSpec(TYPE, Params, UncachedTokensDecider, "decider")
