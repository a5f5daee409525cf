"""The least-outstanding scheduler: role, state and model filters; load order; colocated fallback."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

from vllm_disagg.errors import ModelNotFound, NoCapacity
from vllm_disagg.orchestrator.registry import Registry, RegistrySnapshot
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import LeastOutstandingScheduler
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, MetricsSnapshot, Role

NOW = 1000.0


@dataclass(frozen=True)
class Inst:
    """One instance of a table row: id, role, and how it looks to the scheduler."""

    id: str
    role: Role
    model: str = "m"
    state: str = "ready"  # ready | starting | draining | dead
    in_flight: int = 0
    queue: int = 0  # engine running + waiting
    block_size: int = 16
    kv_connector: str = ""
    extra: dict[str, str] = field(default_factory=dict)


def snapshot(*instances: Inst) -> RegistrySnapshot:
    reg = Registry(heartbeat_timeout_s=1.0)
    for i in instances:
        reg.hello(
            i.id,
            InstanceInfo(
                url=f"http://{i.id}",
                role=i.role,
                model=i.model,
                block_size=i.block_size,
                kv_connector=i.kv_connector,
            ),
            NOW,
        )
        engine: EngineState = "starting" if i.state == "starting" else "ready"
        reg.heartbeat(
            i.id,
            Heartbeat(
                seq=1,
                engine_state=engine,
                draining=i.state == "draining",
                metrics=MetricsSnapshot(num_running=i.queue),
            ),
            NOW,
        )
        if i.state == "dead":
            reg.goodbye(i.id)
        for _ in range(i.in_flight):
            reg.acquire(i.id)
    return reg.snapshot()


def decide(snap: RegistrySnapshot, model: str = "m", request_id: str = "r1") -> Decision:
    request = SchedulingRequest(
        request_id=request_id, model=model, prompt_len=10, is_chat=False, stream=False
    )
    return LeastOutstandingScheduler().decide(request, snap, NOW)


@pytest.mark.parametrize(
    ("instances", "mode", "prefill", "decode"),
    [
        pytest.param(
            [Inst("p", "prefill"), Inst("d", "decode")], "disaggregated", "p", "d", id="1p1d-disaggregates"
        ),
        pytest.param([Inst("d", "decode")], "colocated", None, "d", id="no-prefill-instance-runs-colocated"),
        pytest.param(
            [Inst("p", "prefill", state="starting"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-not-ready-runs-colocated",
        ),
        pytest.param(
            [Inst("p", "prefill", state="draining"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="draining-prefill-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", state="dead"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="dead-prefill-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", model="other"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-of-another-model-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", block_size=32), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-with-another-block-size-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", kv_connector="NixlConnector"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-with-another-kv-connector-is-skipped",
        ),
        pytest.param(
            [Inst("d1", "decode", in_flight=3), Inst("d2", "decode", in_flight=1)],
            "colocated",
            None,
            "d2",
            id="fewest-in-flight-decode-wins",
        ),
        pytest.param(
            [Inst("d1", "decode", in_flight=1, queue=9), Inst("d2", "decode", in_flight=1, queue=2)],
            "colocated",
            None,
            "d2",
            id="in-flight-tie-broken-by-engine-queue",
        ),
        pytest.param(
            [Inst("d1", "decode", in_flight=0, queue=50), Inst("d2", "decode", in_flight=1, queue=0)],
            "colocated",
            None,
            "d1",
            id="in-flight-counts-before-engine-queue",
        ),
        pytest.param(
            [Inst("p1", "prefill", in_flight=2), Inst("p2", "prefill"), Inst("d", "decode")],
            "disaggregated",
            "p2",
            "d",
            id="fewest-in-flight-prefill-wins",
        ),
        pytest.param(
            [Inst("b", "both", in_flight=1), Inst("d", "decode")],
            "disaggregated",
            "b",
            "d",
            id="role-both-can-prefill",
        ),
        pytest.param(
            [Inst("b", "both")], "colocated", None, "b", id="one-both-instance-never-prefills-for-itself"
        ),
        pytest.param(
            [Inst("p", "prefill"), Inst("d", "decode", state="draining"), Inst("b", "both", in_flight=5)],
            "disaggregated",
            "p",
            "b",
            id="role-both-decodes-when-decode-drains",
        ),
        pytest.param(
            [Inst("p", "prefill"), Inst("d", "decode", model="other"), Inst("d2", "decode")],
            "disaggregated",
            "p",
            "d2",
            id="decode-of-another-model-is-skipped",
        ),
    ],
)
def test_decisions(instances: list[Inst], mode: str, prefill: str | None, decode: str) -> None:
    decision = decide(snapshot(*instances))
    assert (decision.mode, decision.prefill, decision.decode) == (mode, prefill, decode)


@pytest.mark.parametrize(
    ("instances", "error"),
    [
        pytest.param([], ModelNotFound, id="no-instances-at-all-is-unknown-model"),
        pytest.param(
            [Inst("d", "decode", model="other")], ModelNotFound, id="only-other-models-is-unknown-model"
        ),
        pytest.param([Inst("d", "decode", state="dead")], NoCapacity, id="only-dead-decode-is-no-capacity"),
        pytest.param(
            [Inst("d", "decode", state="draining")], NoCapacity, id="only-draining-decode-is-no-capacity"
        ),
        pytest.param(
            [Inst("d", "decode", state="starting")], NoCapacity, id="only-starting-decode-is-no-capacity"
        ),
        pytest.param([Inst("p", "prefill")], NoCapacity, id="prefill-only-cluster-is-no-capacity"),
    ],
)
def test_errors(instances: list[Inst], error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        decide(snapshot(*instances))
    assert "'m'" in str(info.value), "the message names the model"


def test_ties_spread_over_equal_instances_by_request_id() -> None:
    snap = snapshot(*(Inst(f"d{i}", "decode") for i in range(4)))
    picks = Counter(decide(snap, request_id=f"req-{n}").decode for n in range(400))
    assert set(picks) == {"d0", "d1", "d2", "d3"}
    assert min(picks.values()) > 50, picks


def test_the_same_request_gets_the_same_decision() -> None:
    snap = snapshot(
        *(Inst(f"d{i}", "decode") for i in range(4)), Inst("p1", "prefill"), Inst("p2", "prefill")
    )
    assert (
        len(
            {
                (decide(snap, request_id="same").decode, decide(snap, request_id="same").prefill)
                for _ in range(10)
            }
        )
        == 1
    )


def test_explanation_names_the_candidates_and_their_load() -> None:
    decision = decide(snapshot(Inst("p", "prefill", in_flight=2), Inst("d", "decode", queue=4)))
    exp = decision.explanation
    assert exp["scheduler"] == "least-outstanding"
    assert exp["decode"] == {"id": "d", "in_flight": 0, "engine_queue": 4}
    assert exp["prefill"] == {"id": "p", "in_flight": 2, "engine_queue": 0}


def test_colocated_explanation_says_why() -> None:
    exp = decide(snapshot(Inst("d", "decode"))).explanation
    assert "no ready prefill" in str(exp["reason"])
