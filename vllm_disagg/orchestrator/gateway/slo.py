"""A request's own latency targets: ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` (or the orchestrator's
``--slo-ttft-ms``/``--slo-tpot-ms``), what the scheduler does with them (``SchedulingRequest``), and
whether the request met them.

Attainment is counted per SLO class, the targets rounded up to a fixed ladder so that the label stays
bounded whatever clients send (``ttft<=500ms,tpot<=50ms``). A stream's TTFT is its first byte and its
TPOT the gateway's count (``routes._tpot``); a whole answer's TTFT is the end of its prefill leg when
disaggregated (its TPOT, and a colocated answer's TTFT, cannot be seen from here: ``unmeasured``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.predict import predicted_tpot, predicted_ttft
from vllm_disagg.orchestrator.state.registry import RegistrySnapshot

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
_TTFT_LADDER_MS = (100, 250, 500, 1000, 2500, 5000, 10000)
_TPOT_LADDER_MS = (10, 20, 50, 100, 200, 500)
_MAX_MS = 86_400_000.0  # a day: anything above is not a latency target

Outcome = Literal["met", "missed", "unmeasured", "failed"]


def _target(headers: Mapping[str, str], name: str, default_ms: float | None) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None if default_ms is None else default_ms / 1000.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= _MAX_MS):
        raise BadRequest(f"the {name} header must be milliseconds > 0, got {raw[:40]!r}", param=name)
    return value / 1000.0


def request_slo(
    headers: Mapping[str, str], default_ttft_ms: float | None, default_tpot_ms: float | None
) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) targets in seconds, None where there is none; ``BadRequest`` for a bad header."""
    return _target(headers, TTFT_HEADER, default_ttft_ms), _target(headers, TPOT_HEADER, default_tpot_ms)


def _rung(seconds: float, ladder: tuple[int, ...]) -> str:
    ms = seconds * 1000.0
    for edge in ladder:
        if ms <= edge:
            return f"<={edge}ms"
    return f">{ladder[-1]}ms"


def slo_class(ttft_s: float | None, tpot_s: float | None) -> str:
    """The bounded label of a request's targets, e.g. ``ttft<=500ms,tpot<=50ms``; "" without any."""
    parts = []
    if ttft_s is not None:
        parts.append("ttft" + _rung(ttft_s, _TTFT_LADDER_MS))
    if tpot_s is not None:
        parts.append("tpot" + _rung(tpot_s, _TPOT_LADDER_MS))
    return ",".join(parts)


def attainment(
    request: SchedulingRequest, status: int, ttft_s: float | None, tpot_s: float | None
) -> Outcome:
    """Did the request meet its targets? ``unmeasured`` when none of them could be seen."""
    if status != 200:
        return "failed"
    judged = [
        measured <= target
        for target, measured in ((request.slo_ttft_s, ttft_s), (request.slo_tpot_s, tpot_s))
        if target is not None and measured is not None
    ]
    if not judged:
        return "unmeasured"
    return "met" if all(judged) else "missed"


def best_effort(request: SchedulingRequest, decision: Decision, snapshot: RegistrySnapshot) -> bool:
    """Was the pair chosen predicted to miss a target (no candidate sampled was predicted to meet it)?"""
    if request.slo_ttft_s is not None:
        first = snapshot.by_id.get(decision.prefill or decision.decode)
        if (
            first is not None
            and predicted_ttft(first, request, snapshot.in_flight_of(first.agent_id)) > request.slo_ttft_s
        ):
            return True
    if request.slo_tpot_s is not None:
        d = snapshot.by_id.get(decision.decode)
        # in flight before this request was counted: the prediction adds it
        if d is not None and predicted_tpot(d, snapshot.in_flight_of(d.agent_id)) > request.slo_tpot_s:
            return True
    return False
