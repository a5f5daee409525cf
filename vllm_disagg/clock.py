"""Injected time: decisions take a ``Clock`` so tests advance a fake one instead of sleeping."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds (for durations and deadlines) and wall seconds (for display)."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes back."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wall(self) -> float:
        """``time.time()``."""
        return time.time()


class FakeClock:
    """A clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset

    def monotonic(self) -> float:
        """The current fake time."""
        return self._now

    def wall(self) -> float:
        """The current fake wall time."""
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        """Move time forward; negative steps are refused because monotonic time never goes back."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self._now += seconds
