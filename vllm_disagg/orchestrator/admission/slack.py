"""How much later than predicted admitted requests see their first token: the margin admission keeps.

``fit`` predicts the prefill stage's TTFT from scraped means, so it cannot see what a request's own
prompt costs beyond the mean, the KV handoff, the decode instance's first step, or a gateway and
engines short of CPU. A request that waited is admitted while its wait plus that prediction is within
its target, so without a margin the ones admitted at the boundary reach the client at the target plus
what the prediction missed: measured on the 4P4D benchmark, about half of them missed it.

``Slack`` keeps the last ``window`` residuals (the TTFT the client saw, less the wait and the
prediction at admission) and gives a high quantile of them, never below zero: the amount a prediction
has recently been short by, for most requests. Pure: the gateway feeds it each request that got its
first token.
"""

from __future__ import annotations

import bisect
from collections import deque

WINDOW = 256  # residuals kept: a few seconds of a busy gateway, minutes of a quiet one
QUANTILE = 0.9
MIN_SAMPLES = 16  # below this, no margin: too few to say anything


class Slack:
    """A moving high quantile of (seen TTFT - waited - predicted)."""

    def __init__(self, window: int = WINDOW, quantile: float = QUANTILE) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self._quantile = quantile

    def observe(self, seen_ttft_s: float, waited_s: float, predicted_s: float) -> None:
        """One request's first token, ``seen_ttft_s`` after it arrived, having waited ``waited_s`` in
        the queue with ``predicted_s`` predicted for it when it was admitted."""
        if not predicted_s > 0:  # none was made (its pair was gone at the check): nothing to measure
            return
        residual = seen_ttft_s - waited_s - predicted_s
        if residual != residual:  # NaN: a broken figure teaches nothing
            return
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(residual)
        bisect.insort(self._sorted, residual)

    def value(self) -> float:
        """Seconds to add to a prediction before comparing it with a target; 0 until ``MIN_SAMPLES``."""
        n = len(self._sorted)
        if n < MIN_SAMPLES:
            return 0.0
        return max(0.0, self._sorted[min(n - 1, int(self._quantile * n))])

    def __len__(self) -> int:
        return len(self._sorted)
