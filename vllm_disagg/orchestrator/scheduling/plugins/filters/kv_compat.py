"""kv-compat-filter: keeps candidates that can exchange KV with the profile's partner instance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.state.views import InstanceView

TYPE = "kv-compat-filter"


@dataclass(frozen=True, slots=True)
class Params:
    """kv-compat-filter has no parameters."""


class KvCompatFilter:
    """Same model, revision, block size and KV connector as ``ctx.partner``, and not the partner."""

    TYPE: ClassVar[str] = TYPE
    # The partner differs per request (the chosen decode instance, or the client's pin).
    PER_REQUEST: ClassVar[bool] = True
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """Candidates KV-compatible with the partner; all of them when there is no partner."""
        partner = ctx.partner
        if partner is None:
            return candidates
        # This is what keeps prefill and decode instances of different model revisions (or KV layouts)
        # from ever being paired: the KV blocks one writes would be garbage to the other.
        p = partner.info
        pid, model, revision, block_size, connector = (
            partner.agent_id,
            p.model,
            p.revision,
            p.block_size,
            p.kv_connector,
        )
        return [
            c
            for c in candidates
            if (i := c.info).model == model
            and i.revision == revision
            and i.block_size == block_size
            and i.kv_connector == connector
            and c.agent_id != pid
        ]


PLUGIN = PluginSpec(TYPE, Params, KvCompatFilter, "filter")
