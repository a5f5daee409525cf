"""The one owner of mutable instance state; everything else reads immutable snapshots.

States of an instance (one per agent id; the rules are ``health.derive_state``)::

    joining   Hello accepted, engine starting (or ready, its KV     never routed to
              link not yet proven by a warm-up: ``instance``)
    ready     engine ready, heartbeats fresh, breaker closed        routed to
    suspect   late heartbeat, engine unhealthy or restarting, or    never routed to; back to ready
              its circuit breaker open                              when the sign goes away
    cordoned  an operator cordoned it                               never routed to (new requests)
    draining  the agent or an operator drains it                    never routed to (new requests)
    dead      heartbeat timeout, Goodbye, or engine "stopped"       never routed to; kept for the admin API

A dead instance comes back only through a new Hello (a new session). The gateway reports each leg's
outcome (``leg_succeeded``/``leg_failed``), which feeds a breaker per instance and per P→D link; the
control plane calls ``tick`` every half heartbeat interval. ``on_lost`` is called when a live
instance dies or its engine stops serving, so the gateway can fail over the requests it has there.
Every method is synchronous and cheap: the control plane calls them per frame, the gateway per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from vllm_disagg.orchestrator.state import health
from vllm_disagg.orchestrator.state.event_log import instance_events
from vllm_disagg.orchestrator.state.health import (
    CLOSED,
    INSTANCE_STATES,
    Breaker,
    BreakerPolicy,
    InstanceState,
)
from vllm_disagg.orchestrator.state.instance import InstanceRecord, needs_link_proof
from vllm_disagg.orchestrator.state.intent import NO_INTENT, InstanceIntent
from vllm_disagg.orchestrator.state.kv_audit import DecodeAudit, Outcome
from vllm_disagg.orchestrator.state.link_rates import LinkRates
from vllm_disagg.orchestrator.state.metrics_check import MetricsCheck
from vllm_disagg.orchestrator.state.views import (
    DECODE_ROLES,
    PREFILL_ROLES,
    GatewayRegistry,
    InstanceView,
    RegistrySnapshot,
    SnapshotSource,
    sum_counts,
)
from vllm_disagg.orchestrator.state.watchers import Unwatch, Watchers
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, Role

RemoteSource = Literal["workers", "peers"]  # where requests counted outside this process run

# The views live in ``views``; named here too, so that a reader imports a registry and its views at once.
__all__ = [
    "DECODE_ROLES",
    "INSTANCE_STATES",
    "PREFILL_ROLES",
    "GatewayRegistry",
    "InstanceState",
    "InstanceView",
    "Registry",
    "RegistrySnapshot",
    "SnapshotSource",
    "Unwatch",
    "sum_counts",
]

# Engine states in which requests already on the instance will not complete.
_ENGINE_LOST: frozenset[EngineState] = frozenset(("unhealthy", "restarting", "stopped"))


class Registry(SnapshotSource):
    """Instances by agent id, their state machine, breakers, and the gateway's in-flight counts."""

    def __init__(
        self,
        heartbeat_timeout_s: float,
        *,
        suspect_after_s: float | None = None,
        breaker: BreakerPolicy | None = None,
        prove_kv_links: bool = False,
    ) -> None:
        """``prove_kv_links``: NIXL engines are joining until a warm-up proved their KV link
        (``kv_link_proven``; the orchestrator runs ``kv_warmup``); off, they are ready with their engine."""
        super().__init__()
        self._prove_links = prove_kv_links
        self._timeout = heartbeat_timeout_s
        # Silence for this long stops routing at once; death (and a new session) waits for the timeout.
        # None: only death counts. On a host whose agents are starved of CPU now and then, heartbeats
        # half a timeout late are common, and routing around them misplaces requests for nothing.
        self._suspect_after = suspect_after_s if suspect_after_s is not None else float("inf")
        self._policy = breaker or BreakerPolicy()
        self._instances: dict[str, InstanceRecord] = {}
        self._check = MetricsCheck()  # what agents report, in range before anything reads it
        self._requests_total: dict[str, int] = {}  # by agent id, over all its sessions
        self._intent: dict[str, InstanceIntent] = {}  # operators' word by agent id, over all its sessions
        self._links: dict[tuple[str, str], Breaker] = {}  # (prefill, decode) -> breaker; closed ones absent
        self._unproven: set[str] = set()  # agent ids whose view says their KV link is still to prove
        self.link_rates = LinkRates(lambda: self._views)  # what each P→D link delivers (``link_rates``)
        # (agent id, reason): a live instance died or its engine stopped serving; requests on it are lost.
        self.on_lost: Callable[[str, str], None] | None = None
        # Called with what each heartbeat's KV audit settled (``kv_audit``): legs loaded, a verdict.
        self.on_kv_audit: Callable[[Outcome], None] | None = None
        # Called with (kind, fields) as instances join, change state, and breakers open or close.
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None
        # ``watch``: called after every change a snapshot shows; the second also as in-flight counts move.
        self._watch = Watchers()

    @property
    def heartbeat_timeout_s(self) -> float:
        """No heartbeat for this long and an instance is dead."""
        return self._timeout

    @property
    def breaker_policy(self) -> BreakerPolicy:
        """When the instance and link breakers open, and for how long."""
        return self._policy

    def watch(self, callback: Callable[[], None], *, in_flight: bool = False) -> Unwatch:
        """Call ``callback()`` after every change a new snapshot shows (a join, a state, a drain, a
        role, a heartbeat's metrics, a removal, a P→D link opening or closing) and, with ``in_flight``,
        after every request sent to an instance or over; returns the call that stops it.

        What steps on the registry's state (a rollout, a role change) waits on this instead of looking
        every so often. It runs inside the change, so it must be cheap, must not raise and must not
        change the registry: set a flag or an ``asyncio.Event``, and do the work after.
        """
        return self._watch.add(callback, in_flight)

    @property
    def watchers(self) -> tuple[int, int]:
        """Callbacks watching now: (changes only, changes and in-flight counts)."""
        return len(self._watch.changes), len(self._watch.flight)

    def _changed(self, inst: InstanceRecord, membership: bool) -> None:
        views = self._own_views()
        old = views.get(inst.agent_id)
        new = views[inst.agent_id] = inst.view()
        self._changes.note(inst.agent_id)
        if new.kv_link_ready:
            self._unproven.discard(inst.agent_id)
        else:
            self._unproven.add(inst.agent_id)
        if self.on_event is not None:
            self._tell(old, new)
        self._version += 1
        self._cached = None
        if membership:
            self._membership += 1
            self._groups = None
        if self._watch.changes or self._watch.flight:
            self._watch.notify()

    def _update(self, inst: InstanceRecord, lost_reason: str = "") -> None:
        """Re-derive a live instance's state after a signal changed; tell ``on_lost`` when it is lost."""
        before = inst.state
        inst.state = inst.derive_state()
        if inst.state == "dead":
            self._kill(inst, lost_reason or "engine stopped", before)
            return
        self._changed(inst, membership=inst.state != before)
        if lost_reason and self.on_lost is not None:
            self.on_lost(inst.agent_id, lost_reason)

    def hello(self, agent_id: str, info: InstanceInfo, now: float, *, protocol: str = "") -> InstanceView:
        """Start a new session for ``agent_id`` (first time, after death, or an agent that restarted);
        ``protocol``: the "major.minor" its agent speaks."""
        old = self._instances.get(agent_id)
        if old is not None and old.state != "dead" and self.on_lost is not None:
            self.on_lost(agent_id, "its agent started a new session")  # a new engine may be behind it
        intent = self._intent.get(agent_id, NO_INTENT)
        inst = InstanceRecord(
            agent_id=agent_id,
            info=info,
            session=(old.session + 1) if old else 1,
            joined_at=now,
            last_heartbeat=now,
            # The operator's word outlives sessions: an agent that restarts comes back cordoned, drained
            # and pinned as it was left (the control plane tells a drained one again).
            admin_cordoned=intent.cordoned,
            admin_draining=intent.drained,
            role_pinned=intent.pinned,
            audit=DecodeAudit(agent_id, info.block_size),
            protocol=protocol,
            link_proof=self._prove_links and needs_link_proof(info),
            kv_link_ready=not (self._prove_links and needs_link_proof(info)),
        )
        self._instances[agent_id] = inst
        self._drop_links(agent_id)
        self._changed(inst, membership=True)
        return self._views[agent_id]

    def heartbeat(
        self, agent_id: str, hb: Heartbeat, now: float, wall: float | None = None
    ) -> InstanceView | None:
        """Record a heartbeat (handled at ``now``; ``wall``: the same instant on the wall clock, for the
        KV audit); None when ``agent_id`` has no live session (it must say Hello again)."""
        inst = self._instances.get(agent_id)
        if inst is None or inst.state == "dead":
            return None
        lost = hb.engine_state in _ENGINE_LOST and inst.engine_state not in _ENGINE_LOST
        inst.last_heartbeat = now
        inst.heartbeats += 1
        metrics = self._check(agent_id, hb.metrics)
        if metrics.scraped_at != inst.metrics.scraped_at:  # a new scrape: what was in flight then
            self._scraped(agent_id)
        inst.metrics = metrics
        self._use_links(self.link_rates.metrics(agent_id, metrics, now))
        inst.engine_changed(hb.engine_state)
        inst.agent_draining = hb.draining
        inst.late = False
        self._update(inst, f"engine {hb.engine_state}" if lost else "")
        if inst.audit is not None:
            self._judge_links(inst.agent_id, inst.audit.observe(metrics, now, wall), now)
        return self._views[agent_id]

    # --- the KV audit of decode legs (see ``kv_audit``) -------------------------------------------

    def audit_dispatch(
        self, decode: str, request_id: str, prefill: str, tokens: int, now: float, key: int | None = None
    ) -> int | None:
        """A decode leg carrying ``prefill``'s KV handle is sent: its audit key, or None when its
        engine's counters cannot judge it (then the gateway judges the link by the leg's outcome).
        ``key``: the one a gateway worker chose for the leg (it cannot wait for an answer)."""
        inst = self._instances.get(decode)
        if inst is None or inst.audit is None or inst.state == "dead":
            return None
        return inst.audit.dispatch(request_id, prefill, tokens, now, key)

    def audited(self) -> frozenset[str]:
        """Live instances whose decode legs the KV audit judges now (``audit_dispatch`` gives a key)."""
        return frozenset(
            i.agent_id
            for i in self._instances.values()
            if i.audit is not None and i.audit.active and i.state != "dead"
        )

    def audit_done(self, decode: str, key: int, now: float, *, answered: bool) -> None:
        """The audited leg ended: ``answered`` (its engine counted its prompt) or failed before that."""
        inst = self._instances.get(decode)
        if inst is None or inst.audit is None:
            return
        if answered:
            inst.audit.answered(key, now)
        else:
            inst.audit.abandon(key)

    def _judge_links(self, decode: str, outcome: Outcome, now: float) -> None:
        """Feed an audit's outcome to the P→D link breakers, and report a verdict."""
        for leg in outcome.loaded:
            key = (leg.prefill, decode)
            if key in self._links:
                self._set_link(key, CLOSED)
        verdict = outcome.recomputed
        if verdict is not None:
            for prefill in verdict.prefills:
                self.leg_failed(decode, now, prefill, instance_fault=False)
        if self.on_kv_audit is not None and (outcome.loaded or verdict is not None):
            self.on_kv_audit(outcome)

    def kv_sent(self, prefill: str, decode: str, tokens: int, now: float) -> None:
        """A decode leg on ``decode`` will pull ``tokens`` tokens' KV from ``prefill`` (``link_rates``)."""
        view = self._views.get(decode)
        self.link_rates.kv_sent(prefill, decode, view.info.model if view else "", tokens, now)

    def goodbye(self, agent_id: str, reason: str = "") -> InstanceView | None:
        """The agent left on purpose; None when it was not known."""
        inst = self._instances.get(agent_id)
        if inst is None:
            return None
        if inst.state != "dead":
            self._kill(inst, f"goodbye: {reason}" if reason else "goodbye")
        return self._views[agent_id]

    def tick(self, now: float) -> list[str]:
        """Apply the passing of time: silent instances turn suspect, then dead; open breakers half-open.

        Returns the ids of the instances that died now (silent for ``heartbeat_timeout_s`` or more).
        """
        dead: list[str] = []
        for inst in self._instances.values():
            if inst.state == "dead":
                continue
            silent = now - inst.last_heartbeat
            if silent >= self._timeout:
                self._kill(inst, f"no heartbeat for {silent:.3f}s")
                dead.append(inst.agent_id)
                continue
            late = health.heartbeat_late(inst.last_heartbeat, now, self._suspect_after)
            breaker = health.on_tick(inst.breaker, now)
            if late != inst.late or breaker is not inst.breaker:
                inst.late, inst.breaker = late, breaker
                self._update(inst)
        self._use_links(self.link_rates.expire(now))
        if self._links:
            for key, b in list(self._links.items()):
                ticked = health.on_tick(b, now)
                if ticked is not b:
                    self._set_link(key, ticked)
        return dead

    def expire(self, now: float) -> list[str]:
        """``tick``, under the name the control plane's expiry loop has always used."""
        return self.tick(now)

    def _kill(self, inst: InstanceRecord, reason: str, before: InstanceState | None = None) -> None:
        was_live = (before or inst.state) != "dead"
        inst.state = "dead"
        inst.dead_reason = reason
        self._drop_links(inst.agent_id)
        self._changed(inst, membership=True)
        if was_live and self.on_lost is not None:
            self.on_lost(inst.agent_id, reason)

    def intent_of(self, agent_id: str) -> InstanceIntent:
        """What operators said of ``agent_id`` (kept across its sessions)."""
        return self._intent.get(agent_id, NO_INTENT)

    def apply_intent(self, agent_id: str, intent: InstanceIntent) -> None:
        """Operators' word on ``agent_id`` as the cluster keeps it (a replica: from etcd), applied to its
        session now, or at its Hello when it has none yet."""
        self._intent[agent_id] = intent
        if agent_id in self._instances:
            self.set_admin_drain(agent_id, intent.drained)
            self.set_cordon(agent_id, intent.cordoned)
            self.set_role_pin(agent_id, intent.pinned)

    def _remember(self, agent_id: str, **said: bool) -> None:
        intent = dataclasses.replace(self._intent.get(agent_id, NO_INTENT), **said)
        if intent.empty:
            self._intent.pop(agent_id, None)
        else:
            self._intent[agent_id] = intent

    def set_admin_drain(self, agent_id: str, draining: bool) -> InstanceView:
        """An operator drains (or undrains) an instance; takes effect for the very next request."""
        inst = self._instances[agent_id]
        self._remember(agent_id, drained=draining)
        inst.admin_draining = draining
        if inst.state != "dead":
            self._update(inst)
        else:
            self._changed(inst, membership=True)
        return self._views[agent_id]

    def set_role(self, agent_id: str, role: Role) -> InstanceView:
        """The instance now serves as ``role`` (its agent said yes): the same session goes on, and its
        requests with it; the next decision sees it in its new pool (once its link is proven again,
        where links are proven)."""
        inst = self._instances[agent_id]
        old = inst.info.role
        inst.info = dataclasses.replace(inst.info, role=role)
        if old != role and inst.link_proof and inst.kv_link_ready and inst.state != "dead":
            # Its KV now goes the other way, with engines it may never have handshaken with: joining
            # until a warm-up crosses a link in its new duty, so no user request pays (or fails) that.
            inst.kv_link_ready = False
            inst.state = inst.derive_state()
        self._changed(inst, membership=True)
        if self.on_event is not None and old != role:
            self.on_event("role", {"instance": agent_id, "from": old, "to": role})
        return self._views[agent_id]

    def engine_restarting(self, agent_id: str, reason: str) -> InstanceView:
        """Its agent is restarting the engine (a role change): until a heartbeat says ready again, it
        is not routed to, and requests still on it fail over."""
        inst = self._instances[agent_id]
        lost = inst.engine_state not in _ENGINE_LOST
        inst.engine_changed("restarting")
        if inst.state != "dead":
            self._update(inst, reason if lost else "")
        return self._views[agent_id]

    def kv_link_proven(self, agent_id: str, session: int) -> InstanceView | None:
        """A warm-up moved KV over the instance's link in ``session``, with its engine ready since
        (``instance.needs_link_proof``): it is routed to from now on. None when that session is over."""
        inst = self._instances.get(agent_id)
        if inst is None or inst.session != session or inst.state == "dead" or inst.engine_state != "ready":
            return None  # another engine, or none: its link is still to prove
        if not inst.kv_link_ready:
            inst.kv_link_ready = True
            self._update(inst)
        return self._views[agent_id]

    def unproven(self) -> frozenset[str]:
        """The instances whose KV link is still to prove, whatever their engine's or their own state: the
        warm-up's work list (``kv_warmup``), kept as views change so that finding it costs nothing in a
        cluster where every link is proven."""
        return frozenset(self._unproven)

    def set_role_pin(self, agent_id: str, pinned: bool) -> InstanceView:
        """An operator pins the instance's role (the planner leaves it), or lifts the pin."""
        inst = self._instances[agent_id]
        self._remember(agent_id, pinned=pinned)
        if inst.role_pinned != pinned:
            inst.role_pinned = pinned
            self._changed(inst, membership=False)
        return self._views[agent_id]

    def set_cordon(self, agent_id: str, cordoned: bool) -> InstanceView:
        """An operator cordons (or uncordons) an instance: no new requests; those on it finish."""
        inst = self._instances[agent_id]
        self._remember(agent_id, cordoned=cordoned)
        inst.admin_cordoned = cordoned
        if inst.state != "dead":
            self._update(inst)
        else:
            self._changed(inst, membership=True)
        return self._views[agent_id]

    def remove(self, agent_id: str) -> InstanceView:
        """Forget a dead instance (``KeyError`` if unknown, ``ValueError`` if it is still live)."""
        inst = self._instances[agent_id]
        if inst.state != "dead":
            raise ValueError(f"instance {agent_id!r} is {inst.state}: shut it down (or let it die) first")
        del self._instances[agent_id]
        self._intent.pop(agent_id, None)  # forgotten: an agent that comes back starts afresh
        view = self._own_views().pop(agent_id)
        self._unproven.discard(agent_id)
        self._requests_total.pop(agent_id, None)
        self._flight.forget(agent_id)
        self._version += 1
        self._membership += 1
        self._cached = None
        self._groups = None
        if self.on_event is not None:
            self.on_event("removed", {"instance": agent_id})
        if self._watch.changes or self._watch.flight:
            self._watch.notify()
        return view

    # --- the gateway's outcomes ---------------------------------------------------------------------

    def leg_succeeded(self, agent_id: str, partner: str | None = None) -> None:
        """A leg to ``agent_id`` worked (``partner``: the prefill instance whose KV a decode leg used)."""
        inst = self._instances.get(agent_id)
        if inst is not None and inst.breaker is not CLOSED and inst.state != "dead":
            inst.breaker = health.on_success(inst.breaker)
            self._update(inst)
        if partner is not None and self._links:
            key = (partner, agent_id)
            if key in self._links:
                self._set_link(key, CLOSED)

    def leg_failed(
        self, agent_id: str, now: float, partner: str | None = None, *, instance_fault: bool = True
    ) -> None:
        """A leg to ``agent_id`` failed: count it against the instance (unless ``instance_fault`` is
        False: the engine answered, so the trouble may be the KV pull from ``partner``) and, for a decode
        leg that used ``partner``'s KV, against that P→D link."""
        inst = self._instances.get(agent_id)
        if instance_fault and inst is not None and inst.state != "dead":
            breaker = health.on_failure(inst.breaker, now, self._policy)
            if breaker is not inst.breaker:
                inst.breaker = breaker
                self._update(inst)
        if partner is not None:
            key = (partner, agent_id)
            self._set_link(key, health.on_failure(self._links.get(key, CLOSED), now, self._policy))

    def link_breaker(self, prefill: str, decode: str) -> Breaker:
        """The breaker of the P→D link (closed when nothing went wrong on it)."""
        return self._links.get((prefill, decode), CLOSED)

    def _tell(self, old: InstanceView | None, new: InstanceView) -> None:
        """Publish what changed between two views of one instance."""
        assert self.on_event is not None
        for kind, fields in instance_events(old, new):
            self.on_event(kind, fields)

    def _set_link(self, key: tuple[str, str], b: Breaker) -> None:
        old = self._links.get(key, CLOSED)
        if self.on_event is not None and old.state != b.state:
            self.on_event("link", {"prefill": key[0], "decode": key[1], "from": old.state, "to": b.state})
        if b == CLOSED:
            self._links.pop(key, None)
        else:
            self._links[key] = b
        if old.routable != b.routable:
            self._blocked = frozenset(k for k, v in self._links.items() if not v.routable)
            self._version += 1
            self._cached = None
            self._membership += 1  # a pairing rule changed: memoized filters must see it
            if self._watch.changes or self._watch.flight:
                self._watch.notify()

    def _drop_links(self, agent_id: str) -> None:
        self._use_links(self.link_rates.forget(agent_id))
        if not self._links:
            return
        for key in [k for k in self._links if agent_id in k]:
            self._set_link(key, CLOSED)

    def get(self, agent_id: str) -> InstanceView | None:
        """One instance, or None."""
        return self._views.get(agent_id)

    def is_live(self, agent_id: str) -> bool:
        """True when ``agent_id`` has a session that is not dead."""
        inst = self._instances.get(agent_id)
        return inst is not None and inst.state != "dead"

    def requests_total(self, agent_id: str) -> int:
        """Requests the gateway has sent to ``agent_id`` since the orchestrator started."""
        return self._requests_total.get(agent_id, 0)

    def acquire(self, agent_id: str) -> None:
        """The gateway sends a request to ``agent_id``; pair with ``release`` in a ``finally``."""
        self._flight.add(agent_id)
        self._cached_in_flight = None
        self._changes.note(agent_id)
        self._requests_total[agent_id] = self._requests_total.get(agent_id, 0) + 1
        self.probe_sent(agent_id)
        if self._watch.flight:
            self._watch.notify_in_flight()

    def probe_sent(self, agent_id: str) -> None:
        """A request went to ``agent_id``: if its breaker is half-open, this one is the probe (nobody
        else until it answers)."""
        inst = self._instances.get(agent_id)
        if inst is not None and inst.breaker.state == "half_open":
            probing = health.on_dispatch(inst.breaker)
            if probing is not inst.breaker:
                inst.breaker = probing
                self._update(inst)

    def release(self, agent_id: str) -> None:
        """A request sent to ``agent_id`` is over (success, failure or cancellation)."""
        self._less(agent_id)
        self.probe_ended(agent_id)

    def hold(self, agent_id: str) -> None:
        """A decision sends a request to ``agent_id`` later (its decode leg, after the prefill): it counts
        there from now, so that the next pick sees it (``in_flight``); ``unhold`` as its leg starts."""
        self._flight.add(agent_id)
        self._cached_in_flight = None
        self._changes.note(agent_id)
        if self._watch.flight:
            self._watch.notify_in_flight()

    def unhold(self, agent_id: str) -> None:
        """A ``hold`` ends: its leg starts (and counts itself), or its request ended first."""
        self._less(agent_id)

    def _less(self, agent_id: str) -> None:
        self._flight.remove(agent_id)
        self._cached_in_flight = None
        self._changes.note(agent_id)
        if self._watch.flight:
            self._watch.notify_in_flight()

    def probe_ended(self, agent_id: str) -> None:
        """A request to ``agent_id`` is over: a probe that ended without a verdict (the client left)
        lets the next request probe."""
        inst = self._instances.get(agent_id)
        if inst is not None and inst.breaker.probing:
            inst.breaker = dataclasses.replace(inst.breaker, probing=False)
            if inst.state != "dead":
                self._update(inst)

    def own_in_flight(self) -> dict[str, int]:
        """This process's gateway requests outstanding per instance (a copy)."""
        return self._flight.own()

    def set_remote_in_flight(self, counts: dict[str, int], source: RemoteSource = "workers") -> None:
        """Outstanding requests per instance elsewhere, summed: this replica's gateway workers', or
        the other replicas' (``orchestrator/replicas``). Snapshots add them to this process's own."""
        before = self._flight.remote(source)
        if self._flight.set_remote(source, counts):
            self._note_counts(before, counts)
            self._cached_in_flight = None
            if self._watch.flight:
                self._watch.notify_in_flight()

    def remote_in_flight(self, source: RemoteSource) -> dict[str, int]:
        """What ``set_remote_in_flight`` last said for ``source`` (a copy)."""
        return self._flight.remote(source)

    def local_in_flight(self) -> dict[str, int]:
        """This replica's outstanding requests per instance: its own and its gateway workers'."""
        return self._flight.counts("workers")

    def count_sent(self, counts: Mapping[str, int]) -> None:
        """Requests the gateway workers sent per instance since they last said (``requests_total``)."""
        for agent_id, n in counts.items():
            self._requests_total[agent_id] = self._requests_total.get(agent_id, 0) + n
