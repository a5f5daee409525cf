"""``bench gateway --tracing``: the orchestrator of the benchmark's cluster traces every request and
really exports (the harness only, never speed)."""

from __future__ import annotations

from tests.helpers import free_ports
from vllm_disagg.bench.gateway import render_table, run_benchmark
from vllm_disagg.cli.commands import build_parser


async def test_a_short_traced_run_exports_spans_and_measures_the_gateway() -> None:
    port = free_ports(4, offsets=(0, 1000, 2000, 3000))
    argv = ["bench", "gateway", "--tracing", "--port", str(port), "--requests", "30", "--warmup", "5"]
    args = build_parser().parse_args([*argv, "--concurrency", "4", "--max-tokens", "4"])
    report = await run_benchmark(args)
    tracing = report["tracing"]
    assert isinstance(tracing, dict) and tracing["exports"] >= 1 and tracing["bytes"] > 0, tracing
    rows = [r for r in report["results"] if r["path"] == "gateway"]  # type: ignore[attr-defined]
    assert len(rows) == 2 and all(r["requests"] == 30 and r["gateway_cpu_ms_per_req"] > 0 for r in rows)
    assert "tracing on: every request traced" in render_table(report)
