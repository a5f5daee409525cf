"""Virtual time: a clock that only moves when the next event is taken, and the queue of events.

The orchestrator's code takes a ``Clock``; here it gets ``VirtualClock``, so the registry's timeouts,
the breakers, the planner's cooldown, the rollouts' and role changes' steps and the scheduler all see
simulated seconds. Nothing sleeps in real time: the simulator's drivers are callbacks the event loop
runs at their instant. ``VirtualClock.sleep`` is there for a coroutine written against ``Clock``: it
parks until the event loop reaches its deadline, and runs on when the asyncio loop next gets a turn.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

WALL_ORIGIN = 1.7e9  # what ``wall()`` says at virtual time 0 (an arbitrary epoch second)


class VirtualClock:
    """The simulation's clock (``vllm_disagg.clock.Clock``): ``now`` is set by the event loop."""

    def __init__(self) -> None:
        self.now = 0.0
        self.loop: EventLoop | None = None  # set by the ``EventLoop`` that moves it (``sleep`` needs it)

    def monotonic(self) -> float:
        """Virtual seconds since the simulation started."""
        return self.now

    def wall(self) -> float:
        """The same instant as epoch seconds."""
        return WALL_ORIGIN + self.now

    async def sleep(self, seconds: float) -> None:
        """Park until the event loop reaches ``now + seconds`` (``Clock.sleep`` on virtual time)."""
        events = self.loop
        if events is None:
            raise RuntimeError("no event loop moves this clock: nothing would ever wake the sleeper")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        events.after(max(seconds, 0.0), lambda: None if future.done() else future.set_result(None))
        await future


class EventLoop:
    """Callbacks at virtual times, run in time order (ties in the order they were scheduled)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        clock.loop = self
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0  # run so far
        self._stopped = False

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` at virtual time ``when`` (now, if ``when`` is in the past)."""
        heapq.heappush(self._heap, (max(when, self.clock.now), next(self._seq), action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        """Run ``action`` ``delay`` virtual seconds from now."""
        self.at(self.clock.now + delay, action)

    def run(self, until: float = float("inf"), on_progress: Callable[[float], None] | None = None) -> None:
        """Take events in order until none is left or the next one is after ``until``."""
        heap, clock = self._heap, self.clock
        pop = heapq.heappop
        self._stopped = False
        while heap and heap[0][0] <= until and not self._stopped:
            when, _, action = pop(heap)
            clock.now = when
            action()
            self.events += 1
            if on_progress is not None and not self.events & 0xFFFF:
                on_progress(when)
        if until != float("inf"):
            clock.now = max(clock.now, until)

    def stop(self) -> None:
        """End ``run`` after the event under way (periodic events would otherwise go on for ever)."""
        self._stopped = True

    def __len__(self) -> int:
        return len(self._heap)
