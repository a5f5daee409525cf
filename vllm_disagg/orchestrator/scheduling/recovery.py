"""The gateway's recovery decisions, pure: which instance a failed leg goes to next, and whether it may.

``gateway/flow.py`` acts on them with real legs; the cluster simulator (``cluster_sim/cluster.py``) with
simulated ones, so both recover alike. The instances a request must not use again are in
``request.exclude``.
"""

from __future__ import annotations

import dataclasses

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.scheduling.framework import Scheduler, SchedulingRequest
from vllm_disagg.orchestrator.state.views import RegistrySnapshot


def may_retry_prefill(tries: int, pinned: bool, config: OrchestratorConfig) -> bool:
    """Another prefill instance after ``tries`` failed ones? Never for a client's pinned one; else up to
    ``prefill_attempts`` in all (then the request runs colocated on its decode instance)."""
    return not pinned and tries < config.prefill_attempts


def may_retry_decode(tries: int, pinned: bool, config: OrchestratorConfig) -> bool:
    """Another decode instance after ``tries`` legs failed before their first byte? Never for a
    client's pinned one (the client gets the error); else up to ``decode_attempts`` in all."""
    return not pinned and tries < config.decode_attempts


def may_resume(resumes: int, pinned: bool, config: OrchestratorConfig) -> bool:
    """Another instance for a stream cut after ``resumes`` resumes? Never when the client pinned the
    decode instance: the stream ends with the error rather than move; else up to ``max_resumes``."""
    return not pinned and resumes < config.max_resumes


def colocated_pick(
    scheduler: Scheduler, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float
) -> str | None:
    """An instance to run the rest of a request by itself: a decode instance, else (the last one
    standing) the least busy ready instance that can prefill."""
    d = scheduler.pick_decode(request, snapshot, now, None)
    if d is not None:
        return d
    spare = [v for v in snapshot.ready_prefill.get(request.model, ()) if v.agent_id not in request.exclude]
    return min(spare, key=lambda v: snapshot.in_flight_of(v.agent_id)).agent_id if spare else None


def resume_pick(
    scheduler: Scheduler, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float
) -> str | None:
    """An instance to go on with a cut stream (``colocated_pick``) among those whose engine can: it
    must take the context as token ids and say the ids of what it sends (``EngineCapabilities``)."""
    unable = {v.agent_id for v in snapshot.instances if not v.info.capabilities.resumes(request.is_chat)}
    if unable:
        request = dataclasses.replace(request, exclude=request.exclude | unable)
    return colocated_pick(scheduler, request, snapshot, now)


def next_decode(
    scheduler: Scheduler,
    request: SchedulingRequest,
    snapshot: RegistrySnapshot,
    now: float,
    prefill: str | None,
) -> tuple[str, str | None] | None:
    """Another decode instance, able to take KV from ``prefill`` (then ``(it, prefill)``), else one to
    run the request colocated (``(it, None)``); None when there is none."""
    d = scheduler.pick_decode(request, snapshot, now, prefill)
    if d is not None:
        return d, prefill
    d = colocated_pick(scheduler, request, snapshot, now)
    return (d, None) if d is not None else None
