"""Clusters in a line each, for the tables of the control steps' tests: ``Inst("d-r2", "decode", "r2")``
is a ready decode instance of revision r2; its other fields say how it differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import RegistrySnapshot
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, MetricsSnapshot, Role

MODEL = "m"


@dataclass(frozen=True, slots=True)
class Inst:
    """One instance as a test row has it."""

    agent_id: str
    role: Role = "decode"
    revision: str = "r1"
    engine: EngineState = "ready"  # "starting": joined, not ready yet
    drained: bool = False  # an operator's (or a rollout's) drain
    in_flight: int = 0
    dead: bool = False
    model: str = MODEL
    sessions: int = 1  # Hellos it said: a second one is its agent starting over


def registry_of(*instances: Inst, now: float = 0.0) -> Registry:
    """A registry holding ``instances``, as their rows say."""
    reg = Registry(heartbeat_timeout_s=60.0)
    for i in instances:
        add(reg, i, now)
    return reg


def add(reg: Registry, i: Inst, now: float = 0.0) -> None:
    """``i`` joins ``reg`` (a new session if it was there)."""
    info = InstanceInfo(url=f"http://{i.agent_id}", role=i.role, model=i.model, revision=i.revision)
    for _ in range(i.sessions):
        reg.hello(i.agent_id, info, now)
    reg.heartbeat(i.agent_id, beat(i.engine), now)
    if i.drained:
        reg.set_admin_drain(i.agent_id, True)
    for _ in range(i.in_flight):
        reg.acquire(i.agent_id)
    if i.dead:
        reg.goodbye(i.agent_id, "gone")


def beat(engine: EngineState = "ready", **metrics: Any) -> Heartbeat:
    return Heartbeat(seq=1, engine_state=engine, metrics=MetricsSnapshot(**metrics))


def snapshot_of(*instances: Inst) -> RegistrySnapshot:
    """A snapshot of a registry holding ``instances``."""
    return registry_of(*instances).snapshot()
