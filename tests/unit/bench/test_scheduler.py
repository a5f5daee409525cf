"""``vllm-disagg bench scheduler`` runs end to end and its prefill picks follow the cached prefixes."""

from __future__ import annotations

import json

import pytest

from vllm_disagg.cli.commands import main


def test_bench_scheduler_prints_json_with_percentiles_and_prefix_aware_picks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "scheduler", "--instances", "16", "--blocks", "2048", "--decisions", "300", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["instances"] == 16 and result["decisions"] == 300
    assert result["indexed_blocks"] == 2048
    assert 0 < result["total_p50_us"] <= result["total_p99_us"]
    # 80% of prompts are cached documents, and the prefix scorer must steer prefill to their holders.
    assert result["hit_share"] >= 0.7
