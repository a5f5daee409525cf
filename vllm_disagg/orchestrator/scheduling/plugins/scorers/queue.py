"""queue-scorer: fewer requests on an instance (engine queue plus the gateway's in-flight) scores higher.

``load = num_running + num_waiting + in_flight``; ``score = max(0, 1 - load / max_queue)``. The
gateway's in-flight count covers requests sent since the last heartbeat, which the engine metrics
cannot show yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, Term
from vllm_disagg.orchestrator.scheduling.plugins import check_real
from vllm_disagg.orchestrator.scheduling.terms import column
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

TYPE = "queue-scorer"


@dataclass(frozen=True, slots=True)
class Params:
    """``max_queue``: the load (requests) at which the score reaches 0; > 0."""

    max_queue: float = 32

    def __post_init__(self) -> None:
        check_real(TYPE, "max_queue", self.max_queue, gt=0.0)


class QueueScorer:
    """Scores ``max(0, 1 - (running + waiting + in_flight) / max_queue)``."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def score(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[float]:
        """One score per candidate in [0, 1]."""
        return column(self.term(), ctx, candidates)

    def term(self) -> Term:
        """The score of one candidate (``framework.TermScorer``)."""
        max_queue = self.params.max_queue

        def queue(m: MetricsSnapshot, f: int, k: int, n: int, inv: float) -> float:
            load = m.num_running + m.num_waiting + f
            return 0.0 if load >= max_queue else (1.0 - load / max_queue if load > 0 else 1.0)

        return queue


PLUGIN = PluginSpec(TYPE, Params, QueueScorer, "scorer")
