"""Injected time: decisions take a ``Clock`` so tests advance a fake one instead of sleeping.

Waiting goes through the clock too (``Clock.sleep``, ``wait_event``), so that a loop which waits for
time (the control plane's expiry, the planner's looks, a role change's drain timeout, a simulated
engine's step) runs under ``FakeClock`` as fast as a test advances it, and in the cluster simulator on
virtual time. Only waits that measure the real event loop (``loop_lag``) or pace real I/O keep
``asyncio.sleep``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol

SETTLE_PASSES = 20  # event-loop turns ``FakeClock.settle`` gives woken tasks (each runs to its next wait)


class Clock(Protocol):
    """Monotonic seconds (for durations and deadlines), wall seconds (for display), and waiting."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes back."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``monotonic()`` has moved on by ``seconds`` (at least one event-loop turn)."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wall(self) -> float:
        """``time.time()``."""
        return time.time()

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep``."""
        await asyncio.sleep(seconds)


class FakeClock:
    """A clock that moves only when a test says so; ``sleep`` parks the caller until it has.

    ``advance`` (synchronous, as tests have always called it) moves time and wakes the sleepers whose
    deadline it passed, in deadline order; they run once the test yields (``await clock.settle()``).
    ``await clock.run_for(seconds)`` is what a test of a loop wants: time moves from one sleeper's
    deadline to the next, and the tasks woken at each run before it goes on, so a loop that sleeps
    0.25 s runs 40 times in 10 s, each at its own instant.
    """

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()  # equal deadlines wake in the order they went to sleep

    def monotonic(self) -> float:
        """The current fake time."""
        return self._now

    def wall(self) -> float:
        """The current fake wall time."""
        return self._now + self._wall_offset

    async def sleep(self, seconds: float) -> None:
        """Park until time has been advanced past ``now + seconds`` (a zero or negative wait yields once)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        await future  # a cancelled sleeper's future is cancelled: ``_wake`` skips it

    @property
    def sleepers(self) -> int:
        """Tasks parked in ``sleep`` now."""
        return sum(not f.done() for _, _, f in self._sleepers)

    def next_deadline(self) -> float | None:
        """When the earliest parked sleeper is due, None when nobody sleeps."""
        self._drop_cancelled()
        return self._sleepers[0][0] if self._sleepers else None

    def advance(self, seconds: float) -> None:
        """Move time forward and wake the sleepers now due; negative steps are refused because monotonic
        time never goes back."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self._now += seconds
        self._wake()

    async def run_for(self, seconds: float) -> None:
        """Advance ``seconds`` through each sleeper's deadline in turn, letting the tasks woken at each
        run (``settle``) before time moves on; sleeps they start meanwhile count if they fall due."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        end = self._now + seconds
        await self.settle()
        while (due := self.next_deadline()) is not None and due <= end:
            self._now = max(self._now, due)
            self._wake()
            await self.settle()
        self._now = end

    @staticmethod
    async def settle(passes: int = SETTLE_PASSES) -> None:
        """Give the event loop ``passes`` turns: tasks just woken run on to their next wait."""
        for _ in range(passes):
            await asyncio.sleep(0)

    def _wake(self) -> None:
        sleepers = self._sleepers
        while sleepers and sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(sleepers)
            if not future.done():
                future.set_result(None)

    def _drop_cancelled(self) -> None:
        sleepers = self._sleepers
        while sleepers and sleepers[0][2].done():
            heapq.heappop(sleepers)


async def wait_event(clock: Clock, event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` of ``clock``'s seconds pass (None: no limit); whether
    it was set. ``asyncio.wait_for`` would count the event loop's seconds, which a fake clock does not
    move."""
    if event.is_set():
        return True
    if timeout_s is None:
        await event.wait()
        return True
    if timeout_s <= 0:
        await asyncio.sleep(0)
        return event.is_set()
    waiter = asyncio.ensure_future(event.wait())
    timer = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        await asyncio.wait((waiter, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiter, timer):
            task.cancel()
        await asyncio.gather(waiter, timer, return_exceptions=True)
    return event.is_set()
