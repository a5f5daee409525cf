"""ready-filter: keeps instances that are ready and that neither the agent nor an operator drains."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.state.views import InstanceView

TYPE = "ready-filter"


@dataclass(frozen=True, slots=True)
class Params:
    """ready-filter has no parameters."""


class ReadyFilter:
    """Keeps candidates in state ``ready`` with no drain flag set."""

    TYPE: ClassVar[str] = TYPE
    # Reads only state and drain flags: cached until the registry's membership changes.
    PER_REQUEST: ClassVar[bool] = False
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """Ready, undrained candidates."""
        # The drain flags are checked too, not only the state: a snapshot taken between an admin drain
        # and the state update must still never route to the instance.
        return [c for c in candidates if c.state == "ready" and not c.agent_draining and not c.admin_draining]


PLUGIN = PluginSpec(TYPE, Params, ReadyFilter, "filter")
