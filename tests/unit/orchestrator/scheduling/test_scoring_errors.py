"""A scorer that raises on a candidate costs that candidate, not the request: it is dropped with the
error logged and in the explanation, and the others are ranked as usual (issue 31)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import pytest

from vllm_disagg.errors import NoCapacity
from vllm_disagg.orchestrator.scheduling.config import default_config_text, load_config
from vllm_disagg.orchestrator.scheduling.framework import PluginSpec, ProfileContext, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins import catalog
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role

NOW = 1000.0


@dataclass(frozen=True, slots=True)
class Params:
    bad: str = "d1"


class BoomScorer:
    """Scores 1, except that it raises when its batch holds the ``bad`` instance."""

    TYPE: ClassVar[str] = "boom-scorer"

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def score(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[float]:
        if any(c.agent_id == self.params.bad for c in candidates):
            raise ZeroDivisionError("float division by zero")
        return [1.0] * len(candidates)


@pytest.fixture
def scheduler(monkeypatch: pytest.MonkeyPatch) -> PluginScheduler:
    specs = dict(catalog.PLUGIN_SPECS)
    specs["boom-scorer"] = PluginSpec("boom-scorer", Params, BoomScorer, "scorer")
    monkeypatch.setattr(catalog, "PLUGIN_SPECS", MappingProxyType(specs))
    text = default_config_text().replace(
        "plugins:\n  - type: role-filter", "plugins:\n  - type: boom-scorer\n  - type: role-filter", 1
    )
    last = "      - pluginRef: topology-scorer\n        weight: 0"  # the decode profile's last scorer
    text = text.replace(last, last + "\n      - pluginRef: boom-scorer\n        weight: 1", 1)
    return PluginScheduler(load_config(text, "boom.yaml"))


def snapshot(*ids: str) -> RegistrySnapshot:
    reg = Registry(heartbeat_timeout_s=60.0)
    for agent_id in ids:
        role: Role = "prefill" if agent_id.startswith("p") else "decode"
        reg.hello(agent_id, InstanceInfo(url=f"http://{agent_id}:8000", role=role, model="m"), NOW)
        reg.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready", metrics=MetricsSnapshot()), NOW)
    return reg.snapshot()


def request(i: int = 0) -> SchedulingRequest:
    return SchedulingRequest(request_id=f"r{i}", model="m", prompt_len=64, is_chat=False, stream=False)


def test_the_candidate_whose_scoring_raises_is_dropped_and_the_request_still_routed(
    scheduler: PluginScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    snap = snapshot("p0", "d0", "d1")
    with caplog.at_level(logging.ERROR):
        decisions = [scheduler.decide(request(i), snap, NOW) for i in range(10)]
    assert {d.decode for d in decisions} == {"d0"}
    explanation = decisions[0].explanation
    assert explanation is not None
    filtered = explanation.to_json()["decode"]["filtered"]  # type: ignore[index]
    failed = [f for f in filtered if f["filter"] == "scoring-failed"]
    assert [f["id"] for f in failed] == ["d1"], filtered
    assert failed[0]["reason"] == "scoring raised ZeroDivisionError: float division by zero"
    assert any("d1 dropped: scoring it raised" in r.getMessage() for r in caplog.records)


def test_when_no_candidate_can_be_scored_the_answer_is_no_capacity_with_a_reason(
    scheduler: PluginScheduler,
) -> None:
    with pytest.raises(NoCapacity, match="no decode candidate could be scored"):
        scheduler.decide(request(), snapshot("p0", "d1"), NOW)
