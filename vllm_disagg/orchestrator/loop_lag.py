"""How late the orchestrator's event loop runs what is due.

Every request, heartbeat and KV event shares one loop: anything that holds it (a slow tokenization, a
big KV-event batch, a garbage-collection pause) delays them all, and shows in the tail latency long
before it shows anywhere else. A task asks to wake every ``interval_s`` and records how much later
than that it woke (``vllm_disagg_event_loop_lag_seconds``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

LAG_INTERVAL_S = 0.1


async def watch_loop_lag(
    observe: Callable[[float], None],
    interval_s: float = LAG_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Observe the loop's lag every ``interval_s`` until cancelled."""
    while True:
        due = clock() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, clock() - due))
