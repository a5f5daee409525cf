"""``bench gateway --compare`` end to end on loopback: one engine fleet, our gateway and another router.

The other router here is a simulated engine serving whole requests by itself: any command that
answers ``/v1/completions`` on ``{port}`` can be compared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.helpers import free_ports
from vllm_disagg.bench.compare import OURS, run_comparison


async def test_every_router_runs_every_scenario_in_every_round_on_the_same_engines() -> None:
    base = free_ports(1, (0, 1, 2, 3, 100, 101, 2100, 2101))
    args = argparse.Namespace(
        port=base, prefill=1, decode=1, rounds=2, concurrency=[1, 3], requests=12, warmup=2,
        max_tokens=4, prompt_chars=32, modes=["plain", "stream"],
    )  # fmt: skip
    command = f"{Path(sys.executable).parent / 'vllm-disagg'} sim-engine --model sim-model --port {{port}}"
    report = await run_comparison(args, [("alone", command)])
    results = report["results"]
    assert isinstance(results, list)
    seen = {(r["router"], r["round"], r["concurrency"], r["stream"]) for r in results}
    assert seen == {
        (name, n, c, s) for name in (OURS, "alone") for n in (0, 1) for c in (1, 3) for s in (False, True)
    }
    for r in results:
        assert r["requests"] == 12 and r["p50_ms"] <= r["p99_ms"] and r["rps"] > 0, r
        assert (r["agents_cpu_ms_per_req"] is None) == (r["router"] != OURS), r
    # CPU comes in clock ticks (10 ms): a few requests may cost none, all of ours cannot.
    assert sum(r["cpu_ms_per_req"] for r in results if r["router"] == OURS) > 0
    assert report["commands"] == {"alone": command.format(port=base + 2)}
