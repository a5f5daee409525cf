"""What the admin API reads and answers: JSON bodies in, instances and request records out."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.gateway.records import STAGES, RequestRecord
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import AGENT_ID, ROLES, Role, default_agent_id


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=jsonutil.dumps(body), content_type="application/json")


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; ``BadRequest`` when it is not JSON."""
    try:
        return jsonutil.loads(await request.read())
    except ValueError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None


def add_request(body: Any) -> tuple[str, Role | None, str, str]:
    """``POST /admin/v1/instances``'s body -> (url, role, agent id, model); ``BadRequest`` saying why."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with at least 'url'")
    unknown = sorted(set(body) - {"url", "role", "agent_id", "model"})
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; known: url, role, agent_id, model")
    url, role, model = body.get("url"), body.get("role"), body.get("model", "")
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
        raise BadRequest("'url' must be the engine's base URL, e.g. http://10.0.0.5:8000")
    if role is not None and role not in ROLES:
        raise BadRequest(f"'role' must be one of {list(ROLES)}, got {role!r}")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    agent_id = body.get("agent_id") or default_agent_id(role or "instance", url)
    if not isinstance(agent_id, str) or not AGENT_ID.fullmatch(agent_id):
        raise BadRequest("'agent_id' must be 1-128 of A-Z a-z 0-9 _ . -")
    return url, role, agent_id, model


def instance_json(view: InstanceView, in_flight: int, requests_total: int, now: float) -> dict[str, Any]:
    """One instance as the admin API shows it."""
    info = view.info
    return {
        "agent_id": view.agent_id,
        "state": view.state,
        "role": info.role,
        "url": info.url,
        "model": info.model,
        "engine": info.engine,
        "revision": info.revision,
        "block_size": info.block_size,
        "kv_connector": info.kv_connector,
        "max_model_len": info.max_model_len,
        "tensor_parallel_size": info.tensor_parallel_size,
        "kv_pool_endpoint": info.kv_pool_endpoint,
        "kv_pool_node": info.kv_pool_node,  # the agent whose pool it shares (its host's); "": its own
        "capabilities": dataclasses.asdict(info.capabilities),  # what its streams say (docs/engines.md)
        "labels": dict(info.labels),  # topology: node, zone, domain (docs/scheduler.md, "Topology")
        "layout": dataclasses.asdict(info.layout),  # as its agent could tell (docs/agent.md); 0/"": unknown
        "session": view.session,
        "protocol": view.protocol,
        "role_pinned": view.role_pinned,
        "engine_state": view.engine_state,
        "draining": {"agent": view.agent_draining, "admin": view.admin_draining},
        "cordoned": view.admin_cordoned,
        "suspect_reason": view.suspect_reason,
        "kv_link_ready": view.kv_link_ready,  # False: joining until a warm-up proves its KV link
        "breaker": {"state": view.breaker.state, "failures": view.breaker.failures},
        "in_flight": in_flight,
        "requests_total": requests_total,
        "heartbeats": view.heartbeats,
        "seconds_since_heartbeat": round(max(0.0, now - view.last_heartbeat), 3),
        "dead_reason": view.dead_reason,
        "metrics": dataclasses.asdict(view.metrics),
    }


def record_json(record: RequestRecord) -> dict[str, Any]:
    """One request record as JSON."""
    out = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    out["explanation"] = record.explanation.to_json() if record.explanation is not None else None
    out["attempts"] = [a.to_json() for a in record.attempts]
    out["admission"] = dict(record.admission)
    timeline = {stage: round(record.timeline[stage], 6) for stage in STAGES if stage in record.timeline}
    out["timeline"] = timeline
    out["stages"] = _stage_durations(timeline, record.mode == "disaggregated")
    if record.gateway_s is not None:
        out["stages"]["gateway_s"] = round(record.gateway_s, 6)
    return out


def _stage_durations(t: dict[str, float], disaggregated: bool) -> dict[str, float]:
    """Queue, prefill, handoff, first and last token as durations, from the timeline's offsets."""
    out: dict[str, float] = {}
    if "queued" in t and "admitted" in t:
        out["admission_s"] = round(t["admitted"] - t["queued"], 6)
    if "scheduled" in t:
        out["queue_s"] = t["scheduled"]
    if "prefill_start" in t and "prefill_end" in t:
        out["prefill_s"] = round(t["prefill_end"] - t["prefill_start"], 6)
    if "prefill_end" in t and "decode_start" in t:
        out["handoff_s"] = round(t["decode_start"] - t["prefill_end"], 6)
    if "first_token" in t:
        out["first_token_s"] = t["first_token"]  # the client's TTFT (a stream)
        if disaggregated and "prefill_end" in t:  # the KV's way to D, its pull and D's first step
            out["transfer_window_s"] = round(t["first_token"] - t["prefill_end"], 6)
        if "decode_start" in t:  # the decode leg's own TTFT
            out["decode_first_token_s"] = round(t["first_token"] - t["decode_start"], 6)
    if "last_token" in t:
        out["last_token_s"] = t["last_token"]
    return out
