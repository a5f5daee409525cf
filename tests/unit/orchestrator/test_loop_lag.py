"""The loop-lag watcher: a loop held by blocking work shows as lag, an idle one as (almost) none."""

from __future__ import annotations

import asyncio
import contextlib
import time

from tests.helpers import eventually
from vllm_disagg.orchestrator.loop_lag import watch_loop_lag


async def test_a_loop_held_by_blocking_work_is_seen_late_by_at_least_the_hold() -> None:
    seen: list[float] = []
    watcher = asyncio.create_task(watch_loop_lag(seen.append, interval_s=0.01))
    try:
        await eventually(lambda: len(seen) >= 3, what="the watcher running")
        before = len(seen)
        time.sleep(0.3)  # noqa: ASYNC251 -- blocking on purpose: the loop can run nothing meanwhile
        await eventually(lambda: len(seen) > before, what="a wake after the hold")
        assert seen[before] >= 0.25, seen[before:]
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert all(lag >= 0.0 for lag in seen)
