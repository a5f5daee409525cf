"""In-flight engine legs by instance, so that a lost instance's legs fail at once instead of hanging.

A partitioned or frozen engine sends nothing: without this, its legs would wait for the idle timeout
(minutes). The registry declares the instance lost within a second (no heartbeat, engine restarting,
agent gone) and calls ``LegWatch.lost``, which cancels each leg's task; the leg's ``async with`` turns
that cancellation into an ``UpstreamError`` with cause ``lost``, which the gateway retries or resumes
like any other failure. The happy path costs one set insert and one removal per leg.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from vllm_disagg.errors import UpstreamError


class LegWatch:
    """Which tasks are running a leg on which instance."""

    def __init__(self) -> None:
        self._legs: dict[str, set[_Leg]] = {}

    def leg(self, agent_id: str, description: str) -> _Leg:
        """``async with watch.leg(id, "decode instance 'd0'"):`` around one engine call."""
        return _Leg(self, agent_id, description)

    def lost(self, agent_id: str, reason: str) -> int:
        """Fail every leg running on ``agent_id``; returns how many there were."""
        legs = self._legs.pop(agent_id, None)
        if not legs:
            return 0
        for leg in legs:
            leg.lost_reason = reason
            if leg.task is not None:
                leg.task.cancel()
        return len(legs)

    def running(self, agent_id: str) -> int:
        """Legs on ``agent_id`` now."""
        return len(self._legs.get(agent_id, ()))


class _Leg:
    __slots__ = ("agent_id", "description", "lost_reason", "task", "watch")

    def __init__(self, watch: LegWatch, agent_id: str, description: str) -> None:
        self.watch = watch
        self.agent_id = agent_id
        self.description = description
        self.lost_reason = ""
        self.task: asyncio.Task[object] | None = None

    async def __aenter__(self) -> _Leg:
        self.task = asyncio.current_task()
        self.watch._legs.setdefault(self.agent_id, set()).add(self)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        legs = self.watch._legs.get(self.agent_id)
        if legs is not None:
            legs.discard(self)
            if not legs:
                del self.watch._legs[self.agent_id]
        # Our cancel, and nobody else's (a client that left cancels too): uncancel() is then 0.
        lost = kind is asyncio.CancelledError and self.lost_reason and self.task is not None
        if lost and self.task is not None and self.task.uncancel() == 0:
            raise UpstreamError(
                f"{self.description} was lost mid-request: {self.lost_reason}", cause="lost"
            ) from None
