"""The planner sees what admission sees: a pool the gateway's queue holds requests back for is short,
even while the requests admission lets through meet their targets; and the window carries the held
counts from the gateway to the planner's signals."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.orchestrator.planner.test_planner import CONFIG, pools, run, shifts
from tests.unit.scheduling_support import snapshot, view
from vllm_disagg.orchestrator.planner.decide import PoolSignals, pressure
from vllm_disagg.orchestrator.planner.signals import SloWindow, pool_signals
from vllm_disagg.protocol.messages import MetricsSnapshot


def held(signals: PoolSignals, n: int) -> PoolSignals:
    return dataclasses.replace(signals, held=n)


def test_a_held_pool_is_over_its_target_by_the_requests_held_per_instance() -> None:
    _, decode = pools(0.5, 0.02)  # both well within targets (1 s, 50 ms)
    assert pressure(decode, CONFIG.tpot_target_s, CONFIG.min_samples) == pytest.approx(0.4)
    assert pressure(held(decode, 4), CONFIG.tpot_target_s, CONFIG.min_samples) == 3.0  # 1 + 4 / 2
    slow = dataclasses.replace(decode, p90_s=0.25)  # 5x its target already: the larger figure
    assert pressure(held(slow, 4), CONFIG.tpot_target_s, CONFIG.min_samples) == pytest.approx(5.0)
    assert pressure(held(dataclasses.replace(decode, samples=1), 4), 0.05, 20) is None


def test_admission_holding_requests_for_decode_moves_an_instance_to_decode() -> None:
    """The decode pool's TPOT is on target (admission protects it) and so is the prefill pool's TTFT:
    without the held count the planner would call it balanced while requests wait."""
    balanced = pools(0.5, 0.02)
    assert shifts(run([balanced] * 4)) == []
    prefill, decode = balanced
    looks = [(prefill, held(decode, 6))] * 4
    moved = shifts(run(looks))
    assert moved and moved[0][2:] == ("prefill", "decode")


def test_the_window_carries_the_held_counts_into_the_pools_signals() -> None:
    window = SloWindow(60.0, lambda: 0.0)
    snap = snapshot(view("p0", role="prefill"), view("d0", role="decode"))
    window.admission_held(prefill=3, decode=0)
    prefill, decode = pool_signals(snap, window)
    assert (prefill.held, decode.held) == (3, 0)
    window.admission_held(prefill=0, decode=2)
    prefill, decode = pool_signals(snap, window)
    assert (prefill.held, decode.held) == (0, 2)


def test_the_pools_signals_carry_the_mean_kv_pool_hit_rate_of_the_instances_that_report_one() -> None:
    def hits(rate: float | None) -> MetricsSnapshot:
        return MetricsSnapshot(kv_pool_hit_rate=rate)

    snap = snapshot(
        view("p0", role="prefill", metrics=hits(0.9)),
        view("p1", role="prefill", metrics=hits(0.5)),
        view("p2", role="prefill", metrics=hits(None)),  # no pool: not a zero
        view("d0", role="decode"),
    )
    prefill, decode = pool_signals(snap, SloWindow(60.0, lambda: 0.0))
    assert prefill.kv_pool_hit_rate == pytest.approx(0.7)
    assert decode.kv_pool_hit_rate is None
