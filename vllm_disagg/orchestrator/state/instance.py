"""The registry's private, mutable record of one instance, and when its KV link must be proven.

**Ready means its KV link works.** A NIXL engine learns each partner's KV agent in a handshake at the
first transfer between them: on a fresh engine (a start, a crash, a role change by restart) the first
user request would pay for it, and on a starved host the handshake can time out and fail the decode
(vLLM's ``kv_load_failure_policy=fail``). So an instance whose connector needs that handshake stays
``joining`` after its engine is ready, until a warm-up request has moved KV over its link
(``orchestrator/kv_warmup.py``; the registry's ``kv_link_proven``). Engines of other connectors, and
simulated ones, are ready with their engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_disagg.orchestrator.state import health
from vllm_disagg.orchestrator.state.health import CLOSED, Breaker, InstanceState
from vllm_disagg.orchestrator.state.kv_audit import DecodeAudit
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import EngineState, InstanceInfo, MetricsSnapshot

# P/D connectors that set a link up at its first transfer (vLLM 0.32's NixlConnector: a ZeroMQ
# handshake with the remote engine's side channel, then NIXL's own metadata exchange).
HANDSHAKE_CONNECTORS = frozenset({"NixlConnector"})


def needs_link_proof(info: InstanceInfo) -> bool:
    """Must a warm-up transfer succeed before this instance is routed to?"""
    return info.engine == "vllm" and info.kv_connector in HANDSHAKE_CONNECTORS


@dataclass(slots=True)
class InstanceRecord:
    """The registry's private, mutable record."""

    agent_id: str
    info: InstanceInfo
    session: int
    joined_at: float
    last_heartbeat: float
    state: InstanceState = "joining"
    engine_state: EngineState = "starting"
    agent_draining: bool = False
    admin_draining: bool = False
    admin_cordoned: bool = False
    heartbeats: int = 0
    metrics: MetricsSnapshot = field(default_factory=MetricsSnapshot)
    dead_reason: str = ""
    breaker: Breaker = CLOSED
    late: bool = False
    audit: DecodeAudit | None = None  # its decode legs' KV loads, from its counters (``kv_audit``)
    protocol: str = ""
    role_pinned: bool = False
    # Its link must be proven by a warm-up each time its engine becomes ready (``needs_link_proof``,
    # where the registry's owner runs warm-ups); and whether one moved KV over it since.
    link_proof: bool = False
    kv_link_ready: bool = True

    def engine_changed(self, engine_state: EngineState) -> None:
        """The agent reports ``engine_state``: an engine that is not serving will be a new one when it
        is, with links of its own to prove."""
        self.engine_state = engine_state
        if engine_state != "ready":
            self.kv_link_ready = not self.link_proof

    def derive_state(self) -> InstanceState:
        """The state a live session is in, from every signal (see ``health.derive_state``)."""
        return health.derive_state(
            engine_state=self.engine_state,
            draining=self.agent_draining or self.admin_draining,
            cordoned=self.admin_cordoned,
            late=self.late,
            breaker_routable=self.breaker.routable,
            kv_link_ready=self.kv_link_ready,
        )

    def view(self) -> InstanceView:
        return InstanceView(
            agent_id=self.agent_id,
            info=self.info,
            state=self.state,
            session=self.session,
            engine_state=self.engine_state,
            agent_draining=self.agent_draining,
            admin_draining=self.admin_draining,
            joined_at=self.joined_at,
            last_heartbeat=self.last_heartbeat,
            heartbeats=self.heartbeats,
            metrics=self.metrics,
            dead_reason=self.dead_reason,
            admin_cordoned=self.admin_cordoned,
            breaker=self.breaker,
            late=self.late,
            protocol=self.protocol,
            role_pinned=self.role_pinned,
            kv_link_ready=self.kv_link_ready,
        )
