"""A profile's ranked path: the flat scheduler's pick from the prefix holders and a short walk.

Where a profile's scorers are the shipped ones (whose ``fused.Bound`` is known), its picker takes the
best total, and every filter that applies to the request judges each candidate alone
(``PER_CANDIDATE``), the profile scores the prefix holders, then walks its ranking of the other
eligible instances (``ranking.py``) until no one left can reach the best totals: the candidates the
flat scheduler (every instance scored) would rank among the best are all scored, so its pick is the
flat one, from a handful of candidates instead of 16 sampled ones
(docs/scheduler.md, "Scale: ranked").

``Rankings`` keeps one ranking per model, following the snapshots through their change marks
(``state/changes.py``): a decision updates the instances whose view or in-flight count changed since
the last one, and a membership change those who left or joined; a log that no longer reaches back
(or another registry's snapshot) builds it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_disagg.orchestrator.scheduling.explain import Stage
from vllm_disagg.orchestrator.scheduling.framework import Filter, ProfileContext, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.fused import Bound, Totals
from vllm_disagg.orchestrator.scheduling.ranking import Ranking, walk
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

# Per-request filters and their ``applies`` (None: always).
Applying = Sequence[tuple[Filter, Callable[[SchedulingRequest], bool] | None]]
# A profile's per-request filters, their ``applies`` and ``PER_CANDIDATE``.
Walkable = Sequence[tuple[Filter, Callable[[SchedulingRequest], bool] | None, bool]]
# (the ranking, the registry it follows, the change sequence it is at, the instances it ranks)
_State = tuple[Ranking, int, int, frozenset[str]]


class Rankings:
    """One profile's rankings of its eligible instances, one per model."""

    __slots__ = ("_bound", "_of")

    def __init__(self, bound: Bound) -> None:
        self._bound = bound
        self._of: dict[str, _State] = {}

    def follow(
        self, snapshot: RegistrySnapshot, model: str, eligible: Sequence[str], members: frozenset[str]
    ) -> Ranking | None:
        """``model``'s ranking of ``eligible`` (``members``, as a set) as of ``snapshot``; None for a
        snapshot without a change mark, or one older than the last the ranking followed (the profile
        then samples)."""
        mark = snapshot.changes
        if mark is None:
            return None
        bound, by_id, flying = self._bound, snapshot.by_id, snapshot.in_flight
        state = self._of.get(model)
        if state is not None and state[1] == snapshot.registry_id:
            ranking, _, seq, ids = state
            changed = mark.since(seq)
            if changed is None and mark.end < seq:
                return None
            if changed is not None:
                if ids is not members:  # membership moved: a bound reads no membership field, so
                    for a in ids - members:  # only those who left or joined change the ranking
                        ranking.discard(a)
                    for a in members - ids:
                        ranking.set(a, bound(a, by_id[a].metrics, flying.get(a, 0)))
                for a in changed:
                    if a in members:
                        ranking.set(a, bound(a, by_id[a].metrics, flying.get(a, 0)))
                self._of[model] = (ranking, snapshot.registry_id, mark.end, members)
                return ranking
        ranking = Ranking.of((a, bound(a, by_id[a].metrics, flying.get(a, 0))) for a in eligible)
        self._of[model] = (ranking, snapshot.registry_id, mark.end, members)
        return ranking


def applying(request: SchedulingRequest, filters: Walkable) -> list[tuple[Filter, None]] | None:
    """The per-request filters that apply to ``request`` (each with None for ``applies``: no need to
    ask again); None where one of them judges the candidates together (``PER_CANDIDATE`` false): the
    ranked path cannot walk then."""
    kept: list[tuple[Filter, None]] = []
    for f, applies, alone in filters:
        if applies is None or applies(request):
            if not alone:
                return None
            kept.append((f, None))
    return kept


def candidates(
    ctx: ProfileContext,
    ranking: Ranking,
    ids: frozenset[str],
    filters: Applying,
    fused: Totals,
    width: int,
    run_filters: Callable[
        [ProfileContext, Sequence[InstanceView], Applying],
        tuple[Sequence[InstanceView], tuple[Stage, ...]],
    ],
) -> tuple[list[InstanceView], tuple[Stage, ...], list[float]]:
    """The candidates to pick from (the holders ``filters`` keep, then the walked instances they
    keep), the holders' filter stages, and the candidates' totals. ``ids``: the eligible instances
    this request may use; ``width``: how many of the best totals must be found (the pairing's)."""
    by_id = ctx.snapshot.by_id
    cached = ctx.request.cached_tokens
    holders, stages = run_filters(ctx, [by_id[i] for i in cached if i in ids], filters)
    found, totals = list(holders), fused(ctx, holders) if holders else []

    def score(agent_id: str) -> float | None:
        if agent_id in cached or agent_id not in ids:
            return None  # a holder (scored above), or one this request may not use
        view = [by_id[agent_id]]
        for f, _ in filters:
            if not f.filter(ctx, view):
                return None
        total = fused(ctx, view)[0]
        found.append(view[0])
        totals.append(total)
        return total

    walk(ranking, list(totals), width, score)
    return found, stages, totals
