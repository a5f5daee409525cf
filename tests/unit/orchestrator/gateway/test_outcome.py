"""What a request came to (``contract.Outcome``): the figures its metrics and record are made of."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_disagg.orchestrator.gateway.contract import Outcome

T0 = 100.0
STAMPS = {
    "scheduled": 100.002,
    "dispatched": 100.003,
    "prefill_start": 100.003,
    "prefill_end": 100.010,
    "decode_start": 100.012,
}


def outcome(stream: bool = False, **fields: Any) -> Outcome:
    return Outcome("r1", "completions", "m", stream, 200, "", T0, **fields)


def test_a_request_refused_before_scheduling_ran_no_leg_and_has_no_stage() -> None:
    refused = Outcome("r1", "completions", "m", False, 404, "no instance serves 'm'", T0)
    assert (refused.mode, refused.prefill, refused.decode, refused.attempts) == ("none", None, None, ())
    assert dict(refused.stamps) == {}
    assert refused.scheduling is None and refused.explanation is None
    figures = (refused.schedule_s, refused.queue_s, refused.handoff_s, refused.ttfb_s, refused.ttft_seen_s)
    assert figures == (None, None, None, None, None)


@pytest.mark.parametrize(
    ("fields", "figure", "expected"),
    [
        ({"stamps": STAMPS}, "schedule_s", 0.002),
        ({"stamps": STAMPS}, "queue_s", 0.003),
        ({"stamps": STAMPS, "mode": "disaggregated"}, "handoff_s", 0.002),
        ({"stamps": STAMPS, "mode": "colocated"}, "handoff_s", None),
        ({"first_byte": 100.020}, "ttfb_s", 0.020),
        ({"stamps": STAMPS, "first_byte": 100.020}, "ttft_seen_s", 0.010),
        ({"stamps": STAMPS, "first_byte": 100.020, "stream": True}, "ttft_seen_s", 0.020),
    ],
    ids=[
        "scheduled: arrival to the decision",
        "queued: arrival to the first engine leg",
        "handoff: prefill's end to decode's start",
        "no handoff once it ran colocated (a fallback)",
        "ttfb: arrival to the decode body's first byte",
        "the ttft a whole answer shows: its prefill's end",
        "the ttft a stream shows: its first byte",
    ],
)
def test_figures_are_seconds_after_arrival(
    fields: dict[str, Any], figure: str, expected: float | None
) -> None:
    got = getattr(outcome(**fields), figure)
    assert got == (pytest.approx(expected) if expected is not None else None)
