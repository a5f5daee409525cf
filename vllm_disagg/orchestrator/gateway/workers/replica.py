"""A gateway worker's registry: the orchestrator's instances as last told, its own exact in-flight counts.

The gateway asks it what it asks the ``Registry`` (``GatewayRegistry``). Reads come from the last
``State``; what changes state is forwarded (``forward``) to the orchestrator, which owns breakers and
the KV audit, and comes back in a later ``State`` like any other change.

In-flight counts: the worker's own are exact (``acquire``/``release``, and ``hold``/``unhold`` for
decisions, here); the other processes' arrive with each ``State`` (they push theirs every few
milliseconds), so a decision sees the others' load a few milliseconds late. At the loads where
balance matters (hundreds of requests in flight) that lag is a small share of each count; the scorers
read counts through a smooth score, so a few requests of lag move a total by little.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from vllm_disagg.orchestrator.gateway.workers.messages import Call, State
from vllm_disagg.orchestrator.state.registry import InstanceView, SnapshotSource, sum_counts

# Audit keys a worker chooses: above any the orchestrator's own counter reaches, apart per worker.
_KEY_SPACE = 1 << 48


class RegistryReplica(SnapshotSource):
    """The ``GatewayRegistry`` of a gateway worker."""

    def __init__(self, index: int, forward: Callable[[Call], None]) -> None:
        super().__init__()
        self.index = index
        self._forward = forward
        self._audited: frozenset[str] = frozenset()
        self._sent: dict[str, int] = {}  # since the last ``take_counts``
        self._probing: set[str] = set()  # instances this worker sent a half-open breaker's probe
        self._keys = itertools.count(_KEY_SPACE * (index + 1))
        self.counts_changed = False
        self._seq = -1  # the last State taken; -1 while waiting for a whole one

    def in_order(self, state: State) -> str:
        """``apply`` the state; ``gap``: one was lost (ask for the whole state, once), and later deltas
        are ``skip``ped until the whole state comes."""
        if state.full or (self._seq >= 0 and state.seq == self._seq + 1):
            self._seq = state.seq
            return "apply"
        if self._seq < 0:
            return "skip"
        self._seq = -1
        return "gap"

    def apply(self, state: State) -> list[InstanceView]:
        """Take the orchestrator's news; the views of instances that joined or came back."""
        scraped: list[str] = []  # instances whose metrics come from a new scrape
        if state.full:
            self._views, self._views_shared = dict(state.views), False
            self._changes.restart()
            joined = list(state.views.values())
        else:
            joined = []
            if state.views or state.removed:
                views = self._own_views()
                for agent_id, view in state.views.items():
                    old = views.get(agent_id)
                    if old is None or old.session != view.session:
                        joined.append(view)
                    elif old.metrics.scraped_at != view.metrics.scraped_at:
                        scraped.append(agent_id)
                    views[agent_id] = view
                self._changes.note_all(state.views)
                for agent_id in state.removed:
                    views.pop(agent_id, None)
        if state.membership != self._membership or state.full:
            self._groups = None
        if (
            state.full
            or state.views
            or state.removed
            or (state.version, state.membership, state.blocked)
            != (self._version, self._membership, self._blocked)
        ):
            self._cached = None
        self._version, self._membership = state.version, state.membership
        self._blocked, self._audited = state.blocked, state.audited
        if state.links is not None:
            self._link_table, self._cached = state.links, None
        others: dict[str, int] = {}
        for index, counts in state.in_flight.items():
            if index != self.index:
                others = sum_counts(others, counts)
        before = self._flight.remote("others")
        if self._flight.set_remote("others", others):
            self._note_counts(before, others)
            self._cached_in_flight = None
        for agent_id in scraped:  # after the counts of the same instant: what ended since, from here on
            self._scraped(agent_id)
        return joined

    def take_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(own in-flight counts, requests sent since the last call) for the orchestrator."""
        sent, self._sent = self._sent, {}
        self.counts_changed = False
        return self._flight.own(), sent

    # --- the GatewayRegistry surface (``snapshot`` is the base class's) ---
    def get(self, agent_id: str) -> InstanceView | None:
        return self._views.get(agent_id)

    def acquire(self, agent_id: str) -> None:
        self._flight.add(agent_id)
        self._counted(agent_id)
        self._sent[agent_id] = self._sent.get(agent_id, 0) + 1
        view = self._views.get(agent_id)
        if view is not None and view.breaker.state == "half_open" and not view.breaker.probing:
            self._probing.add(agent_id)
            self._forward(Call("probe_sent", (agent_id,)))

    def release(self, agent_id: str) -> None:
        self._flight.remove(agent_id)
        self._counted(agent_id)
        if agent_id in self._probing:
            self._probing.discard(agent_id)
            self._forward(Call("probe_ended", (agent_id,)))

    def hold(self, agent_id: str) -> None:
        self._flight.add(agent_id)
        self._counted(agent_id)

    def unhold(self, agent_id: str) -> None:
        self._flight.remove(agent_id)
        self._counted(agent_id)

    def _counted(self, agent_id: str) -> None:
        self._cached_in_flight = None
        self._changes.note(agent_id)
        self.counts_changed = True

    def leg_succeeded(self, agent_id: str, partner: str | None = None) -> None:
        self._forward(Call("leg_succeeded", (agent_id, partner)))

    def leg_failed(
        self, agent_id: str, now: float, partner: str | None = None, *, instance_fault: bool = True
    ) -> None:
        self._forward(Call("leg_failed", (agent_id, now, partner), {"instance_fault": instance_fault}))

    def audit_dispatch(
        self, decode: str, request_id: str, prefill: str, tokens: int, now: float, key: int | None = None
    ) -> int | None:
        if decode not in self._audited:
            return None
        key = next(self._keys) if key is None else key
        self._forward(Call("audit_dispatch", (decode, request_id, prefill, tokens, now, key)))
        return key

    def audit_done(self, decode: str, key: int, now: float, *, answered: bool) -> None:
        self._forward(Call("audit_done", (decode, key, now), {"answered": answered}))

    def kv_sent(self, prefill: str, decode: str, tokens: int, now: float) -> None:
        self._forward(Call("kv_sent", (prefill, decode, tokens, now)))
