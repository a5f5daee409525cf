"""``/admin/v1/admission``: the gateway's admission queue as operators see it, and the tenants' weights.

``GET admission`` is every gateway process's queue (the orchestrator's and its workers') summed: per
model, the depth by priority and by tenant, the oldest wait, the stage holding the queue back, the
outcomes so far (queued, admitted, withdrawn, shed by reason) and how far each tenant has been served
ahead of its weighted share; with the config in force and the tenants' weights. A replica shows its own
queues: each replica admits the clients that reach it.

``PUT admission/tenants/{tenant}`` ``{"weight": W}`` and ``DELETE`` (back to 1.0) change one tenant's
weight wherever requests are admitted: recorded first (a replica's leader writes the whole map to etcd,
fenced, and every replica follows it; a follower hands the write to the leader, ``replicas/forward.py``),
then applied to this process's queue, which the gateway workers get with the next state push.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from aiohttp import web

from vllm_disagg.config import TENANT_NAME, AdmissionConfig
from vllm_disagg.errors import BadRequest, NotFound
from vllm_disagg.orchestrator.admin.openapi import AdminRoute
from vllm_disagg.orchestrator.admin.shapes import json_response, read_json
from vllm_disagg.orchestrator.gateway.admit import Admission
from vllm_disagg.orchestrator.gateway.workers.hub import WorkerHub
from vllm_disagg.orchestrator.state.intent import IntentRecorder

DEFAULT_WEIGHT = 1.0  # a tenant no one set a weight for (docs/admission.md)


def tenant_name(name: str, config: AdmissionConfig) -> str:
    """``name`` when it is one a request's tenant header may carry (the gateway's own check, so a
    weight is never set for a name it refuses); ``BadRequest`` otherwise."""
    if not TENANT_NAME.fullmatch(name):
        raise BadRequest(f"a tenant's name is 1-64 of letters, digits and ._:-, not {name[:80]!r}")
    return name


def weight_of(value: object, where: str = "'weight'") -> float:
    """A tenant's weight: a finite number > 0; ``BadRequest`` saying why otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise BadRequest(f"{where} must be a finite number > 0, got {value!r:.80}")


def tenant_weights(data: object, config: AdmissionConfig) -> dict[str, float]:
    """``{tenant: weight}`` as etcd holds it (``admission/tenants``), checked; ``BadRequest`` otherwise."""
    if not isinstance(data, dict):
        raise BadRequest(f"the tenants' weights are {{tenant: weight}}, got {data!r:.80}")
    return {tenant_name(str(t), config): weight_of(w, f"the weight of {t!r:.80}") for t, w in data.items()}


def merge(processes: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The models of every process's ``Admission.snapshot`` as one: depths, counts and tenants' leads
    summed, the oldest wait the longest, and the saturated stage that of the deepest queue held back."""
    views: dict[str, list[Mapping[str, Any]]] = {}
    for snapshot in processes:
        for model, view in snapshot["models"].items():
            views.setdefault(model, []).append(view)
    return {model: _merged(views[model]) for model in sorted(views)}


def _merged(views: list[Mapping[str, Any]]) -> dict[str, Any]:
    held = [v for v in views if v["saturated"]]
    sums: dict[str, dict[str, Any]] = {
        key: {} for key in ("by_priority", "by_tenant", "counts", "ahead_of_share")
    }
    for view in views:
        for key in sums:
            _add(sums[key], view[key])
    return {
        "depth": sum(v["depth"] for v in views),
        "by_priority": dict(sorted(sums["by_priority"].items(), key=lambda kv: int(kv[0]))),
        "by_tenant": dict(sorted(sums["by_tenant"].items())),
        "oldest_wait_s": max(v["oldest_wait_s"] for v in views),
        "saturated": max(held, key=lambda v: int(v["depth"]))["saturated"] if held else "",
        "counts": sums["counts"],
        "ahead_of_share": {tenant: round(lead, 3) for tenant, lead in sorted(sums["ahead_of_share"].items())},
    }


def _add(into: dict[str, Any], more: Mapping[str, Any]) -> None:
    """Add ``more``'s numbers to ``into``'s, key by key (nested counts too)."""
    for key, value in more.items():
        if isinstance(value, Mapping):
            _add(into.setdefault(key, {}), value)
        else:
            into[key] = into.get(key, 0) + value


class AdmissionAdmin:
    """The admission routes: what the gateway processes' queues hold, and the tenants' weights."""

    def __init__(
        self, admission: Admission | None, workers: WorkerHub | None, intent: IntentRecorder | None
    ) -> None:
        self._admission = admission  # None: --admission off
        self._workers = workers
        self._intent = intent
        self._writing = asyncio.Lock()  # one weight change at a time: each writes the whole map

    def routes(self) -> list[AdminRoute]:
        return [
            AdminRoute("GET", "/admin/v1/admission", self.show),
            AdminRoute("GET", "/admin/v1/admission/tenants", self.tenants),
            AdminRoute("PUT", "/admin/v1/admission/tenants/{tenant}", self.set_tenant),
            AdminRoute("DELETE", "/admin/v1/admission/tenants/{tenant}", self.reset_tenant),
        ]

    def _on(self) -> Admission:
        if self._admission is None:
            raise NotFound("admission is off here (--admission off): every request goes to an engine")
        return self._admission

    async def show(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/admission``: each model's admission queue, over every gateway process.

        Per model: the depth by priority and by tenant, the oldest wait, the saturated stage, the
        outcomes and shed reasons so far; with the config in force and the tenants' weights."""
        admission = self._admission
        if admission is None:
            return json_response({"enabled": False, "models": {}})
        processes = [(0, admission.snapshot())]  # this process: worker 0
        if self._workers is not None:
            processes += [(a.index, a.payload) for a in await self._workers.ask("admission") if a.payload]
        config = {k: v for k, v in dataclasses.asdict(admission.config).items() if k != "tenant_weights"}
        return json_response(
            {
                "enabled": True,
                "config": config,
                "tenants": self._tenants_json(admission),
                "models": merge(snapshot for _, snapshot in processes),
                "processes": [
                    {
                        "worker": index,
                        "depth": sum(v["depth"] for v in snapshot["models"].values()),
                        "tenant_weights": snapshot["tenant_weights"],
                    }
                    for index, snapshot in processes
                ],
            }
        )

    def _tenants_json(self, admission: Admission) -> dict[str, Any]:
        return {
            "weights": admission.tenant_weights(),
            "configured": dict(sorted(admission.config.tenant_weights)),
            "default_weight": DEFAULT_WEIGHT,
        }

    async def tenants(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/admission/tenants``: the tenants' weights in force (any other weighs 1.0)."""
        return json_response(self._tenants_json(self._on()))

    async def set_tenant(self, request: web.Request) -> web.Response:
        """``PUT /admin/v1/admission/tenants/{tenant}``: ``{"weight": W}``, the tenant's admission weight.

        W is a finite number > 0: the tenant's share of admission against the others', in every
        gateway process (and every replica) from the next request on."""
        admission = self._on()
        tenant = tenant_name(request.match_info["tenant"], admission.config)
        body = await read_json(request)
        if not isinstance(body, dict) or set(body) != {"weight"}:
            raise BadRequest('the body must be {"weight": W}')
        weight = weight_of(body["weight"])
        async with self._writing:
            return await self._change(admission, tenant, {**admission.tenant_weights(), tenant: weight})

    async def reset_tenant(self, request: web.Request) -> web.Response:
        """``DELETE /admin/v1/admission/tenants/{tenant}``: the tenant weighs 1.0 again, as any not named."""
        admission = self._on()
        tenant = tenant_name(request.match_info["tenant"], admission.config)
        async with self._writing:
            weights = admission.tenant_weights()
            weights.pop(tenant, None)
            return await self._change(admission, tenant, weights)

    async def _change(self, admission: Admission, tenant: str, weights: dict[str, float]) -> web.Response:
        """Record ``weights`` (replicas: in etcd; ``NotLeader``, a 503, changes nothing), then apply them."""
        if self._intent is not None:
            await self._intent.save_tenants(weights)
        admission.set_tenant_weights(weights)
        return json_response(
            {"tenant": tenant, "weight": weights.get(tenant, DEFAULT_WEIGHT), **self._tenants_json(admission)}
        )
