"""Each prediction is written once (``scheduling.predict``): the formulas are the ones docs/scheduler.md
states, and every scorer, filter and pass that predicts gives what they give, for any metrics."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import METRICS, POSITIVE, context, request, snapshot, view
from vllm_disagg.orchestrator.scheduling.framework import (
    PROFILE_NAMES,
    ProfileContext,
    ProfileName,
    Scorer,
)
from vllm_disagg.orchestrator.scheduling.fused import fused_totals
from vllm_disagg.orchestrator.scheduling.plugins.deciders import uncached_tokens
from vllm_disagg.orchestrator.scheduling.plugins.filters import slo
from vllm_disagg.orchestrator.scheduling.plugins.scorers import tpot, ttft
from vllm_disagg.orchestrator.scheduling.predict import (
    predicted_tpot,
    predicted_ttft,
    tpot_s,
    ttft_s,
    uncached,
)
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

# Broken scrapes too: a NaN rate or TPOT must not reach a score.
BROKEN = METRICS.map(
    lambda m: dataclasses.replace(m, prefill_tokens_per_s=math.nan) if m.num_running % 7 == 3 else m
)
LOADS = st.lists(st.tuples(BROKEN, st.integers(0, 40), st.integers(0, 3000)), min_size=1, max_size=8)
PROMPT = st.integers(-10, 2000)


def hexes(values: list[float]) -> list[str]:
    return [v.hex() for v in values]


def cluster(
    loads: list[tuple[MetricsSnapshot, int, int]], prompt_len: int, profile: ProfileName = "prefill"
) -> tuple[list[InstanceView], ProfileContext]:
    """Candidates with these metrics, in-flight counts and cached tokens, and a context over them."""
    candidates = [view(f"c{i}", metrics=m) for i, (m, _, _) in enumerate(loads)]
    in_flight = {f"c{i}": f for i, (_, f, _) in enumerate(loads) if f}
    cached = {f"c{i}": k for i, (_, _, k) in enumerate(loads) if k}
    req = request(prompt_len=prompt_len, cached=cached)
    return candidates, context(snapshot(*candidates, in_flight=in_flight), req=req, profile=profile)


# --- the formulas are the documented ones ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(BROKEN, st.integers(0, 40), st.integers(0, 3000), st.integers(0, 2000), POSITIVE)
def test_ttft_is_the_queue_then_the_backlog_and_the_uncached_prompt_at_the_trusted_rate(
    m: MetricsSnapshot, in_flight: int, cached: int, prompt_len: int, default: float
) -> None:
    # docs/scheduler.md, Predictions: each "else" where the reading is missing or zero (or NaN), and
    # the default rate where the engine was handed more prompt tokens over KV transfer than it computed.
    rate = m.prefill_tokens_per_s or 0.0
    handed = (m.prompt_tokens_transferred or 0) > (m.prompt_tokens_computed or 0)
    trusted = rate > 0 and not handed
    backlog = (m.num_waiting + in_flight) * (m.mean_prompt_tokens or prompt_len)
    uncached_tokens = max(0, prompt_len - cached)
    expected = (m.queue_s or 0.0) + (backlog + uncached_tokens) / (rate if trusted else default)
    assert ttft_s(m, in_flight, cached, prompt_len, default) == expected


@settings(max_examples=300, deadline=None)
@given(BROKEN, st.integers(0, 40), POSITIVE)
def test_tpot_is_the_measured_tpot_scaled_by_how_much_the_batch_grows(
    m: MetricsSnapshot, in_flight: int, default: float
) -> None:
    expected = (m.tpot_s or default) * (m.num_running + in_flight + 1) / max(1, m.num_running)
    assert tpot_s(m, in_flight, 0, 0, default) == expected


# --- every user gives what the formulas give ---------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(LOADS, PROMPT, POSITIVE, POSITIVE)
def test_the_ttft_scorer_scores_the_predicted_ttft_in_its_column_and_in_the_fused_pass(
    loads: list[tuple[MetricsSnapshot, int, int]], prompt_len: int, slo_s: float, default: float
) -> None:
    candidates, ctx = cluster(loads, prompt_len)
    scorer = ttft.TtftScorer("ttft", ttft.Params(slo_s=slo_s, default_prefill_tokens_per_s=default))
    in_flight = ctx.snapshot.in_flight
    expected = [
        slo_s / (slo_s + predicted_ttft(c, ctx.request, in_flight.get(c.agent_id, 0), default))
        for c in candidates
    ]
    assert hexes(list(scorer.score(ctx, candidates))) == hexes(expected)
    fused = fused_totals([(scorer, 1.0)])
    assert fused is not None and hexes(fused(ctx, candidates)) == hexes(expected)


@settings(max_examples=300, deadline=None)
@given(LOADS, PROMPT, POSITIVE, POSITIVE)
def test_the_tpot_scorer_scores_the_predicted_tpot_in_its_column_and_in_the_fused_pass(
    loads: list[tuple[MetricsSnapshot, int, int]], prompt_len: int, slo_s: float, default: float
) -> None:
    candidates, ctx = cluster(loads, prompt_len, "decode")
    scorer = tpot.TpotScorer("tpot", tpot.Params(slo_s=slo_s, default_tpot_s=default))
    in_flight = ctx.snapshot.in_flight
    expected = [
        slo_s / (slo_s + predicted_tpot(c, in_flight.get(c.agent_id, 0), default)) for c in candidates
    ]
    assert hexes(list(scorer.score(ctx, candidates))) == hexes(expected)
    fused = fused_totals([(scorer, 1.0)])
    assert fused is not None and hexes(fused(ctx, candidates)) == hexes(expected)


@settings(max_examples=300, deadline=None)
@given(LOADS, PROMPT, POSITIVE, POSITIVE, st.floats(0.0, 10.0), st.floats(0.0, 10.0))
def test_a_profile_of_both_predicting_scorers_adds_their_weighted_predictions(
    loads: list[tuple[MetricsSnapshot, int, int]],
    prompt_len: int,
    ttft_slo: float,
    tpot_slo: float,
    w_ttft: float,
    w_tpot: float,
) -> None:
    candidates, ctx = cluster(loads, prompt_len)
    scorers: list[tuple[Scorer, float]] = [
        (ttft.TtftScorer("ttft", ttft.Params(slo_s=ttft_slo)), w_ttft),
        (tpot.TpotScorer("tpot", tpot.Params(slo_s=tpot_slo)), w_tpot),
    ]
    fused = fused_totals(scorers)
    if fused is None:
        assert not (w_ttft or w_tpot)
        return
    got = fused(ctx, candidates)
    for c, total in zip(candidates, got, strict=True):
        f = ctx.snapshot.in_flight.get(c.agent_id, 0)
        expected = 0.0
        if w_ttft:
            expected += w_ttft * (ttft_slo / (ttft_slo + predicted_ttft(c, ctx.request, f)))
        if w_tpot:
            expected += w_tpot * (tpot_slo / (tpot_slo + predicted_tpot(c, f)))
        assert total.hex() == expected.hex()


@settings(max_examples=300, deadline=None)
@given(LOADS, PROMPT, POSITIVE, st.sampled_from(PROFILE_NAMES))
def test_the_slo_filter_keeps_those_predicted_to_meet_the_target_else_everyone(
    loads: list[tuple[MetricsSnapshot, int, int]], prompt_len: int, target: float, profile: ProfileName
) -> None:
    candidates, ctx = cluster(loads, prompt_len, profile)
    target_s = target / 100  # around the predictions' scale, so both outcomes occur
    req = dataclasses.replace(ctx.request, slo_ttft_s=target_s, slo_tpot_s=target_s)
    ctx = dataclasses.replace(ctx, request=req)
    in_flight = ctx.snapshot.in_flight
    if profile == "prefill":
        meets = [c for c in candidates if predicted_ttft(c, req, in_flight.get(c.agent_id, 0)) <= target_s]
    else:
        meets = [c for c in candidates if predicted_tpot(c, in_flight.get(c.agent_id, 0)) <= target_s]
    kept = slo.SloFilter("slo", slo.Params()).filter(ctx, candidates)
    assert list(kept) == (meets or candidates)


@settings(max_examples=200, deadline=None)
@given(LOADS, PROMPT, st.integers(0, 2000))
def test_the_decider_counts_the_uncached_tokens_the_ttft_formula_prefills(
    loads: list[tuple[MetricsSnapshot, int, int]], prompt_len: int, threshold: int
) -> None:
    candidates, ctx = cluster(loads, prompt_len)
    decider = uncached_tokens.UncachedTokensDecider("split", uncached_tokens.Params(threshold=threshold))
    for c in candidates:
        left = uncached(max(0, prompt_len), ctx.request.cached_tokens.get(c.agent_id, 0))
        choice = decider.choose(ctx, c, True)
        assert choice.mode == ("colocated" if left < threshold else "disaggregated")
        assert f"{left} uncached prompt tokens" in choice.reason
