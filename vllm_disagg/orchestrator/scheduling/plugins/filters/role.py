"""role-filter: the decode profile keeps decode/both instances, the prefill profile prefill/both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext
from vllm_disagg.orchestrator.state.views import DECODE_ROLES, PREFILL_ROLES, InstanceView

TYPE = "role-filter"


@dataclass(frozen=True, slots=True)
class Params:
    """role-filter has no parameters."""


class RoleFilter:
    """Keeps candidates whose role may serve the running profile."""

    TYPE: ClassVar[str] = TYPE
    # Reads only role and state: the scheduler caches it until the registry's membership changes.
    PER_REQUEST: ClassVar[bool] = False
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """Candidates whose ``info.role`` is in DECODE_ROLES or PREFILL_ROLES, by profile."""
        roles = DECODE_ROLES if ctx.profile == "decode" else PREFILL_ROLES
        return [c for c in candidates if c.info.role in roles]


PLUGIN = PluginSpec(TYPE, Params, RoleFilter, "filter")
