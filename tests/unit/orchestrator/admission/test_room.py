"""Where a request has room (``admission.room``): its pair when that fits; else another pair with the
saturated instance left out; the first pick when none fits; and a scheduler that finds every ready
instance too loaded is a saturated decode stage, not a cluster that is down."""

from __future__ import annotations

import dataclasses

from tests.unit.scheduling_support import MODEL, request, snapshot, view
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import ModelNotFound, NoCapacity
from vllm_disagg.orchestrator.admission.policy import Fit
from vllm_disagg.orchestrator.admission.room import LOADED, find_room
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.state.views import RegistrySnapshot
from vllm_disagg.protocol.messages import MetricsSnapshot

CONFIG = AdmissionConfig(ttft_s=1.5, engine_share=1.0)  # the engine may take the whole budget
RATE = MetricsSnapshot(prefill_tokens_per_s=1000.0, mean_prompt_tokens=1000.0)
VIEWS = (
    view("p0", role="prefill", metrics=RATE),
    view("p1", role="prefill", metrics=RATE),
    view("d0", role="decode"),
)


class InOrder:
    """A scheduler that prefers p0, then p1, always with d0: the cache-affine pick first."""

    name = "in-order"

    def __init__(self) -> None:
        self.asked: list[frozenset[str]] = []

    def decide(self, req: SchedulingRequest, snap: RegistrySnapshot, now: float) -> Decision:
        self.asked.append(req.exclude)
        if req.model != MODEL:
            raise ModelNotFound("no such model")
        for p in ("p0", "p1"):
            if p not in req.exclude:
                return Decision("disaggregated", p, "d0")
        raise NoCapacity("every prefill instance is left out")

    def pick_prefill(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, decode: str
    ) -> str | None:
        return None

    def pick_decode(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, prefill: str | None
    ) -> str | None:
        return None


def test_the_first_pick_when_it_fits() -> None:
    scheduler = InOrder()
    room = find_room(scheduler, request(), snapshot(*VIEWS), 0.0, 0.0, CONFIG)
    assert (room.decision, room.fit) == (Decision("disaggregated", "p0", "d0"), Fit(True))
    assert scheduler.asked == [frozenset()]


def test_another_pair_when_the_first_picks_prefill_instance_is_saturated() -> None:
    scheduler = InOrder()
    busy = snapshot(*VIEWS, in_flight={"p0": 3})  # 4 s predicted on p0, 1 s on p1
    room = find_room(scheduler, request(), busy, 0.0, 0.0, CONFIG)
    assert (room.decision, room.fit) == (Decision("disaggregated", "p1", "d0"), Fit(True))
    assert scheduler.asked == [frozenset(), frozenset({"p0"})]


def test_the_first_pick_and_its_verdict_when_no_pair_fits() -> None:
    busy = snapshot(*VIEWS, in_flight={"p0": 3, "p1": 3})
    room = find_room(InOrder(), request(), busy, 0.0, 0.0, CONFIG)
    assert (room.decision, room.fit) == (Decision("disaggregated", "p0", "d0"), Fit(False, "prefill"))


def test_late_where_another_pair_has_room_and_saturated_elsewhere_is_out_of_reach() -> None:
    # 1 s waited against a 2.5 s target: p0 is saturated (4 s), p1 has room for a newcomer (2 s)
    # but not for it (1 s + 2 s): it cannot be served in time, so it is not left to hold the queue.
    late = dataclasses.replace(request(), slo_ttft_s=2.5)
    busy = snapshot(*VIEWS, in_flight={"p0": 3, "p1": 1})
    room = find_room(InOrder(), late, busy, 0.0, 1.0, CONFIG)
    assert (room.decision, room.fit) == (Decision("disaggregated", "p0", "d0"), Fit(False, "prefill", True))
    # Just come, with both saturated, it waits like anyone else.
    room = find_room(InOrder(), late, snapshot(*VIEWS, in_flight={"p0": 3, "p1": 3}), 0.0, 0.0, CONFIG)
    assert room.fit == Fit(False, "prefill")


def test_a_decision_already_made_is_not_asked_for_again() -> None:
    scheduler = InOrder()
    first = Decision("disaggregated", "p0", "d0")
    room = find_room(scheduler, request(), snapshot(*VIEWS), 0.0, 0.0, CONFIG, first)
    assert room.decision == first and scheduler.asked == []


def test_no_room_anywhere_among_ready_instances_waits_and_no_instance_at_all_is_answered() -> None:
    class Full(InOrder):
        def decide(self, req: SchedulingRequest, snap: RegistrySnapshot, now: float) -> Decision:
            raise NoCapacity("every instance is above the KV ceiling")

    decode_only = snapshot(VIEWS[2])  # no prefill instance for a last resort either
    room = find_room(Full(), request(), decode_only, 0.0, 0.0, CONFIG)
    assert room.decision is None and room.fit == LOADED and isinstance(room.error, NoCapacity)
    gone = snapshot(dataclasses.replace(VIEWS[2], state="dead"))
    room = find_room(Full(), request(), gone, 0.0, 0.0, CONFIG)
    assert room.fit.ok and isinstance(room.error, NoCapacity), "admitted, to get its 503"
