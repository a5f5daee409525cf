"""The scheduling contract: what a request looks like to a scheduler, and what it decides.

Schedulers are pure: ``decide(request, snapshot, now)`` reads an immutable registry snapshot and
returns a ``Decision``; the gateway does the I/O. The plugin framework (filters, scorers, pickers per
profile) will implement the same ``Scheduler`` protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from vllm_disagg.orchestrator.registry import RegistrySnapshot

Mode = Literal["disaggregated", "colocated"]
MODES: tuple[Mode, ...] = ("disaggregated", "colocated")


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """What the scheduler may know about a request, parsed once by the gateway."""

    request_id: str
    model: str
    prompt_len: int  # an estimate in tokens (characters / 4 for text); good enough to compare requests
    is_chat: bool
    stream: bool


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes: a prefill instance (None when colocated) and a decode instance."""

    mode: Mode
    prefill: str | None
    decode: str
    explanation: Mapping[str, object] = field(default_factory=dict)


class Scheduler(Protocol):
    """Picks instances for a request.

    Raises ``vllm_disagg.errors.ModelNotFound`` when no instance in any state serves the model, and
    ``vllm_disagg.errors.NoCapacity`` when none that could decode it is ready.
    """

    def decide(self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float) -> Decision:
        """The decision for one request; pure in (request, snapshot, now)."""
        ...
