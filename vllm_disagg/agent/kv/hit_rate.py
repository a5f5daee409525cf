"""The pool's hit rate over a sliding window, from two lifetime counters (blocks asked, blocks found).

The agent reports it with each heartbeat (``MetricsSnapshot.kv_pool_hit_rate``) over the same window
as the engine's own averages (``--metrics-window-s``), as the scraper computes the prefix cache's hit
rate from vLLM's lifetime counters: the difference between now and the oldest sample in the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class WindowedRate:
    """``found / asked`` over the last ``window_s`` seconds of ``clock``; None without an ask in it."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, asked, found), oldest first

    def rate(self, asked: int, found: int) -> float | None:
        """Record the counters now; the share found of what was asked within the window."""
        now = self._clock()
        samples = self._samples
        samples.append((now, asked, found))
        # Keep the newest sample at or before the window's start: the window's baseline.
        while len(samples) > 1 and samples[1][0] <= now - self._window_s:
            samples.popleft()
        _, asked0, found0 = samples[0]
        if asked < asked0 or found < found0:  # the counters started over (a new pool service)
            samples.clear()
            samples.append((now, asked, found))
            return None
        delta = asked - asked0
        return (found - found0) / delta if delta > 0 else None
