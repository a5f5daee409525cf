"""The gateway's recovery decisions, one failure an operator would recognise per row: whether a failed
leg may go elsewhere, and where (the gateway and the cluster simulator both act on these)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.scheduling_support import request, snapshot, view
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.scheduling.config import default_config
from vllm_disagg.orchestrator.scheduling.recovery import (
    colocated_pick,
    may_resume,
    may_retry_decode,
    may_retry_prefill,
    next_decode,
    resume_pick,
)
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import EngineCapabilities

CONFIG = OrchestratorConfig(prefill_attempts=2, decode_attempts=3, max_resumes=2)
SCHEDULER = PluginScheduler(default_config())
P0, P1 = view("p0", role="prefill"), view("p1", role="prefill")
D0, D1 = view("d0", role="decode"), view("d1", role="decode")
OLD_D = view("d-r0", role="decode", revision="r0")  # cannot take KV from a prefill of another revision
NO_IDS = EngineCapabilities(known=True)  # an engine whose streams do not say their token ids
ALL_IDS = EngineCapabilities(True, True, True, True)


def able(v: InstanceView, capabilities: EngineCapabilities) -> InstanceView:
    return dataclasses.replace(v, info=dataclasses.replace(v.info, capabilities=capabilities))


@pytest.mark.parametrize(
    ("tries", "pinned", "config", "retry"),
    [
        pytest.param(1, False, CONFIG, True, id="the first prefill instance failed: another is tried"),
        pytest.param(2, False, CONFIG, False, id="as many failed as prefill_attempts: it runs colocated"),
        pytest.param(1, True, CONFIG, False, id="the client pinned that prefill instance: never another"),
        pytest.param(
            1,
            False,
            dataclasses.replace(CONFIG, prefill_attempts=1),
            False,
            id="one attempt allowed: none more",
        ),
    ],
)
def test_may_a_failed_prefill_leg_go_to_another_instance(
    tries: int, pinned: bool, config: OrchestratorConfig, retry: bool
) -> None:
    assert may_retry_prefill(tries, pinned, config) is retry


@pytest.mark.parametrize(
    ("tries", "retry"),
    [
        pytest.param(1, True, id="a decode leg failed before its first byte: another instance"),
        pytest.param(2, True, id="a second failed: a third"),
        pytest.param(3, False, id="decode_attempts failed: the client gets the error"),
    ],
)
def test_may_a_decode_leg_that_failed_before_its_first_byte_go_elsewhere(tries: int, retry: bool) -> None:
    assert may_retry_decode(tries, False, CONFIG) is retry


@pytest.mark.parametrize(
    ("resumes", "resume"),
    [
        pytest.param(0, True, id="a stream cut for the first time resumes elsewhere"),
        pytest.param(1, True, id="a second cut resumes too"),
        pytest.param(2, False, id="max_resumes reached: the stream ends with an error"),
    ],
)
def test_may_a_cut_stream_resume(resumes: int, resume: bool) -> None:
    assert may_resume(resumes, False, CONFIG) is resume


@pytest.mark.parametrize(
    ("instances", "exclude", "in_flight", "picked"),
    [
        pytest.param([P0, D0], set(), {}, "d0", id="a decode instance runs the request by itself"),
        pytest.param([P0, D0, D1], {"d0"}, {}, "d1", id="not the decode instance that failed it"),
        pytest.param(
            [P0, P1, D0], {"d0"}, {"p0": 3}, "p1",
            id="every decode instance failed it: the least busy prefill instance, the last one standing",
        ),
        pytest.param([P0, D0], {"d0", "p0"}, {}, None, id="every instance failed it: none"),
        pytest.param(
            [P0, dataclasses.replace(D0, state="draining")], set(), {}, "p0",
            id="the decode instance is draining: the prefill instance",
        ),
    ],
)  # fmt: skip
def test_where_a_request_runs_colocated(
    instances: list[InstanceView], exclude: set[str], in_flight: dict[str, int], picked: str | None
) -> None:
    req = dataclasses.replace(request(), exclude=frozenset(exclude))
    assert colocated_pick(SCHEDULER, req, snapshot(*instances, in_flight=in_flight), 0.0) == picked


@pytest.mark.parametrize(
    ("instances", "exclude", "picked"),
    [
        pytest.param([P0, D0, D1], {"d0"}, ("d1", "p0"), id="another decode instance takes the prefill's KV"),
        pytest.param(
            [P0, D0, OLD_D], {"d0"}, ("d-r0", None),
            id="the only other decode instance cannot take that KV: it runs the request colocated",
        ),
        pytest.param(
            [P0, D0], {"d0"}, ("p0", None), id="no other decode instance: the prefill one, colocated"
        ),
        pytest.param([P0, D0], {"d0", "p0"}, None, id="nobody left: the client gets the error"),
    ],
)  # fmt: skip
def test_where_a_decode_leg_goes_next(
    instances: list[InstanceView], exclude: set[str], picked: tuple[str, str | None] | None
) -> None:
    req = dataclasses.replace(request(), exclude=frozenset(exclude))
    assert next_decode(SCHEDULER, req, snapshot(*instances), 0.0, "p0") == picked


@pytest.mark.parametrize(
    ("instances", "picked"),
    [
        pytest.param(
            [P0, D0, able(D1, ALL_IDS)], "d1", id="an engine that says its token ids takes the stream"
        ),
        pytest.param(
            [able(P0, NO_IDS), D0, able(D1, NO_IDS), able(P1, ALL_IDS)], "p1",
            id="engines that cannot say their token ids are passed over",
        ),
        pytest.param([able(P0, NO_IDS), D0, able(D1, NO_IDS)], None, id="no engine can go on with it: none"),
        pytest.param([P0, D0, D1], "d1", id="engines that never said (agents before 1.4) are assumed able"),
    ],
)  # fmt: skip
def test_where_a_cut_stream_resumes(instances: list[InstanceView], picked: str | None) -> None:
    req = dataclasses.replace(request(), exclude=frozenset({"d0"}))
    assert resume_pick(SCHEDULER, req, snapshot(*instances), 0.0) == picked
