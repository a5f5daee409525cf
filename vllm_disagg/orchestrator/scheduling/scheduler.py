"""The first scheduler: least outstanding requests per role.

Decode first: among ready instances that can decode the model, the one with the fewest gateway
requests in flight; ties go to the smaller engine queue (running + waiting from the last heartbeat),
then to a stable hash of the request id (spreads load without shared mutable state, so ``decide``
stays pure). Then prefill the same way, among ready prefill-capable instances other than the chosen
decode one whose KV layout matches it (revision, block size, connector). No such instance: the
request runs colocated on the decode instance.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from vllm_disagg.errors import ModelNotFound, NoCapacity
from vllm_disagg.orchestrator.registry import InstanceView, RegistrySnapshot
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest

NAME = "least-outstanding"


def _kv_compatible(a: InstanceView, b: InstanceView) -> bool:
    ia, ib = a.info, b.info
    return (
        ia.revision == ib.revision and ia.block_size == ib.block_size and ia.kv_connector == ib.kv_connector
    )


def pick_least_outstanding(
    candidates: Sequence[InstanceView], snapshot: RegistrySnapshot, request_id: str
) -> InstanceView:
    """The least loaded of ``candidates`` (non-empty): in-flight, then engine queue, then hash."""
    if len(candidates) == 1:
        return candidates[0]
    in_flight = snapshot.in_flight
    best_key: tuple[int, int] | None = None
    tied: list[InstanceView] = []
    for c in candidates:
        key = (in_flight.get(c.agent_id, 0), c.metrics.num_running + c.metrics.num_waiting)
        if best_key is None or key < best_key:
            best_key, tied = key, [c]
        elif key == best_key:
            tied.append(c)
    if len(tied) == 1:
        return tied[0]
    return tied[zlib.crc32(request_id.encode()) % len(tied)]


def _load(view: InstanceView, snapshot: RegistrySnapshot) -> dict[str, object]:
    m = view.metrics
    return {
        "id": view.agent_id,
        "in_flight": snapshot.in_flight.get(view.agent_id, 0),
        "engine_queue": m.num_running + m.num_waiting,
    }


class LeastOutstandingScheduler:
    """Least outstanding requests for decode, then for prefill; colocated when no prefill is ready."""

    name = NAME

    def decide(self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float) -> Decision:
        """Pick D, then P (or colocated); raises ``ModelNotFound`` / ``NoCapacity``."""
        model = request.model
        decoders = snapshot.ready_decode.get(model)
        if not decoders:
            if model not in snapshot.known_models:
                raise ModelNotFound(f"the model '{model}' does not exist", param="model")
            raise NoCapacity(f"no ready instance can decode model '{model}'")
        d = pick_least_outstanding(decoders, snapshot, request.request_id)
        prefillers = [
            p
            for p in snapshot.ready_prefill.get(model, ())
            if p.agent_id != d.agent_id and _kv_compatible(p, d)
        ]
        if not prefillers:
            return Decision(
                mode="colocated",
                prefill=None,
                decode=d.agent_id,
                explanation={
                    "scheduler": NAME,
                    "reason": "no ready prefill instance compatible with the decode instance",
                    "decode": _load(d, snapshot),
                    "decode_candidates": len(decoders),
                },
            )
        p = pick_least_outstanding(prefillers, snapshot, request.request_id)
        return Decision(
            mode="disaggregated",
            prefill=p.agent_id,
            decode=d.agent_id,
            explanation={
                "scheduler": NAME,
                "decode": _load(d, snapshot),
                "decode_candidates": len(decoders),
                "prefill": _load(p, snapshot),
                "prefill_candidates": len(prefillers),
            },
        )
