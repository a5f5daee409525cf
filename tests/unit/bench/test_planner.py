"""``bench planner``'s arithmetic: attainment and goodput per phase and window, from client samples."""

from __future__ import annotations

import argparse

from vllm_disagg.bench.planner import PHASES, Sample, add_arguments, planner_yaml, summarise
from vllm_disagg.orchestrator.planner.config import load_planner_config


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--phase-s", "10", "--ttft-ms", "500", "--tpot-ms", "20", *argv])


def test_attainment_counts_requests_meeting_both_targets_and_goodput_is_per_second() -> None:
    samples = [
        Sample(0, 1.0, True, 0.4, 0.010),  # met
        Sample(0, 2.0, True, 0.6, 0.010),  # TTFT missed
        Sample(0, 6.0, True, 0.3, 0.030),  # TPOT missed, second half
        Sample(0, 7.0, False, 0.0, 0.0),  # failed, second half
        Sample(1, 8.0, True, 0.1, 0.015),  # met, second half of the second phase
    ]
    rows = {(r.phase, r.window): r for r in summarise("static", samples, args())}
    first = rows[(PHASES[0][0], "whole")]
    assert (first.requests, first.failed, first.attainment, first.goodput_rps) == (4, 1, 0.25, 0.1)
    late = rows[(PHASES[0][0], "2nd half")]
    assert (late.requests, late.failed, late.attainment, late.goodput_rps) == (2, 1, 0.0, 0.0)
    second = rows[(PHASES[1][0], "2nd half")]
    assert (second.requests, second.attainment, second.goodput_rps) == (1, 1.0, 0.2)


def test_each_arm_gets_a_planner_config_the_orchestrator_accepts() -> None:
    for dry_run in (True, False):
        config = load_planner_config(planner_yaml(dry_run, args()), "bench")
        assert (config.dry_run, config.ttft_target_s, config.tpot_target_s) == (dry_run, 0.5, 0.02)
