"""What a scorer's term reads, read once per request and candidate, and a term scorer's column.

A term (``framework.Term``) is a scorer's score of one candidate from the candidate's metrics, the
gateway's in-flight count on it and the prompt tokens its cache holds, and the request's prompt length
and its inverse. ``column`` is what every term scorer's ``score`` is; ``fused`` adds a profile's terms
in one pass from the same reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_disagg.orchestrator.scheduling.framework import ProfileContext, Term
from vllm_disagg.orchestrator.scheduling.predict import prompt_tokens
from vllm_disagg.orchestrator.state.views import InstanceView

# (prompt length, its inverse, in-flight lookup, cached-tokens lookup): lookups take (agent id, 0).
Reads = tuple[int, float, Callable[[str, int], int], Callable[[str, int], int]]


def reads(ctx: ProfileContext) -> Reads:
    """What every term reads of the request, and the lookups of what it reads of a candidate."""
    request = ctx.request
    n = prompt_tokens(request)
    return n, (1.0 / n if n > 0 else 0.0), ctx.snapshot.in_flight.get, request.cached_tokens.get


def column(term: Term, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> list[float]:
    """``term`` of each candidate: the ``score`` of a scorer that has a term."""
    n, inv, in_flight, cached = reads(ctx)
    return [term(c.metrics, in_flight(a := c.agent_id, 0), cached(a, 0), n, inv) for c in candidates]
