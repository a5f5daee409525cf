"""Fencing: an agent obeys no leader older than the newest it has obeyed.

Replicated orchestrators elect one leader at a time through an etcd lease, and each leadership term
has an epoch that only grows (protocol 1.6, ``Command.epoch``; 0 from a single orchestrator without
etcd). A leader that lost its lease (a long pause, a partition) may still send commands before it
notices; an agent that has obeyed a newer term refuses them with ``STALE_EPOCH``, so two leaders never
act on one agent at once. The highest epoch is one per agent process, across all its sessions.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def stale_error(epoch: int, highest: int) -> str:
    """The refusal's words: why a command of ``epoch`` was not carried out."""
    return f"stale epoch {epoch}: this agent obeys epoch {highest} and newer (a newer leader has taken over)"


class Fence:
    """The highest command epoch this agent has obeyed; it admits commands of that epoch or newer."""

    def __init__(self) -> None:
        self.highest = 0
        self.refused = 0  # commands refused as stale, over the agent's life

    def admit(self, epoch: int) -> str:
        """ "" when a command of ``epoch`` may be carried out (the highest rises to it), else the
        refusal's reason (nothing changes)."""
        if epoch < self.highest:
            self.refused += 1
            return stale_error(epoch, self.highest)
        if epoch > self.highest:
            log.info(
                "now obeying epoch %d (was %d): commands of older leaders are refused", epoch, self.highest
            )
            self.highest = epoch
        return ""
