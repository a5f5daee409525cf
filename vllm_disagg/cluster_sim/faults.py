"""Slow links: a KV link, or every link through one instance, node or rack, slowed down for a while
(``--fault slow-link:TARGET@AT[+FOR][xFACTOR]``; docs/sim.md, "Topology").

A target is one of:

- an instance (``prefill-1``): transfers from or to it;
- a link (``prefill-1->decode-3``): transfers from that P to that D only;
- with ``--topology``, a node (``r0n3``) or a rack (``r2``): its uplink, so transfers that leave or
  enter it (a node's NVLink stays fast; a rack's own nodes still reach each other at full rate).

A transfer takes the largest factor of the targets on its way.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from vllm_disagg.cluster_sim.topology import Location

LINK = "->"


class SlowLinks:
    """The slow-link faults in force, by target, and a transfer's slowdown."""

    __slots__ = ("_factors", "_where")

    def __init__(self, where: Mapping[str, Location]) -> None:
        self._where = where  # instance -> its GPU (empty without a topology)
        self._factors: dict[str, float] = {}

    def slow(self, target: str, factor: float) -> None:
        """Transfers on ``target``'s way take ``factor`` times as long from now."""
        self._factors[target] = factor

    def restore(self, target: str) -> None:
        """``target`` is at its full rate again."""
        self._factors.pop(target, None)

    def factor(self, p: str, d: str) -> float:
        """How many times as long a transfer from ``p`` to ``d`` takes now (1: none slowed)."""
        slow = self._factors
        if not slow:
            return 1.0
        on_way = [p, d, f"{p}{LINK}{d}"]
        lp, ld = self._where.get(p), self._where.get(d)
        if lp is not None and ld is not None:
            if lp.node != ld.node:
                on_way += (lp.node, ld.node)
            if lp.rack != ld.rack:
                on_way += (lp.rack, ld.rack)
        return max(slow.get(t, 1.0) for t in on_way)


def target_problem(target: str, instances: Collection[str], where: Mapping[str, Location]) -> str | None:
    """Why a slow-link fault cannot name ``target`` in this cluster, or None where it can."""
    if target in instances:
        return None
    if LINK in target:
        p, _, d = target.partition(LINK)
        if p in instances and d in instances and p != d:
            return None
        return f"no link {target!r}: name two instances, P->D"
    places = {loc.node for loc in where.values()} | {loc.rack for loc in where.values()}
    if target in places:
        return None
    hint = ", or a node or rack of --topology (r0n3, r2)" if where else " (racks and nodes need --topology)"
    return f"no instance, link or place {target!r}: an instance, P->D{hint}"
