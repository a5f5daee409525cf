"""Per-request latency targets: the headers, the slo-filter, colocation to meet a TTFT target, and
attainment by a bounded class."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from tests.unit.scheduling_support import context, request, snapshot, view
from vllm_disagg.errors import BadRequest
from vllm_disagg.orchestrator.gateway.slo import attainment, best_effort, request_slo, slo_class
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.filters.slo import Params, SloFilter
from vllm_disagg.orchestrator.scheduling.plugins.scorers.ttft import Params as TtftParams
from vllm_disagg.orchestrator.scheduling.plugins.scorers.ttft import TtftScorer
from vllm_disagg.orchestrator.scheduling.predict import predicted_tpot, predicted_ttft, prefill_rate
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.registry import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

IDLE = MetricsSnapshot(prefill_tokens_per_s=10_000.0, tpot_s=0.01)
BUSY = MetricsSnapshot(prefill_tokens_per_s=10_000.0, queue_s=2.0, num_waiting=8, tpot_s=0.04, num_running=8)


def with_slo(
    ttft_s: float | None = None, tpot_s: float | None = None, prompt_len: int = 1000
) -> SchedulingRequest:
    return dataclasses.replace(request(prompt_len=prompt_len), slo_ttft_s=ttft_s, slo_tpot_s=tpot_s)


def decider_reason(decision: Decision) -> str:
    """The decider's reason in ``decision``'s explanation."""
    assert decision.explanation is not None
    decider = decision.explanation.to_json()["decider"]
    assert isinstance(decider, dict)
    reason = decider["reason"]
    assert isinstance(reason, str)
    return reason


@pytest.mark.parametrize(
    ("headers", "defaults", "expected"),
    [
        ({}, (None, None), (None, None)),
        ({"x-slo-ttft-ms": "250"}, (None, None), (0.25, None)),
        ({"x-slo-tpot-ms": "40.5"}, (1000.0, None), (1.0, 0.0405)),
        ({"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "20"}, (1000.0, 50.0), (0.1, 0.02)),
    ],
    ids=["none", "ttft", "tpot and a default ttft", "headers over defaults"],
)
def test_targets_come_from_the_headers_else_the_defaults(
    headers: dict[str, str],
    defaults: tuple[float | None, float | None],
    expected: tuple[float | None, float | None],
) -> None:
    assert request_slo(headers, *defaults) == expected


@pytest.mark.parametrize("raw", ["fast", "0", "-5", "nan", "inf", "1e12"])
def test_a_bad_target_is_a_400_naming_the_header(raw: str) -> None:
    with pytest.raises(BadRequest, match="x-slo-ttft-ms header must be milliseconds > 0") as caught:
        request_slo({"x-slo-ttft-ms": raw}, None, None)
    assert caught.value.param == "x-slo-ttft-ms"


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "label"),
    [
        (0.3, None, "ttft<=500ms"),
        (0.5, 0.05, "ttft<=500ms,tpot<=50ms"),
        (None, 0.001, "tpot<=10ms"),
        (60.0, 2.0, "ttft>10000ms,tpot>500ms"),
        (None, None, ""),
    ],
)
def test_the_class_label_is_bounded_whatever_clients_send(
    ttft_s: float | None, tpot_s: float | None, label: str
) -> None:
    assert slo_class(ttft_s, tpot_s) == label


@pytest.mark.parametrize(
    ("status", "ttft", "tpot", "outcome"),
    [
        (200, 0.2, 0.01, "met"),
        (200, 0.6, 0.01, "missed"),
        (200, 0.2, 0.03, "missed"),
        (200, 0.2, None, "met"),  # a whole answer: its TPOT is not seen, its TTFT is judged
        (200, None, None, "unmeasured"),
        (502, 0.1, 0.01, "failed"),
    ],
)
def test_attainment(status: int, ttft: float | None, tpot: float | None, outcome: str) -> None:
    assert attainment(with_slo(0.5, 0.02), status, ttft, tpot) == outcome


def test_the_slo_filter_keeps_the_candidates_predicted_to_meet_the_target_else_all() -> None:
    fast, slow = view("fast", metrics=IDLE), view("slow", metrics=BUSY)
    snap = snapshot(fast, slow)
    plugin = SloFilter("slo", Params())

    def prefill(req: SchedulingRequest) -> Sequence[InstanceView]:
        return plugin.filter(context(snap, profile="prefill", req=req), [fast, slow])

    def decode(req: SchedulingRequest) -> Sequence[InstanceView]:
        return plugin.filter(context(snap, profile="decode", req=req), [fast, slow])

    assert [v.agent_id for v in prefill(with_slo(ttft_s=0.5))] == ["fast"]
    assert [v.agent_id for v in prefill(with_slo(ttft_s=0.01))] == ["fast", "slow"], "none can: best effort"
    assert [v.agent_id for v in prefill(with_slo(tpot_s=0.001))] == ["fast", "slow"], "TPOT is decode's"
    assert [v.agent_id for v in decode(with_slo(tpot_s=0.03))] == ["fast"]
    assert [v.agent_id for v in decode(with_slo())] == ["fast", "slow"]
    made = PLUGIN_SPECS["slo-filter"].factory("x", Params())
    assert isinstance(made, SloFilter) and made.PER_REQUEST is True


def test_the_predictions_are_the_scorers_models() -> None:
    idle, busy = view("a", metrics=IDLE), view("b", metrics=BUSY)
    req = with_slo(prompt_len=1000)
    assert predicted_ttft(idle, req, 0) == pytest.approx(0.1)  # 1,000 tokens at 10,000/s
    assert predicted_ttft(busy, req, 2) == pytest.approx(2.0 + (8 + 2) * 1000 / 10_000 + 0.1)
    assert predicted_tpot(busy, 0) == pytest.approx(0.04 * 9 / 8)


def test_a_short_prompt_behind_a_busy_prefill_pool_runs_colocated_to_meet_its_ttft() -> None:
    p, d = view("p", role="prefill", metrics=BUSY), view("d", role="decode", metrics=IDLE)
    snap = snapshot(p, d)
    scheduler = PluginScheduler()
    short = dataclasses.replace(with_slo(ttft_s=0.5, prompt_len=200), request_id="short")
    decision = scheduler.decide(short, snap, 0.0)
    assert (decision.mode, decision.prefill, decision.decode) == ("colocated", None, "d")
    reason = decider_reason(decision)
    assert reason.startswith("to meet its TTFT target of 0.5 s: 0.020 s predicted on d")
    no_target = dataclasses.replace(short, slo_ttft_s=None)
    assert scheduler.decide(no_target, snap, 0.0).mode == "disaggregated"
    # A prompt too long for D to meet the target either: disaggregated as usual (best effort).
    long = dataclasses.replace(with_slo(ttft_s=0.5, prompt_len=8000))
    decision = scheduler.decide(long, snap, 0.0)
    assert decision.mode == "disaggregated"
    assert best_effort(long, decision, snap)
    assert not best_effort(short, Decision("colocated", None, "d"), snap)


def test_the_slo_filter_runs_only_for_requests_with_targets() -> None:
    snap = snapshot(view("p", role="prefill", metrics=IDLE), view("d", role="decode", metrics=IDLE))
    scheduler = PluginScheduler()

    def stages(req: SchedulingRequest) -> list[str]:
        trace = scheduler.decide(req, snap, 0.0).explanation.decode  # type: ignore[union-attr]
        return [s.filter for s in trace.stages]

    assert "slo-filter" not in stages(with_slo())
    assert "slo-filter" in stages(with_slo(tpot_s=0.05))


@pytest.mark.parametrize(
    ("metrics", "rate"),
    [
        pytest.param(MetricsSnapshot(prefill_tokens_per_s=3000.0), 3000.0, id="measured"),
        pytest.param(MetricsSnapshot(), 4096.0, id="unmeasured-default"),
        pytest.param(MetricsSnapshot(prefill_tokens_per_s=0.0), 4096.0, id="zero-default"),
        pytest.param(
            MetricsSnapshot(
                prefill_tokens_per_s=150_000.0, prompt_tokens_computed=0, prompt_tokens_transferred=90_000
            ),
            4096.0,
            id="decode-instance-whose-prompts-came-over-kv-transfer-default",
        ),
        pytest.param(
            MetricsSnapshot(
                prefill_tokens_per_s=3000.0, prompt_tokens_computed=90_001, prompt_tokens_transferred=90_000
            ),
            3000.0,
            id="moved-to-prefill-and-computed-more-than-it-was-handed-measured",
        ),
    ],
)
def test_a_prefill_rate_is_trusted_only_where_the_engine_computed_its_prompts(
    metrics: MetricsSnapshot, rate: float
) -> None:
    assert prefill_rate(metrics, 4096.0) == rate
    # The ttft-scorer predicts with the same rate (score = slo / (slo + predicted)).
    scorer = TtftScorer("ttft", TtftParams(slo_s=1.0))
    one = view("x", metrics=metrics)
    score = scorer.score(context(snapshot(one), profile="prefill", req=with_slo(prompt_len=1000)), [one])[0]
    assert score == pytest.approx(1.0 / (1.0 + 1000 / rate))


# A decode instance that has only decoded: its measured "prefill rate" is the KV transfer's.
DECODING = MetricsSnapshot(
    prefill_tokens_per_s=150_000.0,
    tpot_s=0.02,
    num_running=20,
    prompt_tokens_computed=0,
    prompt_tokens_transferred=200_000,
)


@pytest.mark.parametrize(
    ("cached_on_d", "mode"),
    [
        pytest.param(1950, "colocated", id="D-caches-the-document-its-question-fits-a-step"),
        pytest.param(0, "disaggregated", id="D-would-compute-the-whole-document-stalling-its-batch"),
    ],
)
def test_with_a_tpot_target_a_busy_prefill_pool_hands_d_only_what_it_computes_within_that_target(
    cached_on_d: int, mode: str
) -> None:
    p, d = view("p", role="prefill", metrics=BUSY), view("d", role="decode", metrics=DECODING)
    snap = snapshot(p, d, in_flight={"d": 20})  # the 20 it decodes are no prefill backlog
    req = dataclasses.replace(
        with_slo(ttft_s=1.0, tpot_s=0.05, prompt_len=2000), cached_tokens={"d": cached_on_d}
    )
    decision = PluginScheduler().decide(req, snap, 0.0)
    assert decision.mode == mode
    if mode == "colocated":
        reason = decider_reason(decision)
        # 50 tokens at the default 4,096/s, not at the 150,000/s the decode legs "measured"
        assert "50 uncached tokens add 0.012 s to one of d's steps" in reason
