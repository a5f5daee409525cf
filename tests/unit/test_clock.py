"""Waiting on an injected clock: a fake clock's sleepers wake as a test advances it, in deadline order,
and the simulator's virtual clock wakes them as its event loop reaches their instant."""

from __future__ import annotations

import asyncio

import pytest

from vllm_disagg.clock import Clock, FakeClock, SystemClock, wait_event
from vllm_disagg.cluster_sim.virtual_clock import EventLoop, VirtualClock


async def sleeper(clock: Clock, seconds: float, woke: list[tuple[float, float]]) -> None:
    await clock.sleep(seconds)
    woke.append((seconds, clock.monotonic()))


@pytest.mark.parametrize(
    ("naps", "advance", "woken"),
    [
        pytest.param([1.0], 0.5, [], id="a sleeper before its deadline stays asleep"),
        pytest.param([1.0], 1.0, [1.0], id="a sleeper wakes at its deadline exactly"),
        pytest.param([3.0, 1.0, 2.0], 5.0, [1.0, 2.0, 3.0], id="one advance past several: deadline order"),
        pytest.param([2.0, 1.0, 2.0], 1.5, [1.0], id="only those due wake"),
    ],
)
async def test_advance_wakes_the_sleepers_it_passes_in_deadline_order(
    naps: list[float], advance: float, woken: list[float]
) -> None:
    clock = FakeClock()
    woke: list[tuple[float, float]] = []
    tasks = [asyncio.ensure_future(sleeper(clock, n, woke)) for n in naps]
    await clock.settle()
    assert clock.sleepers == len(naps)
    clock.advance(advance)
    await clock.settle()
    assert [n for n, _ in woke] == woken
    assert clock.sleepers == len(naps) - len(woken)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_run_for_steps_through_each_deadline_so_a_periodic_loop_runs_at_its_own_instants() -> None:
    clock = FakeClock(start=0.0)
    ticks: list[float] = []

    async def every_quarter_second() -> None:
        while True:
            await clock.sleep(0.25)
            ticks.append(clock.monotonic())

    task = asyncio.ensure_future(every_quarter_second())
    await clock.run_for(1.0)
    assert ticks == [0.25, 0.5, 0.75, 1.0]
    assert clock.monotonic() == 1.0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_cancelled_sleeper_is_forgotten() -> None:
    clock = FakeClock()
    task = asyncio.ensure_future(clock.sleep(1.0))
    await clock.settle()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert clock.sleepers == 0 and clock.next_deadline() is None
    clock.advance(2.0)  # nothing to wake, nothing raised


async def test_a_zero_sleep_yields_once_and_time_stays() -> None:
    clock = FakeClock()
    await clock.sleep(0)
    assert clock.monotonic() == 1000.0


async def test_time_cannot_go_back() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1)
    with pytest.raises(ValueError, match="cannot go back"):
        await clock.run_for(-1)


@pytest.mark.parametrize(
    ("set_after", "timeout", "expected", "at"),
    [
        pytest.param(0.5, 1.0, True, 1000.5, id="the event first: True as soon as it is set"),
        pytest.param(2.0, 1.0, False, 1001.0, id="the deadline first: False at the deadline"),
        pytest.param(None, 0.0, False, 1000.0, id="no time to wait: False at once"),
    ],
)
async def test_wait_event_counts_the_clocks_seconds(
    set_after: float | None, timeout: float, expected: bool, at: float
) -> None:
    clock = FakeClock()
    event = asyncio.Event()
    result: list[tuple[bool, float]] = []

    async def waiter() -> None:
        result.append((await wait_event(clock, event, timeout), clock.monotonic()))

    task = asyncio.ensure_future(waiter())
    if set_after is not None:
        await clock.run_for(set_after)
        event.set()
    await clock.run_for(3.0 - (set_after or 0.0))
    await task
    assert result == [(expected, at)]


async def test_wait_event_without_a_limit_waits_for_the_event() -> None:
    event = asyncio.Event()
    task = asyncio.ensure_future(wait_event(FakeClock(), event, None))
    await FakeClock.settle()
    assert not task.done()
    event.set()
    assert await task is True


async def test_the_system_clock_sleeps_in_real_time() -> None:
    clock = SystemClock()
    started = clock.monotonic()
    await clock.sleep(0.01)
    assert clock.monotonic() - started >= 0.009


async def test_the_virtual_clock_wakes_a_sleeper_when_the_event_loop_reaches_its_instant() -> None:
    clock = VirtualClock()
    loop = EventLoop(clock)
    woke: list[tuple[float, float]] = []
    task = asyncio.ensure_future(sleeper(clock, 5.0, woke))
    await FakeClock.settle()
    loop.run(until=4.0)
    await FakeClock.settle()
    assert woke == []
    loop.run(until=10.0)
    await FakeClock.settle()
    assert woke == [(5.0, 10.0)]  # woken at 5 s; it ran once asyncio had a turn, after the loop's run
    await task


async def test_a_virtual_clock_without_an_event_loop_refuses_to_sleep() -> None:
    with pytest.raises(RuntimeError, match="no event loop"):
        await VirtualClock().sleep(1.0)
