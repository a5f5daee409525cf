"""Whether a request's pair has room (``admission.fit``): each stage saturates on its own, the time a
request waited counts against its target, an idle instance always has room, and a target the
prompt's own prefill cannot meet, or one a request that waited misses on a pair with room, is out of
reach."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.scheduling_support import request, snapshot, view
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.orchestrator.admission.fit import fit
from vllm_disagg.orchestrator.admission.policy import Fit
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.protocol.messages import MetricsSnapshot

# The engine may take the whole budget here, so that the tables read in whole seconds; the share is
# tested on its own below.
CONFIG = AdmissionConfig(ttft_s=2.0, kv_usage_high=0.9, engine_share=1.0)
RATE = 1000.0  # prompt tokens per second the prefill instance computes
P = view("p", role="prefill", metrics=MetricsSnapshot(prefill_tokens_per_s=RATE, mean_prompt_tokens=1000))
D = view("d", role="decode", metrics=MetricsSnapshot(tpot_s=0.01, num_running=4, kv_cache_usage=0.5))
PAIR = Decision("disaggregated", "p", "d")


def slo(ttft: float | None = None, tpot: float | None = None, prompt: int = 1000) -> SchedulingRequest:
    return dataclasses.replace(request(prompt_len=prompt), slo_ttft_s=ttft, slo_tpot_s=tpot)


@pytest.mark.parametrize(
    ("req", "p_busy", "waited", "expected"),
    [
        # The prefill instance has n requests in flight: (n + 1) x 1,000 tokens at 1,000 tokens/s.
        (slo(ttft=3.0), 1, 0.0, Fit(True)),  # 2 s predicted, 3 s target
        (slo(ttft=3.0), 1, 0.9, Fit(True)),  # 0.9 s waited + 2 s
        # 1.1 s waited + 2 s > 3 s: room for a newcomer, not for it: late, so out of reach
        (slo(ttft=3.0), 1, 1.1, Fit(False, "prefill", unreachable=True)),
        (slo(ttft=3.0), 3, 0.0, Fit(False, "prefill")),  # 4 s predicted
        (slo(ttft=3.0), 0, 1.5, Fit(True)),  # idle: waiting longer cannot help
        (slo(ttft=3.0), 0, 2.5, Fit(True, unreachable=True)),  # 2.5 s waited + its own 1 s
        (slo(ttft=0.5), 0, 0.0, Fit(True, unreachable=True)),  # idle, but its own 1 s prefill > 0.5 s
        (slo(ttft=0.5), 2, 0.0, Fit(False, "prefill", unreachable=True)),
        (slo(), 1, 100.0, Fit(True)),  # no target: the default budget (2 s), and no clock on it
        (slo(), 2, 0.0, Fit(False, "prefill")),  # 3 s > the 2 s budget
    ],
)
def test_the_prefill_stage(req: SchedulingRequest, p_busy: int, waited: float, expected: Fit) -> None:
    snap = snapshot(P, D, in_flight={"p": p_busy})
    assert fit(req, PAIR, snap, waited, CONFIG) == expected


@pytest.mark.parametrize(
    ("kv", "d_busy", "req", "expected"),
    [
        (0.5, 3, slo(), Fit(True)),
        (0.95, 3, slo(), Fit(False, "decode")),  # KV above the high mark
        (0.95, 0, slo(), Fit(True)),  # nothing of ours on it: the usage is not ours to wait for
        (0.5, 3, slo(tpot=0.05), Fit(True)),  # 10 ms x (4 + 3 + 1) / 4 = 20 ms
        (0.5, 3, slo(tpot=0.015), Fit(False, "decode")),
    ],
)
def test_the_decode_stage(kv: float, d_busy: int, req: SchedulingRequest, expected: Fit) -> None:
    d = dataclasses.replace(D, metrics=dataclasses.replace(D.metrics, kv_cache_usage=kv))
    snap = snapshot(P, d, in_flight={"d": d_busy})
    assert fit(req, PAIR, snap, 0.0, CONFIG) == expected


def test_prefill_binds_first_where_both_stages_are_saturated() -> None:
    d = dataclasses.replace(D, metrics=dataclasses.replace(D.metrics, kv_cache_usage=0.99))
    snap = snapshot(P, d, in_flight={"p": 5, "d": 5})
    assert fit(slo(), PAIR, snap, 0.0, CONFIG) == Fit(False, "prefill")


@pytest.mark.parametrize(
    ("p_busy", "waited", "expected"),
    [
        (1, 0.0, Fit(True)),  # 2 s predicted: half the 4 s target
        (2, 0.0, Fit(False, "prefill")),  # 3 s: past the engine's half, though within the target
        (1, 1.9, Fit(True)),  # the other half is for waiting here: 1.9 s + 2 s
        (1, 2.1, Fit(False, "prefill", unreachable=True)),  # 2.1 s + 2 s: late
    ],
)
def test_the_engine_takes_only_its_share_of_the_target(p_busy: int, waited: float, expected: Fit) -> None:
    config = dataclasses.replace(CONFIG, engine_share=0.5)
    snap = snapshot(P, D, in_flight={"p": p_busy})
    assert fit(slo(ttft=4.0), PAIR, snap, waited, config) == expected


def test_the_margin_predictions_fell_short_by_counts_against_a_request_that_waited() -> None:
    config = dataclasses.replace(CONFIG, engine_share=0.5)
    snap = snapshot(P, D, in_flight={"p": 1})  # 2 s predicted against a 4 s target
    assert fit(slo(ttft=4.0), PAIR, snap, 1.5, config, slack_s=0.4) == Fit(True)
    assert fit(slo(ttft=4.0), PAIR, snap, 1.5, config, slack_s=0.6) == Fit(False, "prefill", True)
    # Never more than the gateway's half of the target: a request just come to a pair with room is
    # admitted, however late first tokens have been coming.
    assert fit(slo(ttft=4.0), PAIR, snap, 0.0, config, slack_s=9.0) == Fit(True)
    assert fit(slo(ttft=4.0), PAIR, snap, 0.0, config, slack_s=9.0).predicted_s == 2.0


def test_a_prefill_instance_s_backlog_is_counted_once() -> None:
    # 2 legs of ours in flight, which are the engine's 1 waiting and 1 running request, and the
    # 1.5 s they waited: the backlog is 2 x 1,000 tokens, and the prediction 3 s with its own.
    p = dataclasses.replace(P, metrics=dataclasses.replace(P.metrics, num_waiting=1, queue_s=1.5))
    assert fit(slo(ttft=3.0), PAIR, snapshot(p, D, in_flight={"p": 2}), 0.0, CONFIG) == Fit(True)
    assert fit(slo(ttft=2.9), PAIR, snapshot(p, D, in_flight={"p": 2}), 0.0, CONFIG).stage == "prefill"
    # Another gateway's requests waiting there count where they are more than ours.
    p = dataclasses.replace(P, metrics=dataclasses.replace(P.metrics, num_waiting=3))
    assert not fit(slo(ttft=3.5), PAIR, snapshot(p, D, in_flight={"p": 1}), 0.0, CONFIG).ok


def test_a_colocated_pair_is_judged_on_its_one_instance_for_both_stages() -> None:
    both = view("b", metrics=dataclasses.replace(P.metrics, kv_cache_usage=0.99))
    snap = snapshot(both, in_flight={"b": 1})
    colocated = Decision("colocated", None, "b")
    assert fit(slo(prompt=100), colocated, snap, 0.0, CONFIG) == Fit(False, "decode")


def test_a_pair_gone_from_the_snapshot_is_left_to_the_flow() -> None:
    assert fit(slo(ttft=0.001), PAIR, snapshot(D), 9.0, CONFIG) == Fit(True)


@pytest.mark.parametrize(("fill", "ok"), [(1.0, True), (0.5, False)])
def test_a_tenant_s_fill_scales_the_depth_its_request_may_find(fill: float, ok: bool) -> None:
    """2 s predicted against a 3 s target: room at the full depth, none at half of it (a tenant over
    its share: ``Ticket.fill``)."""
    snap = snapshot(P, D, in_flight={"p": 1})
    assert fit(slo(ttft=3.0), PAIR, snap, 0.0, CONFIG, fill=fill).ok is ok
