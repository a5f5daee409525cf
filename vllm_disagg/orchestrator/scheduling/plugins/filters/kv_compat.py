"""kv-compat-filter: keeps candidates that can exchange KV with the profile's partner instance: the
rules of ``orchestrator/state/compat.py`` (model, revision, block size, connector, then the KV layouts
as the connector needs them), judged once per pair of layout classes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.state.compat import Mismatch, PairJudge
from vllm_disagg.orchestrator.state.views import InstanceView

TYPE = "kv-compat-filter"


@dataclass(frozen=True, slots=True)
class Params:
    """kv-compat-filter has no parameters."""


class KvCompatFilter:
    """Candidates whose KV ``ctx.partner`` can use (``state.compat.judge``), and not the partner."""

    TYPE: ClassVar[str] = TYPE
    # The partner differs per request (the chosen decode instance, or the client's pin).
    PER_REQUEST: ClassVar[bool] = True
    PER_CANDIDATE: ClassVar[bool] = (
        True  # each candidate is judged against the partner alone: a ranked walk may filter one at a time
    )
    __slots__ = ("_judge", "name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params
        self._judge = PairJudge()

    def _mismatch(self, ctx: ProfileContext, partner: InstanceView, c: InstanceView) -> Mismatch | None:
        # The partner decodes while the prefill profile runs, and prefills while the decode one does.
        if ctx.profile == "prefill":
            return self._judge.mismatch(c.info, partner.info)
        return self._judge.mismatch(partner.info, c.info)

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """Candidates KV-compatible with the partner; all of them when there is no partner."""
        partner = ctx.partner
        if partner is None:
            return candidates
        # This is what keeps instances whose KV would be garbage to each other (another model revision,
        # block size, dtype, layout, or TP split the connector cannot map) from ever being paired.
        judge = self._judge
        return judge.keep(partner, candidates, ctx.profile == "prefill", judge.uniform(ctx.snapshot))

    def reasons(self, ctx: ProfileContext, dropped: Sequence[InstanceView]) -> dict[str, str]:
        """Why each of ``dropped`` cannot be paired with the partner, for the explanation."""
        partner = ctx.partner
        if partner is None:
            return {}
        why: dict[str, str] = {}
        for v in dropped:
            found = self._mismatch(ctx, partner, v)
            why[v.agent_id] = "it is the partner" if found is None else found.text
        return why


PLUGIN = PluginSpec(TYPE, Params, KvCompatFilter, "filter")
