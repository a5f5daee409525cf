"""The decision the gateway acts on, as one pure function: the gateway and the cluster simulator both
call it, so they route a request alike for the same state."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_disagg.errors import NoCapacity
from vllm_disagg.orchestrator.scheduling.framework import Decision, Scheduler, SchedulingRequest
from vllm_disagg.orchestrator.state.views import RegistrySnapshot


@dataclass(frozen=True, slots=True)
class _LastResort:
    """The explanation of a request no decode instance could take, served by a prefill instance."""

    reason: str
    pick: str

    def to_json(self) -> dict[str, object]:
        return {"scheduler": "last-resort", "reason": self.reason, "pick": self.pick}

    def summary(self) -> dict[str, str | int | float]:
        return {"decider": "last-resort", "reason": self.reason, "pick": self.pick}


def last_resort(request: SchedulingRequest, snapshot: RegistrySnapshot, no_decode: NoCapacity) -> Decision:
    """No decode instance is ready: the least busy ready prefill instance serves the request by itself
    (colocated; a vLLM KV producer serves a request without ``kv_transfer_params`` like any engine).
    Re-raises ``no_decode`` when there is none either."""
    spare = snapshot.ready_prefill.get(request.model, ())
    if not spare:
        raise no_decode
    pick = min(spare, key=lambda v: (snapshot.in_flight_of(v.agent_id), v.agent_id)).agent_id
    return Decision("colocated", None, pick, _LastResort(no_decode.message, pick))


def route_request(
    scheduler: Scheduler, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float
) -> Decision:
    """The scheduler's decision; without a ready decode instance, ``last_resort``. Raises what
    ``Scheduler.decide`` raises otherwise (``ModelNotFound``, ``BadRequest``, ``NoCapacity``)."""
    try:
        return scheduler.decide(request, snapshot, now)
    except NoCapacity as exc:
        return last_resort(request, snapshot, exc)
