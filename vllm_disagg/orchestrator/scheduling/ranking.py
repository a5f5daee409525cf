"""Instances ranked by a bound on their total that no prompt can exceed: the flat pick from a few.

A profile's total for a candidate is what reads only the candidate (its metrics and the gateway's
in-flight count, which last between heartbeats) plus what reads the prompt: the prefix term and, in
the prefill profile, the TTFT prediction of the uncached tokens. For a candidate that holds no prefix
of the prompt the total is at most its *bound*: the decode profile's total exactly (TPOT does not
read the prompt), the prefill profile's total for an empty prompt (the prediction only grows with
the prompt). So once the prefix holders are scored, walking the others from the highest bound down,
scoring each, until the next bound is below the best total found, finds the same best as scoring
every instance (the threshold algorithm), having scored a handful.

``Ranking`` keeps the order as instances change (a bisection per change); ``walk`` is the walk.
Both are pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator


class Ranking:
    """Agent ids in order of their bound, highest first (ties by agent id)."""

    __slots__ = ("_keys", "_order")

    def __init__(self) -> None:
        self._keys: dict[str, tuple[float, str]] = {}
        self._order: list[tuple[float, str]] = []  # (-bound, agent id), ascending

    @staticmethod
    def of(bounds: Iterable[tuple[str, float]]) -> Ranking:
        """A ranking of these (agent id, bound) pairs, sorted once."""
        ranking = Ranking()
        keys = ranking._keys = {a: (-b if b == b else -math.inf, a) for a, b in bounds}
        ranking._order = sorted(keys.values())
        return ranking

    def set(self, agent_id: str, bound: float) -> None:
        """``agent_id``'s bound is now ``bound`` (NaN ranks first: such an instance is always scored)."""
        key = (-bound if bound == bound else -math.inf, agent_id)
        old = self._keys.get(agent_id)
        if old == key:
            return
        if old is not None:
            del self._order[bisect_left(self._order, old)]
        insort(self._order, key)
        self._keys[agent_id] = key

    def discard(self, agent_id: str) -> None:
        """``agent_id`` is ranked no more (it left, or no longer qualifies)."""
        old = self._keys.pop(agent_id, None)
        if old is not None:
            del self._order[bisect_left(self._order, old)]

    def bound(self, agent_id: str) -> float | None:
        """``agent_id``'s bound, None when it is not ranked."""
        key = self._keys.get(agent_id)
        return None if key is None else -key[0]

    def __len__(self) -> int:
        return len(self._order)

    def best_first(self) -> Iterator[tuple[float, str]]:
        """(bound, agent id), the highest bound first."""
        for negated, agent_id in self._order:
            yield -negated, agent_id


def walk(
    ranking: Ranking,
    scored: Iterable[float],
    width: int,
    score: Callable[[str], float | None],
) -> list[str]:
    """The ranked instances whose totals may be among the ``width`` best, beyond those already scored.

    ``scored`` are the totals already known (the prefix holders'); ``score`` gives an instance's
    total, or None where it is not a candidate (a filter leaves it out, or it was scored already).
    The walk stops at the first bound below the ``width``-th best total found, so every instance
    whose total equals or beats it is returned (ties included: a picker breaks them).
    """
    best = sorted(scored)[-width:]  # the ``width`` best totals so far, a min-heap (ascending is one)
    found: list[str] = []
    for negated, agent_id in ranking._order:  # not ``best_first``: no generator per walk
        if len(best) >= width and -negated < best[0]:
            break
        got = score(agent_id)
        if got is None:
            continue
        found.append(agent_id)
        _keep(best, got, width)
    return found


def _keep(best: list[float], total: float, width: int) -> None:
    if len(best) < width:
        heapq.heappush(best, total)
    elif total > best[0]:
        heapq.heapreplace(best, total)
