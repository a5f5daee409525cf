"""Who leads the replicas, as this orchestrator knows it: the one owner of that knowledge.

Only the leader carries out what must have one owner (docs/operations.md, "Replicas"): every command
to an agent (``ControlPlane.send_command`` asks ``require``), the planner, role changes, rollouts,
operators' writes. A single orchestrator, without etcd, always leads, in epoch 0 (``Leadership.sole``).
A replica's election (``orchestrator/replicas``) is the only writer (``update``); everything else reads,
or ``watch``es for a change (the callback only sets a flag or an ``asyncio.Event``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_disagg.errors import NotLeader


@dataclass(frozen=True, slots=True)
class LeaderView:
    """One moment of the election as this replica saw it."""

    is_leader: bool
    epoch: int  # the term this replica leads in; 0 when it does not (or without etcd)
    leader_id: str  # who leads ("" when nobody is known to)
    since: float  # wall time the leader's term began, as this replica saw it (0: unknown)
    etcd_ok: bool  # the last call to etcd succeeded (True without etcd)
    # Why leader actions are paused here, for /health and status ("" while they run or are the
    # leader's to run): "etcd unreachable", "no leader (an election is under way)".
    paused: str = ""


class Leadership:
    """The current ``LeaderView`` and who wants to hear of its changes."""

    def __init__(self, replica_id: str, view: LeaderView) -> None:
        self.replica_id = replica_id
        self._view = view
        self._watchers: list[Callable[[], None]] = []

    @classmethod
    def sole(cls) -> Leadership:
        """A single orchestrator: it leads, always, in epoch 0."""
        return cls("", LeaderView(is_leader=True, epoch=0, leader_id="", since=0.0, etcd_ok=True))

    @property
    def replicated(self) -> bool:
        """Is this one replica of many (not a single orchestrator)?"""
        return bool(self.replica_id)

    @property
    def view(self) -> LeaderView:
        """The election as last seen."""
        return self._view

    @property
    def is_leader(self) -> bool:
        """Does this orchestrator lead now (and may act as the one owner)?"""
        return self._view.is_leader

    @property
    def epoch(self) -> int:
        """The term this orchestrator leads in (0 when it does not, or without etcd)."""
        return self._view.epoch

    def require(self, what: str) -> int:
        """The epoch to act in; ``NotLeader`` when this orchestrator does not lead."""
        view = self._view
        if not view.is_leader:
            who = f"replica {view.leader_id!r} leads" if view.leader_id else "no replica leads now"
            raise NotLeader(f"{what}: this replica ({self.replica_id}) does not lead; {who}")
        return view.epoch

    def update(self, view: LeaderView) -> None:
        """The election's news (its owner alone calls this); watchers hear of a change."""
        if view == self._view:
            return
        self._view = view
        for callback in list(self._watchers):
            callback()

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` after every change; returns the function that stops it."""
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback) if callback in self._watchers else None
