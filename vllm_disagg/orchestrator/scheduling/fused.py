"""A profile's weighted totals: one pass over the candidates for all its scorers where each has a term.

Each scorer's ``score`` is a column, so a profile of four scorers walks its candidates five times (the
weighted sum included) and reads a candidate's metrics, in-flight count and cached tokens once per
scorer. When every weighted scorer has a ``term`` (``framework.TermScorer``), ``fused_totals`` reads
each candidate once and calls the terms on what it read, giving the weighted totals directly; the
columns are computed only when an explanation is rendered. Both call the same terms, so the totals
are bit for bit what ``weighted_sum`` gives of the columns
(tests/unit/orchestrator/scheduling/test_fused.py).

The pass is one of a few plain functions, chosen by the number of terms when the weights are set (a
loop over the terms inside the loop over the candidates costs a fifth more). Each term is a Python
call per candidate: what the generated code this replaced saved by pasting every scorer's formula
into one loop, at the price of a second copy of each (docs/benchmarks.md, "One definition of each
formula", has what the calls cost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_disagg.orchestrator.scheduling.framework import ProfileContext, Scorer, Term
from vllm_disagg.orchestrator.scheduling.plugins.scorers.kv_usage import KvUsageScorer
from vllm_disagg.orchestrator.scheduling.plugins.scorers.prefix import PrefixScorer
from vllm_disagg.orchestrator.scheduling.plugins.scorers.queue import QueueScorer
from vllm_disagg.orchestrator.scheduling.plugins.scorers.tpot import TpotScorer
from vllm_disagg.orchestrator.scheduling.plugins.scorers.ttft import TtftScorer
from vllm_disagg.orchestrator.scheduling.predict import TtftParts, tpot_s, ttft_of, ttft_parts
from vllm_disagg.orchestrator.scheduling.terms import reads
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import MetricsSnapshot

Totals = Callable[[ProfileContext, Sequence[InstanceView]], list[float]]
Combine = Callable[[Sequence[Sequence[float]], int], list[float]]
# (agent id, metrics, in-flight count) -> the most a candidate holding no prefix can total
Bound = Callable[[str, MetricsSnapshot, int], float]

# Instances a shipped pass keeps before it starts over (departed ones linger until then).
_MEMO_LIMIT = 1 << 16
_NO_PARTS: TtftParts = (0.0, 0, None, 1.0)  # the decode profile's entries: no TTFT prediction
_MISS = (None, -1, 0.0, _NO_PARTS)  # what a pass finds for an instance it has not kept


def fused_totals(scorers: Sequence[tuple[Scorer, float]]) -> Totals | None:
    """A function of (ctx, candidates) giving each candidate's weighted total in one pass; None unless
    every scorer with a weight has a ``term``. Terms are added as ``weighted_sum`` adds columns: from
    0.0, in the scorers' order, weight 0 dropped (``1.0 * x`` is ``x`` exactly, so weight 1 is no
    exception)."""
    return fused_pass(scorers)[0]


def fused_pass(scorers: Sequence[tuple[Scorer, float]]) -> tuple[Totals | None, Bound | None]:
    """``fused_totals``, and for the shipped profiles' scorers a ``Bound`` of a candidate's total over
    every prompt it holds no prefix of (``ranking.py``), sharing what the pass keeps; else None."""
    weighted = [(scorer, weight) for scorer, weight in scorers if weight]
    if not weighted:
        return None, None  # no weighted scorer: the generic path's zeros are as cheap
    shipped = _shipped(weighted)
    if shipped is not None:
        return shipped
    terms: list[tuple[Term, float]] = []
    for scorer, weight in weighted:
        make = getattr(scorer, "term", None)
        if make is None:
            return None, None
        terms.append((make(), weight))
    if len(terms) > len(_SHAPES):
        return _any(terms), None
    return _SHAPES[len(terms) - 1](*terms), None


def _shipped(weighted: Sequence[tuple[Scorer, float]]) -> tuple[Totals, Bound] | None:
    """The pass of the shipped profiles (default.yaml): queue-, kv-usage-, ttft- or tpot-, and
    prefix-scorer, each weighted, in that order; None for any other profile.

    A term is a call per candidate, a fifth of a decision at 16 candidates a profile: here the three
    scores that read only the candidate are written out a second time, inline, and the prediction is
    the one formula's (``predict.tpot_s``, ``ttft_of``), called; what reads only the candidate is kept
    between decisions (below). tests/unit/orchestrator/scheduling/test_fused.py checks, for any
    parameters, weights and metrics, that the totals are bit for bit what the terms give.
    """
    if len(weighted) != 4:
        return None
    (queue_scorer, wq), (kv_scorer, wkv), (predicting, wp), (prefix_scorer, wx) = weighted
    if not (
        type(queue_scorer) is QueueScorer
        and type(kv_scorer) is KvUsageScorer
        and type(prefix_scorer) is PrefixScorer
    ):
        return None
    if type(predicting) is TtftScorer:
        whole, slo, default = False, predicting.params.slo_s, predicting.params.default_prefill_tokens_per_s
    elif type(predicting) is TpotScorer:
        whole, slo, default = True, predicting.params.slo_s, predicting.params.default_tpot_s
    else:
        return None
    return _shipped_pass(whole, (wq, wkv, wp, wx), queue_scorer.params.max_queue, slo, default)


# _KEPT: what depends on the candidate alone (its metrics and in-flight count) is kept per instance,
# with the metrics object and the count it was computed from: an instance's metrics last until its next
# heartbeat, and most decisions between two heartbeats score it with the same count. (Keyed by the
# agent id, whose hash the string keeps, rather than by (id(metrics), count): building and hashing that
# tuple cost more than the check.) The TPOT prediction does not read the prompt, so the decode profile
# keeps its whole total but the prefix term; the prefill profile keeps the queue and KV terms and what
# the TTFT prediction reads of the instance (``ttft_parts``). The sums run in the order of the terms',
# ((0.0 + queue + kv) + prediction) + prefix, so the totals are the same bits.
def _shipped_pass(
    whole: bool, weights: tuple[float, float, float, float], max_queue: float, slo: float, default: float
) -> tuple[Totals, Bound]:
    """``_shipped``'s pass: the TPOT prediction where ``whole``, else the TTFT one; and its bound.
    What it keeps between decisions: see ``_KEPT`` above."""
    wq, wkv, wp, wx = weights
    memo: dict[str, tuple[MetricsSnapshot, int, float, TtftParts]] = {}

    def kept(a: str, m: MetricsSnapshot, f: int) -> tuple[MetricsSnapshot, int, float, TtftParts]:
        load = m.num_running + m.num_waiting + f
        u = m.kv_cache_usage
        total = (
            0.0
            + wq * (0.0 if load >= max_queue else (1.0 - load / max_queue if load > 0 else 1.0))
            + wkv * (1.0 - u if 0.0 < u < 1.0 else (0.0 if u >= 1.0 else 1.0))
        )
        if whole:
            p = tpot_s(m, f, 0, 0, default)
            total += wp * (slo / (slo + p) if p >= 0.0 else 0.0)
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        entry = memo[a] = (m, f, total, _NO_PARTS if whole else ttft_parts(m, f, default))
        return entry

    def totals(ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
        n, inv, in_flight, cached = reads(ctx)
        out: list[float] = []
        append = out.append
        get = memo.get
        for c in candidates:
            m = c.metrics
            a = c.agent_id
            f = in_flight(a, 0)
            k = cached(a, 0)
            held, held_f, total, parts = get(a, _MISS)
            if held is not m or held_f != f:
                held, held_f, total, parts = kept(a, m, f)
            if not whole:
                p = ttft_of(parts, k, n)  # >= 0 (the registry's metrics are in range); else worst
                total += wp * (slo / (slo + p) if p >= 0.0 else 0.0)
            # The prefix term; where it is 0.0, adding it would leave the total (never -0.0) as it is.
            if k > 0 and n > 0:
                total += wx * (1.0 if k >= n else k * inv)
            append(total)
        return out

    def bound(a: str, m: MetricsSnapshot, f: int) -> float:
        # A total for a prompt of which the candidate holds nothing: its prefix term is 0 (not added,
        # as above), and the TTFT prediction is least for an empty prompt (it only grows with the
        # prompt, and the score only falls as it grows), so no prompt's total is above this one.
        held, held_f, total, parts = memo.get(a, _MISS)
        if held is not m or held_f != f:
            held, held_f, total, parts = kept(a, m, f)
        if not whole:
            p = ttft_of(parts, 0, 0)
            total += wp * (slo / (slo + p) if p >= 0.0 else 0.0)
        return total

    return totals, bound


# The shapes differ only in how many terms they add. Each reads a candidate's metrics, id, in-flight
# count and cached tokens once, in plain local assignments: in Python 3.11 that beats a comprehension
# binding them with ``for m in [c.metrics]`` (not optimized there) or with ``:=``.


def _one(t0: tuple[Term, float]) -> Totals:
    term0, w0 = t0

    def totals(ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
        n, inv, in_flight, cached = reads(ctx)
        out: list[float] = []
        append = out.append
        for c in candidates:
            m = c.metrics
            a = c.agent_id
            f = in_flight(a, 0)
            k = cached(a, 0)
            append(0.0 + w0 * term0(m, f, k, n, inv))
        return out

    return totals


def _two(t0: tuple[Term, float], t1: tuple[Term, float]) -> Totals:
    (term0, w0), (term1, w1) = t0, t1

    def totals(ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
        n, inv, in_flight, cached = reads(ctx)
        out: list[float] = []
        append = out.append
        for c in candidates:
            m = c.metrics
            a = c.agent_id
            f = in_flight(a, 0)
            k = cached(a, 0)
            append(0.0 + w0 * term0(m, f, k, n, inv) + w1 * term1(m, f, k, n, inv))
        return out

    return totals


def _three(t0: tuple[Term, float], t1: tuple[Term, float], t2: tuple[Term, float]) -> Totals:
    (term0, w0), (term1, w1), (term2, w2) = t0, t1, t2

    def totals(ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
        n, inv, in_flight, cached = reads(ctx)
        out: list[float] = []
        append = out.append
        for c in candidates:
            m = c.metrics
            a = c.agent_id
            f = in_flight(a, 0)
            k = cached(a, 0)
            append(
                0.0 + w0 * term0(m, f, k, n, inv) + w1 * term1(m, f, k, n, inv) + w2 * term2(m, f, k, n, inv)
            )
        return out

    return totals


def _four(
    t0: tuple[Term, float], t1: tuple[Term, float], t2: tuple[Term, float], t3: tuple[Term, float]
) -> Totals:
    (term0, w0), (term1, w1), (term2, w2), (term3, w3) = t0, t1, t2, t3

    def totals(ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
        n, inv, in_flight, cached = reads(ctx)
        out: list[float] = []
        append = out.append
        for c in candidates:
            m = c.metrics
            a = c.agent_id
            f = in_flight(a, 0)
            k = cached(a, 0)
            append(
                0.0
                + w0 * term0(m, f, k, n, inv)
                + w1 * term1(m, f, k, n, inv)
                + w2 * term2(m, f, k, n, inv)
                + w3 * term3(m, f, k, n, inv)
            )
        return out

    return totals


def _five(
    t0: tuple[Term, float],
    t1: tuple[Term, float],
    t2: tuple[Term, float],
    t3: tuple[Term, float],
    t4: tuple[Term, float],
) -> Totals:
    (term0, w0), (term1, w1), (term2, w2), (term3, w3), (term4, w4) = t0, t1, t2, t3, t4

    def totals(ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
        n, inv, in_flight, cached = reads(ctx)
        out: list[float] = []
        append = out.append
        for c in candidates:
            m = c.metrics
            a = c.agent_id
            f = in_flight(a, 0)
            k = cached(a, 0)
            append(
                0.0
                + w0 * term0(m, f, k, n, inv)
                + w1 * term1(m, f, k, n, inv)
                + w2 * term2(m, f, k, n, inv)
                + w3 * term3(m, f, k, n, inv)
                + w4 * term4(m, f, k, n, inv)
            )
        return out

    return totals


_SHAPES: tuple[Callable[..., Totals], ...] = (_one, _two, _three, _four, _five)


def _any(terms: Sequence[tuple[Term, float]]) -> Totals:
    """More terms than the shapes take (one of each shipped scorer is five): a loop over them."""
    pairs = tuple(terms)

    def totals(ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
        n, inv, in_flight, cached = reads(ctx)
        out: list[float] = []
        for c in candidates:
            m = c.metrics
            a = c.agent_id
            f = in_flight(a, 0)
            k = cached(a, 0)
            total = 0.0
            for term, weight in pairs:
                total += weight * term(m, f, k, n, inv)
            out.append(total)
        return out

    return totals


def weighted_sum(weights: Sequence[float]) -> Combine:
    """A function of (score columns, n) giving each candidate's total, ``sum(weight * score)`` in the
    scorers' order, from 0.0 and one column at a time; a column of weight 0 is not read. The path of
    profiles with a scorer that has no term (no shipped scorer), and so bit-identical to
    ``fused_totals`` where both apply."""
    used = tuple((i, w) for i, w in enumerate(weights) if w)

    def combine(scores: Sequence[Sequence[float]], n: int) -> list[float]:
        totals = [0.0] * n
        for i, weight in used:
            totals = [total + weight * score for total, score in zip(totals, scores[i], strict=True)]
        return totals

    return combine
