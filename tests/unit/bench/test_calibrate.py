"""``bench calibrate``'s fit: exact points give back the costs they were made from."""

from __future__ import annotations

import argparse

import pytest

from vllm_disagg.bench.calibrate import fit, least_squares


def args() -> argparse.Namespace:
    return argparse.Namespace(block_size=128, num_blocks=8192, max_num_seqs=8)


def test_least_squares_recovers_the_coefficients_of_exact_data() -> None:
    xs = [[1.0, x, x * x] for x in (1.0, 2.0, 3.0, 5.0, 8.0)]
    ys = [0.5 + 2.0 * r[1] - 0.25 * r[2] for r in xs]
    assert least_squares(xs, ys) == pytest.approx([0.5, 2.0, -0.25])


def test_the_fit_reads_the_prefill_and_decode_costs_off_the_points() -> None:
    prefill = [(n, 0.004 + 3e-5 * n + 2e-6 * n * n / 1000) for n in (32, 64, 128, 256, 384)]
    decode = [(b, 0.0025 + 2e-4 * b) for b in (1, 2, 4, 8)]
    result = fit(prefill, decode, args())
    p = result.profile
    assert (p.prefill_s_per_token, p.prefill_s_per_token_sq) == pytest.approx((3e-5, 2e-6), rel=1e-6)
    assert (p.decode_step_s, p.decode_step_s_per_seq) == pytest.approx((0.0025, 2e-4), rel=1e-6)
    assert result.prefill_residual == pytest.approx(0, abs=1e-9) and result.decode_residual == pytest.approx(
        0, abs=1e-9
    )
    assert (p.block_size, p.num_blocks, p.max_num_seqs) == (128, 8192, 8)


def test_a_cost_that_comes_out_negative_is_clipped_to_zero() -> None:
    prefill = [(n, 0.006 - 1e-6 * n) for n in (32, 64, 128)]  # noise: longer prompts a hair faster
    result = fit(prefill, [(1, 0.003), (2, 0.003)], args())
    assert result.profile.prefill_s_per_token == 0.0 and result.profile.decode_step_s_per_seq == 0.0
