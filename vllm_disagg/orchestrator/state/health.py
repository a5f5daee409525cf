"""The health model: circuit breakers and the instance state derived from every signal. Pure.

An instance's state (``derive_state``) combines what its agent reports (engine state, draining), what
the operator said (drain, cordon), how fresh its heartbeats are, and how the gateway's requests to it
went (its circuit breaker)::

    joining ──engine ready──▶ ready ──late heartbeat, engine unhealthy/restarting, breaker open──▶ suspect
                                ▲                                                                  │
                                └───────────── signals clear (heartbeat, engine ready, probe ok) ──┘
    any live state ── no heartbeat for the timeout, Goodbye, engine stopped ──▶ dead (a new Hello revives)
    ready/suspect ── operator cordon ──▶ cordoned;  agent or operator drain ──▶ draining

An engine whose KV link needs a handshake is ``joining`` until a warm-up proved the link
(``instance.needs_link_proof``). Only ``ready`` instances are routed to. ``suspect`` is the fast,
reversible step: routing stops at the first sign of trouble and resumes without a new session when
the sign goes away.

A ``Breaker`` guards an instance, and another guards each P→D link, from the gateway's point of view:
``failures_to_open`` consecutive failed requests open it; after ``open_s`` it is half-open and lets one
request through as a probe (the instance is not routed to while that probe runs); the probe's success
closes it, its failure opens it again for twice as long (up to ``max_open_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import EngineState

InstanceState = Literal["joining", "ready", "suspect", "cordoned", "draining", "dead"]
INSTANCE_STATES: tuple[InstanceState, ...] = ("joining", "ready", "suspect", "cordoned", "draining", "dead")
BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """When a breaker opens and for how long."""

    failures_to_open: int = 3  # consecutive failures
    open_s: float = 1.0  # first open period; doubles after each failed probe
    max_open_s: float = 30.0

    def __post_init__(self) -> None:
        if self.failures_to_open < 1:
            raise ConfigError(f"breaker.failures_to_open must be >= 1, got {self.failures_to_open}")
        if not 0 < self.open_s <= self.max_open_s:
            raise ConfigError(
                f"breaker.open_s must be > 0 and <= max_open_s, got {self.open_s} and {self.max_open_s}"
            )


@dataclass(frozen=True, slots=True)
class Breaker:
    """One circuit breaker's state; every transition below returns a new one."""

    state: BreakerState = "closed"
    failures: int = 0  # consecutive, while closed
    opened_at: float = 0.0
    open_for_s: float = 0.0
    probing: bool = False  # half-open with its one probe request in flight

    @property
    def routable(self) -> bool:
        """May a new request go through it?"""
        return self.state == "closed" or (self.state == "half_open" and not self.probing)


CLOSED = Breaker()


def on_success(b: Breaker) -> Breaker:
    """A request through the breaker succeeded: it closes (a probe's success ends the trouble)."""
    return b if b is CLOSED else CLOSED


def on_failure(b: Breaker, now: float, policy: BreakerPolicy) -> Breaker:
    """A request through the breaker failed."""
    if b.state == "closed":
        failures = b.failures + 1
        if failures < policy.failures_to_open:
            return Breaker(failures=failures)
        return Breaker("open", failures, now, policy.open_s)
    if b.state == "half_open":
        return Breaker("open", b.failures, now, min(policy.max_open_s, 2 * b.open_for_s))
    return b  # already open: a request that started before it opened


def on_tick(b: Breaker, now: float) -> Breaker:
    """Time passes: an open breaker becomes half-open once its period is over."""
    if b.state == "open" and now - b.opened_at >= b.open_for_s:
        return replace(b, state="half_open", probing=False)
    return b


def on_dispatch(b: Breaker) -> Breaker:
    """A request is sent through it: in half-open, that request is the probe."""
    if b.state == "half_open" and not b.probing:
        return replace(b, probing=True)
    return b


def heartbeat_late(last_heartbeat: float, now: float, suspect_after_s: float) -> bool:
    """True when the instance has been silent long enough to stop routing to it (not yet dead)."""
    return now - last_heartbeat >= suspect_after_s


def derive_state(
    *,
    engine_state: EngineState,
    draining: bool,
    cordoned: bool,
    late: bool,
    breaker_routable: bool,
    kv_link_ready: bool = True,
) -> InstanceState:
    """The state of a live session (``dead`` only for an engine the agent says has stopped).

    ``kv_link_ready``: False for a ready engine whose KV link is still to be proven by a warm-up
    (``instance.needs_link_proof``): it is joining until then."""
    if engine_state == "stopped":
        return "dead"
    if draining:
        return "draining"
    if cordoned:
        return "cordoned"
    if engine_state == "starting" or (engine_state == "ready" and not kv_link_ready):
        return "joining"
    if engine_state != "ready" or late or not breaker_routable:
        return "suspect"
    return "ready"


def suspect_reason(*, engine_state: EngineState, late: bool, breaker: Breaker) -> str:
    """Why a suspect instance is suspect, for the admin API ("" when it is not)."""
    reasons = []
    if engine_state in ("unhealthy", "restarting"):
        reasons.append(f"engine {engine_state}")
    if late:
        reasons.append("heartbeat late")
    if breaker.state == "open":
        reasons.append(f"breaker open after {breaker.failures} failures")
    elif breaker.probing:
        reasons.append("breaker half-open, probe in flight")
    return ", ".join(reasons)
