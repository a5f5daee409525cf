"""Where a request has room: its pair, or, when that is saturated, another pair of the same kind
(disaggregated or colocated) that the scheduler picks with the saturated instance left out ("the
pair the scheduler would pick is predicted to meet its target, or the cluster has room"). Without
this, one request waiting for a busy, cache-affine instance would hold back, head of line, requests
that other instances have room for.

The gateway (``gateway/admit.py``) and the cluster simulator both decide a waiting request through
``find_room``, so they admit alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import NoCapacity, RequestError
from vllm_disagg.orchestrator.admission.fit import fit
from vllm_disagg.orchestrator.admission.policy import FITS, Fit
from vllm_disagg.orchestrator.scheduling.framework import Decision, Scheduler, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.routing import route_request
from vllm_disagg.orchestrator.state.views import RegistrySnapshot

# The scheduler filtered every ready instance out for its load (KV usage above the filter's ceiling):
# a saturated decode stage, to wait for like any other, not a cluster that is down.
LOADED = Fit(False, "decode")
TRIES = 3  # pairs looked at per check: the scheduler's pick and two with saturated instances left out


def loaded(error: RequestError, snapshot: RegistrySnapshot, model: str) -> bool:
    """Is ``error`` the scheduler finding no room although the model has ready instances?"""
    return isinstance(error, NoCapacity) and bool(
        snapshot.ready_decode.get(model) or snapshot.ready_prefill.get(model)
    )


@dataclass(frozen=True, slots=True)
class Room:
    """A check's answer: the decision to act on (None when the scheduler refused: ``error``), and
    whether it fits."""

    decision: Decision | None
    error: RequestError | None
    fit: Fit

    @property
    def decision_mode(self) -> str:
        return self.decision.mode if self.decision is not None else ""


def find_room(
    scheduler: Scheduler,
    request: SchedulingRequest,
    snapshot: RegistrySnapshot,
    now: float,
    waited_s: float,
    config: AdmissionConfig,
    first: Decision | None = None,
    slack_s: float = 0.0,
    fill: float = 1.0,
) -> Room:
    """The scheduler's pick for ``request`` (``first`` when already made) if it fits; else up to
    ``TRIES`` picks, each with the instance that bound the last left out; the first pick and its
    verdict when none fits. A scheduler refusal of the first pick is answered as ``loaded`` says.
    ``slack_s``: ``fit``'s margin; ``fill``: its share of the engines' depth."""
    excluded = set(request.exclude)
    found: Room | None = None
    seen: list[Fit] = []
    for _ in range(TRIES):
        if first is None and found is None:
            try:
                first = route_request(scheduler, request, snapshot, now)
            except RequestError as exc:
                return Room(None, exc, LOADED if loaded(exc, snapshot, request.model) else FITS)
        elif first is None:  # the scheduler's own choice without the saturated ones, no last resort
            assert found is not None
            try:
                first = scheduler.decide(
                    dataclasses.replace(request, exclude=frozenset(excluded)), snapshot, now
                )
            except RequestError:
                return _none_fits(found, seen)  # nothing else is left: wait for the first pick
            # Another pair of the same kind only: colocating on a decode instance because the prefill
            # pool is saturated would move the prefill backlog into the decode pool's batches.
            if {first.prefill, first.decode} & excluded or first.mode != found.decision_mode:
                return _none_fits(found, seen)
        verdict = fit(request, first, snapshot, waited_s, config, slack_s=slack_s, fill=fill)
        if verdict.ok:
            return Room(first, None, verdict)
        seen.append(verdict)
        found = found or Room(first, None, verdict)
        excluded.add(first.prefill or first.decode if verdict.stage == "prefill" else first.decode)
        first = None
    assert found is not None
    return _none_fits(found, seen)


def _none_fits(found: Room, seen: list[Fit]) -> Room:
    """The first pick's verdict when no pair fits; out of reach where it is late on one pair and
    every other pair's prefill stage is saturated (later still there, since it waited)."""
    if found.fit.unreachable or not any(v.unreachable for v in seen):
        return found
    if all(v.stage == "prefill" for v in seen):
        return dataclasses.replace(found, fit=Fit(False, found.fit.stage, True, found.fit.predicted_s))
    return found
