"""``GET /admin/v1/debug/state``: everything the scheduler and the planner decide from, at one moment,
in one answer: what an operator attaches to a report of a pick that looked wrong.

Per model and profile, the instances a request would find eligible (and whom each static filter took
out), their shards, the plugins and weights; per instance, what scoring reads (state, breaker, in-flight
requests by process, requests ended since its last scrape, the scraped queue and KV use); the P→D links
(blocked pairs, learned rates); the KV index's size; the planner's last look and shifts; the gateway
workers. Every other admin route shows one of these parts; this one shows them as of the same snapshot.
It reads, never changes, and is served by the process asked (each replica has its own scheduler).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from vllm_disagg.clock import Clock
from vllm_disagg.orchestrator.admin.openapi import AdminRoute
from vllm_disagg.orchestrator.admin.shapes import json_response
from vllm_disagg.orchestrator.gateway.workers.hub import WorkerHub
from vllm_disagg.orchestrator.state.link_rates import links_json
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

Describe = Callable[[], dict[str, Any]]


class DebugAdmin:
    """The debug route over the parts it reads (None: that part is not in this orchestrator)."""

    def __init__(
        self,
        registry: Registry,
        clock: Clock,
        scheduler: object,
        describe_scheduler: Describe | None,
        planner: Describe | None,
        workers: WorkerHub | None,
        replicas: Describe | None,
    ) -> None:
        self._registry = registry
        self._clock = clock
        self._scheduler = scheduler
        self._describe_scheduler = describe_scheduler
        self._planner = planner
        self._workers = workers
        self._replicas = replicas

    def routes(self) -> list[AdminRoute]:
        return [AdminRoute("GET", "/admin/v1/debug/state", self.state)]

    async def state(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/debug/state``: the scheduler's and the planner's state now."""
        return json_response(self.dump())

    def dump(self) -> dict[str, Any]:
        snapshot = self._registry.snapshot()
        now = self._clock.monotonic()
        scheduler: dict[str, Any] = {"name": getattr(self._scheduler, "name", type(self._scheduler).__name__)}
        state = getattr(self._scheduler, "state", None)
        if callable(state):  # the plugin scheduler; another one shows its name only
            scheduler.update(state(snapshot, now))
        if self._describe_scheduler is not None:
            described = self._describe_scheduler()
            scheduler["tokenizers"] = described.get("tokenizers")
            scheduler["kv_index"] = described.get("kv_index")
        return {
            "at": self._clock.wall(),
            "registry": {
                "version": snapshot.version,
                "membership": snapshot.membership,
                "models": sorted(snapshot.known_models),
            },
            "scheduler": scheduler,
            "instances": self._instances(snapshot, now),
            "links": {
                "blocked": sorted([p, d] for p, d in snapshot.blocked_links),
                **links_json(snapshot.links, snapshot.by_id, now),
            },
            "planner": self._planner() if self._planner is not None else None,
            "workers": self._workers.describe() if self._workers is not None else None,
            "replica": self._replicas() if self._replicas is not None else None,
        }

    def _instances(self, snapshot: RegistrySnapshot, now: float) -> dict[str, dict[str, Any]]:
        """Each instance as ``_instance`` shows it; the in-flight maps copied once, not per instance."""
        here = self._registry.own_in_flight()
        remote = {source: self._registry.remote_in_flight(source) for source in ("workers", "peers")}
        out = {}
        for view in snapshot.instances:
            agent_id = view.agent_id
            by_process = {"here": here.get(agent_id, 0)}
            by_process.update({s: n for s, counts in remote.items() if (n := counts.get(agent_id, 0))})
            out[agent_id] = _instance(view, snapshot, now, by_process)
        return out


def _instance(
    view: InstanceView, snapshot: RegistrySnapshot, now: float, by_process: dict[str, int]
) -> dict[str, Any]:
    """What the filters and scorers read of one instance."""
    agent_id, metrics = view.agent_id, view.metrics
    return {
        "model": view.info.model,
        "role": view.info.role,
        "state": view.state,
        "engine_state": view.engine_state,
        "draining": view.agent_draining or view.admin_draining,
        "cordoned": view.admin_cordoned,
        "breaker": {"state": view.breaker.state, "failures": view.breaker.failures},
        "labels": dict(view.info.labels),
        "in_flight": snapshot.in_flight.get(agent_id, 0),
        "in_flight_by_process": by_process,
        "ended_since_scrape": snapshot.ended_since_scrape.get(agent_id, 0),
        "engine": {
            "running": metrics.num_running,
            "waiting": metrics.num_waiting,
            "kv_cache_usage": metrics.kv_cache_usage,
            "ttft_s": metrics.ttft_s,
            "tpot_s": metrics.tpot_s,
            "queue_s": metrics.queue_s,
        },
        "seconds_since_heartbeat": round(max(0.0, now - view.last_heartbeat), 3),
    }
