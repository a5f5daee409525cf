"""scripts/bench_codec.py, the measurement behind the codec's decision (docs/protocol.md), still runs
and checks that both codecs read every message back as it was sent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("msgspec", reason="msgspec is not a dependency; vLLM brings it where an engine runs")


def test_the_codec_benchmark_runs_on_every_message(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).parents[2] / "scripts" / "bench_codec.py"
    spec = importlib.util.spec_from_file_location("bench_codec", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--repeat", "1", "--seconds", "0.001"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + len(bench.MESSAGES)  # the header, its rule, and a row for each message
