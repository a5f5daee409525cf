"""Which instances changed between two snapshots: what a ranking of instances follows.

A snapshot source notes the agent id of every instance whose view or in-flight count changes, in an
append-only log; each snapshot carries a mark of how far the log went when it was built. Whoever kept
something per instance as of one snapshot asks a later one's mark what changed since, and updates
only those (``scheduling/ranking.py``: a decision updates the two or three instances whose counts
moved, not the thousand that did not).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Changes a log holds before it starts a new list: a reader further behind builds again from scratch.
LOG_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class ChangeMark:
    """How far its source's log went when a snapshot was built."""

    log: list[str]  # the source's log list: appended to, never cut (a full one is replaced)
    base: int  # the sequence number of ``log[0]``
    end: int  # the sequence number after the last change this snapshot includes

    def since(self, seq: int) -> list[str] | None:
        """The instances changed from ``seq`` up to this mark, in the order noted (one changed twice
        is there twice: cheaper than a set for the two or three of a decision); None when the log no
        longer reaches back to ``seq``, or ``seq`` is past this mark (the snapshot is older than
        the reader)."""
        if not self.base <= seq <= self.end:
            return None
        return self.log[seq - self.base : self.end - self.base]


class ChangeLog:
    """The log a snapshot source notes changed instances in."""

    __slots__ = ("_base", "_log")

    def __init__(self) -> None:
        self._log: list[str] = []
        self._base = 0

    def note(self, agent_id: str) -> None:
        """``agent_id``'s view or in-flight count changed."""
        self._log.append(agent_id)

    def note_all(self, agent_ids: Iterable[str]) -> None:
        """Each of ``agent_ids`` changed."""
        self._log.extend(agent_ids)

    def restart(self) -> None:
        """Everything may have changed (a whole new state): readers build again from scratch."""
        self._base += len(self._log) + 1
        self._log = []

    def mark(self) -> ChangeMark:
        """Where the log stands, for a snapshot built now."""
        if len(self._log) > LOG_LIMIT:  # a new list: marks already given keep theirs
            self._base += len(self._log)
            self._log = []
        return ChangeMark(self._log, self._base, self._base + len(self._log))
