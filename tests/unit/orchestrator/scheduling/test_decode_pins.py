"""Pinning the decode instance, or the pair, as a client pins the prefill instance: how a pin resolves,
what it decides, each reason an unusable pin is a 400, and that a pinned D never moves elsewhere."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from aiohttp.test_utils import make_mocked_request

from tests.unit.orchestrator.scheduling.test_scheduler import Inst, snapshot
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.gateway.parsing import parse_request, pinned_decode, pinned_prefill
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.recovery import may_resume, may_retry_decode
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.views import RegistrySnapshot

NOW = 1000.0
SCHEDULER = PluginScheduler()
CONFIG = OrchestratorConfig(decode_attempts=3, max_resumes=2)


def decide(snap: RegistrySnapshot, *, prefill: str | None = None, decode: str | None = None) -> Decision:
    request = SchedulingRequest(
        "r1", "m", 10, is_chat=False, stream=False, pinned_prefill=prefill, pinned_decode=decode
    )
    return SCHEDULER.decide(request, snap, NOW)


def explain(decision: Decision) -> dict[str, Any]:
    assert decision.explanation is not None
    return decision.explanation.to_json()


# d1 is idle and d2 busy: the decode profile alone would pick d1.
ONE_P_TWO_D = (Inst("p", "prefill"), Inst("d1", "decode"), Inst("d2", "decode", in_flight=9, queue=9))


def test_without_a_pin_the_busy_decode_instance_is_not_picked() -> None:
    assert decide(snapshot(*ONE_P_TWO_D)).decode == "d1"


@pytest.mark.parametrize(
    "pin",
    [
        pytest.param("d2", id="by-agent-id"),
        pytest.param("http://d2:8000", id="by-engine-url"),
        pytest.param("http://d2:8000/", id="by-engine-url-with-slash"),
        pytest.param("d2:8000", id="by-host-port"),
    ],
)
def test_a_client_may_pin_the_decode_instance_by_id_url_or_host_port(pin: str) -> None:
    decision = decide(snapshot(*ONE_P_TWO_D), decode=pin)
    assert (decision.mode, decision.prefill, decision.decode) == ("disaggregated", "p", "d2")
    why = explain(decision)
    assert why["pinned_decode"] == "d2", "the explanation shows where D was pinned"
    assert why["request"]["pinned_decode"] == pin
    assert (why["decode"]["picker"], why["decode"]["pick"]) == ("client", "d2")
    assert [c["id"] for c in why["decode"]["candidates"]] == ["d2"]
    assert why["pinned_prefill"] is None


def test_a_pinned_decode_instance_gets_a_prefill_instance_that_can_exchange_kv_with_it() -> None:
    snap = snapshot(
        Inst("p1", "prefill", revision="v1"),
        Inst("p2", "prefill", revision="v2", queue=9),
        Inst("d1", "decode", revision="v1"),
        Inst("d2", "decode", revision="v2", queue=9),
    )
    decision = decide(snap, decode="d2")
    assert (decision.prefill, decision.decode) == ("p2", "d2")


def test_a_pinned_decode_instance_with_no_compatible_prefill_runs_the_request_colocated_on_it() -> None:
    snap = snapshot(Inst("p", "prefill", block_size=32), Inst("d1", "decode"), Inst("d2", "decode"))
    decision = decide(snap, decode="d2")
    assert (decision.mode, decision.prefill, decision.decode) == ("colocated", None, "d2")


@pytest.mark.parametrize(
    ("instances", "prefill", "decode"),
    [
        pytest.param(ONE_P_TWO_D, "p", "d2", id="prefill-and-decode-instances"),
        pytest.param(
            (Inst("b1", "both"), Inst("b2", "both", queue=9), Inst("d", "decode")),
            "b2",
            "b1",
            id="role-both-serves-either-leg",
        ),
        pytest.param(ONE_P_TWO_D, "http://p:8000", "d2:8000", id="by-url-and-host-port"),
    ],
)
def test_a_client_may_pin_the_pair(instances: tuple[Inst, ...], prefill: str, decode: str) -> None:
    decision = decide(snapshot(*instances), prefill=prefill, decode=decode)
    p, d = decision.prefill, decision.decode
    assert decision.mode == "disaggregated"
    why = explain(decision)
    assert (why["pinned_prefill"], why["pinned_decode"]) == (p, d)
    assert why["decider"]["plugin"] == "client"
    assert why["decider"]["reason"] == f"the client pinned prefill instance {p!r} and decode instance {d!r}"
    assert p is not None and p in prefill and d in decode


DECODE_PARAM, PREFILL_PARAM = "decode_endpoint", "prefill_endpoint"


@pytest.mark.parametrize(
    ("instances", "prefill", "decode", "reason", "param"),
    [
        pytest.param(
            ONE_P_TWO_D,
            None,
            "nope",
            "the pinned decode instance 'nope' is not registered",
            DECODE_PARAM,
            id="unknown-id",
        ),
        pytest.param(
            ONE_P_TWO_D, None, "http://10.9.9.9:1", "is not registered", DECODE_PARAM, id="unknown-url"
        ),
        pytest.param(
            (Inst("p", "prefill"), Inst("d", "decode", model="o")),
            None,
            "d",
            "the pinned decode instance 'd' serves model 'o', not 'm'",
            DECODE_PARAM,
            id="other-model",
        ),
        pytest.param(
            ONE_P_TWO_D,
            None,
            "p",
            "the pinned decode instance 'p' has role 'prefill' and cannot decode",
            DECODE_PARAM,
            id="prefill-only-instance-pinned-as-decode",
        ),
        pytest.param(
            ONE_P_TWO_D,
            "d1",
            "d2",
            "the pinned prefill instance 'd1' has role 'decode' and cannot prefill",
            PREFILL_PARAM,
            id="decode-only-instance-pinned-as-prefill-of-a-pair",
        ),
        pytest.param(
            (Inst("p", "prefill"), Inst("d", "decode", state="draining")),
            None,
            "d",
            "the pinned decode instance 'd' is draining, not ready",
            DECODE_PARAM,
            id="draining",
        ),
        pytest.param(
            (Inst("p", "prefill"), Inst("d", "decode", state="dead")),
            None,
            "d",
            "the pinned decode instance 'd' is dead, not ready",
            DECODE_PARAM,
            id="dead",
        ),
        pytest.param(
            (Inst("p", "prefill"), Inst("d", "decode", state="starting"), Inst("d2", "decode")),
            None,
            "d",
            "not ready",
            DECODE_PARAM,
            id="engine-still-starting",
        ),
        pytest.param(
            (Inst("p", "prefill", state="draining"), Inst("d", "decode")),
            "p",
            "d",
            "the pinned prefill instance 'p' is draining, not ready",
            PREFILL_PARAM,
            id="pair-with-a-draining-prefill",
        ),
        pytest.param(
            (Inst("b", "both"), Inst("d", "decode")),
            "b",
            "http://b:8000",
            "the instance 'b' is pinned as both the prefill and the decode instance",
            DECODE_PARAM,
            id="one-instance-pinned-as-both",
        ),
        pytest.param(
            (Inst("p", "prefill", block_size=32), Inst("d", "decode")),
            "p",
            "d",
            "the pinned prefill instance 'p' and decode instance 'd' cannot exchange KV: "
            "block size differs: prefill 32, decode 16",
            DECODE_PARAM,
            id="pair-of-other-block-sizes",
        ),
        pytest.param(
            (Inst("p", "prefill", revision="v2"), Inst("d", "decode", revision="v1")),
            "p",
            "d",
            "cannot exchange KV: revision differs: prefill 'v2', decode 'v1'",
            DECODE_PARAM,
            id="pair-of-other-revisions",
        ),
        pytest.param(
            (Inst("p", "prefill", kv_connector="NixlConnector"), Inst("d", "decode")),
            "p",
            "d",
            "cannot exchange KV: KV connector differs: prefill 'NixlConnector', decode ''",
            DECODE_PARAM,
            id="pair-of-other-connectors",
        ),
    ],
)
def test_an_unusable_decode_or_pair_pin_is_a_bad_request_saying_why(
    instances: tuple[Inst, ...], prefill: str | None, decode: str, reason: str, param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        decide(snapshot(*instances), prefill=prefill, decode=decode)
    assert info.value.status == 400
    assert reason in info.value.message
    assert info.value.param == param


@pytest.mark.parametrize(
    ("tries", "pinned", "retry"),
    [
        pytest.param(1, False, True, id="an unpinned decode instance failed: another is tried"),
        pytest.param(1, True, False, id="the client pinned it: never another, the client gets the error"),
        pytest.param(3, True, False, id="pinned and out of attempts: none"),
    ],
)
def test_a_pinned_decode_leg_is_never_retried_elsewhere(tries: int, pinned: bool, retry: bool) -> None:
    assert may_retry_decode(tries, pinned, CONFIG) is retry


@pytest.mark.parametrize(
    ("resumes", "pinned", "resume"),
    [
        pytest.param(0, False, True, id="an unpinned cut stream resumes elsewhere"),
        pytest.param(0, True, False, id="a pinned one ends with its error"),
    ],
)
def test_a_pinned_decode_leg_is_never_resumed_elsewhere(resumes: int, pinned: bool, resume: bool) -> None:
    assert may_resume(resumes, pinned, CONFIG) is resume


def _parsed(body: dict[str, Any], headers: dict[str, str]) -> tuple[str | None, str | None, dict[str, Any]]:
    parsed = parse_request(orjson.dumps(body), "completions")
    request = make_mocked_request("POST", "/v1/completions", headers=headers)
    return pinned_prefill(request, parsed), pinned_decode(request, parsed), parsed.body


BASE = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize(
    ("body", "headers", "pins"),
    [
        pytest.param({"decode_endpoint": "d0"}, {}, (None, "d0"), id="decode-by-body"),
        pytest.param({}, {"X-Disagg-Decode": "d0"}, (None, "d0"), id="decode-by-header"),
        pytest.param(
            {"prefill_endpoint": "p0"}, {"X-Disagg-Decode": "d0"}, ("p0", "d0"), id="pair-by-body-and-header"
        ),
        pytest.param(
            {"decode_endpoint": "d0"}, {"X-Disagg-Decode": "d0"}, (None, "d0"), id="header-and-body-agree"
        ),
    ],
)
def test_the_decode_pin_is_read_from_header_or_body_and_removed_from_the_body(
    body: dict[str, Any], headers: dict[str, str], pins: tuple[str | None, str | None]
) -> None:
    p, d, forwarded = _parsed({**BASE, **body}, headers)
    assert (p, d) == pins
    assert "decode_endpoint" not in forwarded and "prefill_endpoint" not in forwarded


@pytest.mark.parametrize(
    ("body", "headers", "reason"),
    [
        pytest.param(
            {"decode_endpoint": 7}, {}, "'decode_endpoint' must be a non-empty string", id="not-a-string"
        ),
        pytest.param({"decode_endpoint": ""}, {}, "'decode_endpoint' must be a non-empty string", id="empty"),
        pytest.param(
            {"decode_endpoint": "d1"},
            {"X-Disagg-Decode": "d0"},
            "the X-Disagg-Decode header ('d0') and 'decode_endpoint' ('d1') disagree",
            id="header-and-body-disagree",
        ),
    ],
)
def test_a_malformed_decode_pin_is_a_bad_request(
    body: dict[str, Any], headers: dict[str, str], reason: str
) -> None:
    with pytest.raises(BadRequest) as info:
        _parsed({**BASE, **body}, headers)
    assert reason in info.value.message
    assert info.value.param == "decode_endpoint"
