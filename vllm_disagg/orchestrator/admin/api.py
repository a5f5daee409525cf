"""``/health``, ``/metrics`` and the admin REST API under ``/admin/v1/``.

``GET instances`` lists every instance (dead ones included); ``POST instances/{id}/drain``,
``/undrain`` and ``/shutdown`` send the command to the agent and return its ``Ack`` (404 unknown id,
502 agent not connected, 504 no ack). Drain and undrain change the registry at once, so routing
follows the operator even if the agent is slow to answer. ``GET requests`` and
``GET requests/{id}`` show the gateway's recent per-request records; ``admission`` the gateway's
admission queue and its tenants' weights (``admin/admission.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.clock import Clock
from vllm_disagg.errors import BadRequest, Conflict, MethodNotAllowed, NotFound, NotLeader, Unprocessable
from vllm_disagg.http_errors import answering
from vllm_disagg.orchestrator.admin import openapi
from vllm_disagg.orchestrator.admin.admission import AdmissionAdmin
from vllm_disagg.orchestrator.admin.auth import guarded
from vllm_disagg.orchestrator.admin.debug import DebugAdmin
from vllm_disagg.orchestrator.admin.openapi import AdminRoute
from vllm_disagg.orchestrator.admin.shapes import (
    add_request,
    instance_json,
    json_response,
    read_json,
    record_json,
)
from vllm_disagg.orchestrator.control.plane import ControlPlane
from vllm_disagg.orchestrator.control.roles import RoleChanger
from vllm_disagg.orchestrator.control.rollout import Rollouts
from vllm_disagg.orchestrator.control.spawner import AgentSpawner
from vllm_disagg.orchestrator.gateway.admit import Admission
from vllm_disagg.orchestrator.gateway.records import RequestLog
from vllm_disagg.orchestrator.gateway.workers.hub import WorkerHub
from vllm_disagg.orchestrator.metrics import CONTENT_TYPE, OrchestratorMetrics
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.intent import IntentRecorder
from vllm_disagg.orchestrator.state.link_rates import links_json
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import DECODE_ROLES, PREFILL_ROLES, InstanceView, RegistrySnapshot
from vllm_disagg.protocol.commands import SIMPLE
from vllm_disagg.protocol.messages import ROLES, CommandKind

_DEFAULT_REQUESTS_LIMIT = 100
_MAX_NOTE_CHARS = 2000  # a supervisor's note: a line of a log, not a document
SUPERVISOR_ACTIONS = ("restarted", "gave_up")
# Reads of what only the leader of replicas holds: a follower hands them to it, as it does writes.
LEADER_READS = frozenset({"/admin/v1/planner", "/admin/v1/rollouts"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The leader's answer to a request, or None where this orchestrator handles it (it leads).
Forward = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def _forwarded(handler: Handler, forward: Forward) -> Handler:
    """``handler``, run only where the request is not handed to the leader."""

    async def leader_or_here(request: web.Request) -> web.StreamResponse:
        answer = await forward(request)
        return answer if answer is not None else await handler(request)

    return leader_or_here


_KEEPALIVE_S = 15.0


class Admin:
    """Handlers for health, metrics and the admin API."""

    def __init__(
        self,
        registry: Registry,
        control: ControlPlane,
        metrics: OrchestratorMetrics,
        request_log: RequestLog,
        clock: Clock,
        describe_scheduler: Callable[[], dict[str, Any]] | None = None,
        events: EventLog | None = None,
        live_requests: Callable[[], list[dict[str, Any]]] | None = None,
        scheduler: object = None,
        *,
        spawner: AgentSpawner | None = None,
        workers: WorkerHub | None = None,
        roles: RoleChanger | None = None,
        planner: Callable[[], dict[str, Any]] | None = None,
        rollouts: Rollouts | None = None,
        replicas: Callable[[], dict[str, Any]] | None = None,
        forward: Forward | None = None,
        intent: IntentRecorder | None = None,
        start_grace_s: float = 0.0,
        admission: Admission | None = None,
    ) -> None:
        self._intent = intent  # replicas: operators' word goes to etcd before it is acted on
        self._stopping = False  # shutting down: health and readiness fail, so load balancers move on
        self._admission = AdmissionAdmin(admission, workers, intent)  # the gateway's queue (None: off)
        self._debug = DebugAdmin(registry, clock, scheduler, describe_scheduler, planner, workers, replicas)
        # A replica is not ready before every agent has had the time to say Hello to it (the longest
        # Hello backoff, 2 s, past a heartbeat timeout), lest it route on part of the cluster.
        self._started = clock.monotonic()
        self._start_grace_s = start_grace_s
        self._rollouts = rollouts
        # A replica of many (orchestrator/replicas): how it sees them, and who does its writes.
        self._replicas = replicas
        self._forward = forward
        self._roles = roles or RoleChanger(registry, control, metrics, clock)
        self._planner = planner
        self._workers = workers  # gateway workers: their metrics and live requests are asked for
        self._scheduler = scheduler
        self._spawner = spawner
        self._events = events or EventLog(clock.wall)
        self._live_requests = live_requests or list
        self._registry = registry
        self._control = control
        self._metrics = metrics
        self._request_log = request_log
        self._clock = clock
        self._describe_scheduler = describe_scheduler
        self._openapi = b"{}"
        self._patterns: list[tuple[re.Pattern[str], str]] = []

    def stop_serving(self) -> None:
        """Shutting down: ``/health`` and ``/health/ready`` answer 503 from now on, while requests are
        still served, so that a load balancer's health check takes this process out of its rotation
        before it stops listening (``--shutdown-delay-s``)."""
        self._stopping = True

    def _stopping_answer(self) -> web.Response:
        return json_response({"status": "unavailable", "reason": "shutting down"}, status=503)

    async def health(self, request: web.Request) -> web.Response:
        """200 when at least one decode-capable instance is ready, else 503 with the reason."""
        if self._stopping:
            return self._stopping_answer()
        snap = self._registry.snapshot()
        ready = [v for v in snap.instances if v.state == "ready"]
        decode = sum(1 for v in ready if v.info.role in DECODE_ROLES)
        prefill = sum(1 for v in ready if v.info.role in PREFILL_ROLES)
        body: dict[str, Any] = {
            "ready": {"decode": decode, "prefill": prefill},
            "instances": len(snap.instances),
        }
        if self._replicas is not None:
            replicas = self._replicas()
            body["replica"] = {
                k: replicas[k] for k in ("self", "role", "leader", "epoch", "etcd", "leader_actions")
            }
        if decode:
            return json_response({"status": "ok", **body})
        reason = f"no ready decode-capable instance ({len(snap.instances)} registered, {len(ready)} ready)"
        return json_response({"status": "unavailable", "reason": reason, **body}, status=503)

    async def live(self, request: web.Request) -> web.Response:
        """``GET /health/live``: 200 while this process serves (a liveness probe: its loop answers)."""
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """``GET /health/ready``: 200 when this orchestrator can route (a readiness probe): it knows a
        ready decode-capable instance, and, as a replica, has run long enough for every agent to have
        said Hello to it (``start_grace_s``), so it knows what its peers know. 503 with the reason
        otherwise."""
        if self._stopping:
            return self._stopping_answer()
        snap = self._registry.snapshot()
        decode = sum(1 for v in snap.instances if v.state == "ready" and v.info.role in DECODE_ROLES)
        body: dict[str, Any] = {"ready_decode": decode}
        reason = "" if decode else "no ready decode-capable instance"
        if self._replicas is not None:
            body["leader"] = self._replicas()["leader"] or ""
            starting = self._start_grace_s - (self._clock.monotonic() - self._started)
            if starting > 0 and not reason:
                reason = f"starting: agents have {starting:.1f} s more to say Hello to this replica"
        if not reason:
            return json_response({"status": "ok", **body})
        return json_response({"status": "unavailable", "reason": reason, **body}, status=503)

    async def replicas(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/replicas``: the replicas as this one sees them, which leads and since when."""
        if self._replicas is None:
            raise NotFound("this orchestrator is a single process, not a replica (run it with --etcd)")
        return json_response(self._replicas())

    async def add_event(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/events``: a supervisor's note in the event log (``up``: it restarted a
        process, or gave up on one): ``{"process": name, "action": "restarted"|"gave_up", "message":
        text}``, plus optional ``exit_code`` and ``restarts``; 201 with the event."""
        body = await read_json(request)
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        fields: dict[str, Any] = {}
        for name in ("process", "action", "message"):
            value = body.get(name)
            if not isinstance(value, str) or not value or len(value) > _MAX_NOTE_CHARS:
                raise BadRequest(f"{name!r} must be a non-empty string of at most {_MAX_NOTE_CHARS} chars")
            fields[name] = value
        if fields["action"] not in SUPERVISOR_ACTIONS:
            raise BadRequest(f"'action' must be one of {list(SUPERVISOR_ACTIONS)}")
        for name in ("exit_code", "restarts"):
            value = body.get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool):
                    raise BadRequest(f"{name!r} must be an integer")
                fields[name] = value
        unknown = sorted(set(body) - {"process", "action", "message", "exit_code", "restarts"})
        if unknown:
            raise BadRequest(f"unknown field(s) {unknown}")
        event = self._events.publish("supervisor", **fields)
        return json_response(event.to_json(), status=201)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text exposition (with gateway workers: theirs too, each under its ``worker``)."""
        workers = []
        if self._workers is not None:
            workers = [(a.index, a.payload) for a in await self._workers.ask("metrics")]
        return web.Response(body=self._metrics.render(workers), headers={"Content-Type": CONTENT_TYPE})

    def _instance(self, view: InstanceView, snap: RegistrySnapshot, now: float) -> dict[str, Any]:
        agent_id = view.agent_id
        return instance_json(view, snap.in_flight_of(agent_id), self._registry.requests_total(agent_id), now)

    async def instances(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/instances``."""
        snap = self._registry.snapshot()
        now = self._clock.monotonic()
        items = [self._instance(v, snap, now) for v in sorted(snap.instances, key=lambda v: v.agent_id)]
        return json_response({"instances": items})

    async def links(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/links``: the P→D links' learned rates, typical rates, KV bytes per token."""
        snap = self._registry.snapshot()
        return json_response(links_json(snap.links, snap.by_id, self._clock.monotonic()))

    async def _command(self, request: web.Request, kind: CommandKind) -> web.Response:
        agent_id = request.match_info["agent_id"]
        if self._registry.get(agent_id) is None:
            raise NotFound(f"no instance {agent_id!r}")
        if kind in ("drain", "undrain"):
            await self._record(agent_id, drained=kind == "drain")
            self._registry.set_admin_drain(agent_id, kind == "drain")
        ack = await self._control.send_command(agent_id, SIMPLE[kind])
        snap = self._registry.snapshot()
        view = snap.by_id.get(agent_id)
        return json_response(
            {
                "agent_id": agent_id,
                "command": kind,
                "ack": {"id": ack.id, "ok": ack.ok, "error": ack.error},
                "instance": self._instance(view, snap, self._clock.monotonic()) if view else None,
            }
        )

    async def _record(self, agent_id: str, **said: bool) -> None:
        """Record what an operator now says of ``agent_id`` (replicas: in etcd), before it is acted on."""
        if self._intent is not None:
            intent = dataclasses.replace(self._registry.intent_of(agent_id), **said)
            await self._intent.save_instance(agent_id, intent)

    async def set_role(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/instances/{agent_id}/role``: ``{"role": "prefill|decode|both"}``; its agent
        checks that the engine can serve it (409 with the reason if not), then it serves so, by routing
        at once or after a drain and a restart of its engine (``roles``; the answer says ``how``, with
        the steps' ``timeline``). The role is pinned: the planner leaves the instance there until
        ``{"role": "auto"}`` lifts the pin."""
        agent_id = request.match_info["agent_id"]
        if self._registry.get(agent_id) is None:
            raise NotFound(f"no instance {agent_id!r}")
        body = await read_json(request)
        role = body.get("role") if isinstance(body, dict) else None
        how, timeline = "none", dict[str, float]()
        if role == "auto":
            await self._record(agent_id, pinned=False)
            view = self._registry.set_role_pin(agent_id, False)
            old = view.info.role
        elif role in ROLES:
            change = await self._roles.change(agent_id, role)
            old, how, timeline = change.old, change.how, change.timeline
            await self._record(agent_id, pinned=True)
            view = self._registry.set_role_pin(agent_id, True)
        else:
            raise BadRequest(f"'role' must be one of {[*ROLES, 'auto']}, got {role!r}")
        snap = self._registry.snapshot()
        body = {"agent_id": agent_id, "from": old, "role": view.info.role, "pinned": view.role_pinned}
        body |= {"how": how, "timeline": timeline}
        return json_response({**body, "instance": self._instance(view, snap, self._clock.monotonic())})

    async def _cordon(self, request: web.Request, cordoned: bool) -> web.Response:
        agent_id = request.match_info["agent_id"]
        if self._registry.get(agent_id) is None:
            raise NotFound(f"no instance {agent_id!r}")
        await self._record(agent_id, cordoned=cordoned)
        view = self._registry.set_cordon(agent_id, cordoned)
        snap = self._registry.snapshot()
        return json_response(
            {"agent_id": agent_id, "instance": self._instance(view, snap, self._clock.monotonic())}
        )

    async def add_instance(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/instances``: attach a running engine by URL (``{"url", "role", "agent_id",
        "model"}``; only ``url`` is required): the orchestrator starts ``vllm-disagg connect`` for it.
        201 once its agent registered, 202 while it is still starting, 422 with connect's reason."""
        if self._spawner is None:
            raise NotFound("this orchestrator does not start agents")
        body = await read_json(request)
        url, role, agent_id, model = add_request(body)
        if self._registry.is_live(agent_id):
            raise Conflict(f"instance {agent_id!r} is live; remove it or pick another agent_id")
        spawned = await self._spawner.add(url, role, agent_id, model)
        if spawned.outcome == "failed":
            raise Unprocessable(f"connect {url}: {spawned.reason}")
        answer: dict[str, Any] = {"agent_id": agent_id, "outcome": spawned.outcome, "pid": spawned.pid}
        view = self._registry.get(agent_id)
        if view is not None and spawned.outcome == "registered":
            answer["instance"] = self._instance(view, self._registry.snapshot(), self._clock.monotonic())
        return json_response(answer, 201 if spawned.outcome == "registered" else 202)

    async def remove(self, request: web.Request) -> web.Response:
        """``DELETE /admin/v1/instances/{agent_id}``: forget a dead instance (409 while it is live)."""
        agent_id = request.match_info["agent_id"]
        view = self._registry.get(agent_id)
        if view is not None and view.state == "dead" and self._intent is not None:
            await self._intent.save_removed(agent_id)
        try:
            self._registry.remove(agent_id)
        except KeyError:
            raise NotFound(f"no instance {agent_id!r}") from None
        except ValueError as exc:
            raise Conflict(str(exc)) from None
        return json_response({"agent_id": agent_id, "removed": True})

    async def cordon(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/instances/{agent_id}/cordon``: no new requests; the agent is not told."""
        return await self._cordon(request, True)

    async def uncordon(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/instances/{agent_id}/uncordon``."""
        return await self._cordon(request, False)

    async def drain(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/instances/{agent_id}/drain``."""
        return await self._command(request, "drain")

    async def undrain(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/instances/{agent_id}/undrain``."""
        return await self._command(request, "undrain")

    async def shutdown(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/instances/{agent_id}/shutdown``."""
        return await self._command(request, "shutdown")

    async def elsewhere(self, request: web.Request) -> web.Response:
        """``/admin/...`` on the gateway's port when the admin API has a listener of its own."""
        raise NotFound("the admin API is not served on this port (see --admin-port)")

    async def requests(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/requests?limit=N``: the newest request records."""
        try:
            limit = int(request.query.get("limit", _DEFAULT_REQUESTS_LIMIT))
        except ValueError:
            raise BadRequest("'limit' must be an integer") from None
        limit = max(0, limit)
        records = self._request_log.recent(limit)
        if self._workers is not None:  # each gateway process keeps the records of what it served
            for answer in await self._workers.ask("recent", limit):
                records += answer.payload
            records.sort(key=lambda r: -r.started_wall)
            del records[limit:]
        return json_response({"requests": [record_json(r) for r in records]})

    async def planner(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/planner``: its config, last look (reason, figures, the P:D split it would
        choose), the shifts it decided, and the instances operators pinned (docs/planner.md)."""
        if self._planner is None:
            raise NotFound("this orchestrator has no planner")
        return json_response(self._planner())

    async def rollout_list(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/rollouts``: every model's rollout, its phase and both revisions' instances."""
        if self._rollouts is None:
            raise NotFound("this orchestrator runs no rollouts")
        return json_response(self._rollouts.describe())

    async def rollout_start(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/rollouts``: ``{"to": REVISION, "model": NAME}`` (model optional when one is
        served): new-revision instances may join, and the old revision drains out as they are ready."""
        if self._rollouts is None:
            raise NotFound("this orchestrator runs no rollouts")
        body = await read_json(request)
        to = body.get("to") if isinstance(body, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(to, str) or (model is not None and not isinstance(model, str)):
            raise BadRequest('give {"to": REVISION} and optionally {"model": NAME}')
        rollout = await self._rollouts.start(model, to)
        return json_response(rollout.to_json(self._registry.snapshot()), status=201)

    async def rollout_action(self, request: web.Request) -> web.Response:
        """``POST /admin/v1/rollouts/{model}/pause|resume|rollback``."""
        if self._rollouts is None:
            raise NotFound("this orchestrator runs no rollouts")
        model, action = request.match_info["model"], request.match_info["action"]
        act = {
            "pause": self._rollouts.pause,
            "resume": self._rollouts.resume,
            "rollback": self._rollouts.rollback,
        }
        if action not in act:
            raise NotFound(f"no rollout action {action!r} (pause, resume, rollback)")
        rollout = await act[action](model)
        return json_response(rollout.to_json(self._registry.snapshot()))

    async def weights(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/scheduler/weights``: each profile's scorer weights."""
        get = getattr(self._scheduler, "weights", None)
        if get is None:
            raise NotFound("this scheduler has no weights")
        return json_response({"weights": get()})

    async def update_weights(self, request: web.Request) -> web.Response:
        """``PUT /admin/v1/scheduler/weights``: ``{"weights": {profile: {scorer: weight}}}``, validated and
        applied all at once (the next decision uses them); the weights after the change."""
        update = getattr(self._scheduler, "update_weights", None)
        if update is None:
            raise NotFound("this scheduler has no weights")
        body = await read_json(request)
        weights = body.get("weights") if isinstance(body, dict) else None
        weights_now = getattr(self._scheduler, "weights", None)
        before = weights_now() if weights_now is not None else None
        after = update(weights)
        if self._intent is not None:
            try:
                await self._intent.save_weights(after)
            except NotLeader:
                if before is not None:
                    update(before)  # not recorded, so not applied: every replica keeps the same weights
                raise
        return json_response({"weights": after})

    async def live_requests(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/live-requests``: requests in flight now (stage, pair, age), oldest first."""
        live = self._live_requests()
        if self._workers is not None:
            for answer in await self._workers.ask("live"):
                live += [{**r, "worker": answer.index} for r in answer.payload]
            live.sort(key=lambda r: -float(r.get("age_s", 0.0)))
        return json_response({"requests": live})

    async def events(self, request: web.Request) -> web.StreamResponse:
        """``GET /admin/v1/events``: the event log as server-sent events, then live ones as they happen."""
        try:
            since = int(request.query.get("since") or request.headers.get("Last-Event-ID") or 0)
        except ValueError:
            raise BadRequest("'since' (or Last-Event-ID) must be an integer") from None
        follow = request.query.get("follow", "true").lower() not in ("0", "false", "no")
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        subscription = self._events.subscribe() if follow else None  # before the backlog: nothing missed
        try:
            last = since
            for kept in self._events.since(since):
                await response.write(kept.sse())
                last = kept.seq
            while subscription is not None:
                try:
                    event = await asyncio.wait_for(subscription.next(), _KEEPALIVE_S)
                except TimeoutError:
                    await response.write(b": keepalive\n\n")  # proxies keep an idle stream open
                    continue
                if event is None:  # too slow to keep up: the client reconnects with Last-Event-ID
                    await response.write(b"event: overflow\ndata: {}\n\n")
                    break
                if event.seq > last:
                    await response.write(event.sse())
                    last = event.seq
        finally:  # the client left (the write failed or the handler was cancelled), or the log ended
            if subscription is not None:
                subscription.close()
        return response

    async def request_record(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/requests/{request_id}``."""
        request_id = request.match_info["request_id"]
        record = self._request_log.get(request_id)
        if self._workers is not None and (record is None or record.request_id != request_id):
            # Not the gateway's own id here: a client's, maybe carried by newer requests on workers.
            found = [a.payload for a in await self._workers.ask("record", request_id)]
            records = [r for r in (record, *found) if r is not None]
            record = max(records, key=lambda r: r.started_wall, default=None)
        if record is None:
            raise NotFound("no record of this request (unknown, or older than the log keeps)")
        return json_response(record_json(record))

    async def scheduler(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/scheduler``: config in use, tokenizer per model, KV index size per instance."""
        if self._describe_scheduler is None:
            raise NotFound("no scheduler is attached")
        return json_response(self._describe_scheduler())

    def add_public_routes(self, app: web.Application) -> None:
        """Register ``/health`` and ``/metrics`` (open: load balancers and Prometheus read them)."""
        app.router.add_get("/health", self.health)
        app.router.add_get("/health/live", self.live)
        app.router.add_get("/health/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)

    def admin_routes(self) -> list[AdminRoute]:
        """Every ``/admin/v1`` route: what the router serves and the OpenAPI document describes."""
        limit = (("limit", "integer", f"how many, newest first (default {_DEFAULT_REQUESTS_LIMIT})"),)
        since = (
            ("since", "integer", "events after this sequence number (or the Last-Event-ID header)"),
            ("follow", "boolean", "keep the stream open for new events (default true)"),
        )
        return [
            AdminRoute("GET", "/admin/v1/openapi.json", self.openapi),
            AdminRoute("GET", "/admin/v1/replicas", self.replicas),
            AdminRoute("GET", "/admin/v1/instances", self.instances),
            AdminRoute("POST", "/admin/v1/instances", self.add_instance),
            AdminRoute("DELETE", "/admin/v1/instances/{agent_id}", self.remove),
            AdminRoute("POST", "/admin/v1/instances/{agent_id}/drain", self.drain),
            AdminRoute("POST", "/admin/v1/instances/{agent_id}/undrain", self.undrain),
            AdminRoute("POST", "/admin/v1/instances/{agent_id}/shutdown", self.shutdown),
            AdminRoute("POST", "/admin/v1/instances/{agent_id}/cordon", self.cordon),
            AdminRoute("POST", "/admin/v1/instances/{agent_id}/role", self.set_role),
            AdminRoute("POST", "/admin/v1/instances/{agent_id}/uncordon", self.uncordon),
            AdminRoute("GET", "/admin/v1/links", self.links),
            AdminRoute("GET", "/admin/v1/planner", self.planner),
            AdminRoute("GET", "/admin/v1/rollouts", self.rollout_list),
            AdminRoute("POST", "/admin/v1/rollouts", self.rollout_start),
            AdminRoute("POST", "/admin/v1/rollouts/{model}/{action}", self.rollout_action),
            AdminRoute("GET", "/admin/v1/scheduler", self.scheduler),
            AdminRoute("GET", "/admin/v1/scheduler/weights", self.weights),
            AdminRoute("PUT", "/admin/v1/scheduler/weights", self.update_weights),
            AdminRoute("GET", "/admin/v1/requests", self.requests, limit),
            AdminRoute("GET", "/admin/v1/live-requests", self.live_requests),
            AdminRoute("GET", "/admin/v1/events", self.events, since),
            AdminRoute("POST", "/admin/v1/events", self.add_event),
            AdminRoute("GET", "/admin/v1/requests/{request_id}", self.request_record),
            *self._admission.routes(),
            *self._debug.routes(),
        ]

    def add_admin_routes(self, app: web.Application, token: str) -> None:
        """Register the ``/admin/v1`` routes, each behind the bearer ``token`` (``auth.guarded``)."""
        routes = self.admin_routes()
        self._openapi = jsonutil.dumps(openapi.document(routes))
        for route in routes:
            handler = route.handler
            if self._forward is not None and (route.method != "GET" or route.path in LEADER_READS):
                handler = _forwarded(handler, self._forward)
            app.router.add_route(route.method, route.path, answering(guarded(handler, token)))
        # Last: anything else under /admin/ gets the one JSON error shape too (after the token check).
        self._patterns = [(re.compile(openapi.path_regex(r.path)), r.method) for r in routes]
        app.router.add_route("*", "/admin/{tail:.*}", answering(guarded(self.unknown, token)))

    async def unknown(self, request: web.Request) -> web.Response:
        """No admin route for this method and path: 405 with the allowed methods, else 404."""
        allowed = sorted({method for pattern, method in self._patterns if pattern.fullmatch(request.path)})
        if allowed:
            raise MethodNotAllowed(f"{request.method} is not allowed here; use {', '.join(allowed)}", allowed)
        raise NotFound(f"no admin route {request.path} (see /admin/v1/openapi.json)")

    async def openapi(self, request: web.Request) -> web.Response:
        """``GET /admin/v1/openapi.json``: this API's OpenAPI document, generated from its routes."""
        return web.Response(body=self._openapi, content_type="application/json")
