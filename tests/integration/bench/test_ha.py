"""``bench ha`` end to end, short: a real etcd, real replicas, agents and simulated engines on loopback.

What is checked is the harness, never speed: the report has its shape, the leader it killed really
lost its leadership to another replica in a newer epoch (an agent accepted that epoch's command), no
request on a surviving replica failed, and the counters it reads from outside the processes (agents'
bytes from ``ss``, CPU from ``/proc``) were read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.etcd_support import EtcdMissing, etcd_binary
from vllm_disagg import jsonutil
from vllm_disagg.bench.ha import render, run_benchmark
from vllm_disagg.bench.ha_cluster import tcp_bytes
from vllm_disagg.bench.ha_throughput import SCENARIOS
from vllm_disagg.cli.commands import build_parser

pytestmark = pytest.mark.slow

_SS = """\
0      0      127.0.0.1:41000 127.0.0.1:5555 users:(("python3",pid=11,fd=9))
\t bbr wscale:10,10 bytes_sent:1200 bytes_acked:1201 bytes_received:300 segs_out:3
0      0      127.0.0.1:41001 127.0.0.1:5556 users:(("python3",pid=11,fd=10))
\t bbr wscale:10,10 bytes_sent:1000 bytes_acked:1001 bytes_received:200 segs_out:3
0      0      127.0.0.1:41002 127.0.0.1:8000 users:(("python3",pid=11,fd=11))
\t bbr wscale:10,10 bytes_sent:9999 bytes_acked:9999 bytes_received:9999 segs_out:3
0      0      127.0.0.1:5555 127.0.0.1:41000 users:(("python3",pid=12,fd=9))
\t bbr wscale:10,10 bytes_sent:300 bytes_acked:300 bytes_received:1201 segs_out:3
"""


def test_agent_bytes_are_summed_over_its_connections_to_the_orchestrators_ports_only() -> None:
    assert tcp_bytes(_SS, {11: "prefill-0", 13: "decode-0"}, {5555, 5556}) == {
        "prefill-0": (2202, 500),
        "decode-0": (0, 0),
    }


async def test_a_short_run_kills_the_leader_sees_a_new_one_act_and_measures_every_configuration(
    tmp_path: Path,
) -> None:
    try:
        etcd_binary()
    except EtcdMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    args = build_parser().parse_args(
        [
            "bench", "ha", "--runs", "1", "--logs", str(tmp_path),
            "--lease-ttl-s", "2", "--failover-concurrency", "6", "--before-s", "0.5",
            "--stale-samples", "2", "--stale-tokens", "60",
            "--configs", "single", "replicas2", "--concurrency", "4", "--requests", "40", "--warmup", "5",
            "--max-tokens", "4", "--prompt-chars", "64", "--idle-s", "0.6",
        ]
    )  # fmt: skip
    report = await run_benchmark(args)

    failover = report["failover"]
    [run] = failover["runs"]
    assert run["new_leader"] != run["killed"] and run["new_epoch"] > run["old_epoch"], run
    assert run["failover_s"] > 0 and run["survivors_requests"] > 0 and run["survivors_failed"] == 0, run
    assert run["victim_failed"] <= run["victim_in_flight"], run
    assert failover["median"]["failover_s"] == run["failover_s"]
    samples = report["staleness"]["samples"]
    assert len(samples) == 2 and all(s["a"] != s["b"] and s["poll_ms"] > 0 for s in samples), samples

    rounds = report["throughput"]["rounds"]
    scenarios = {(r["config"], r["stream"], r["unique"]) for r in rounds}
    assert scenarios == {(c, s, u) for c in ("single", "replicas2") for s, u in SCENARIOS}
    assert all(r["requests"] == 40 and r["rps"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in rounds), rounds
    # CPU comes in clock ticks (10 ms): a few requests may cost none, all of them cannot.
    assert sum(r["orchestrators_cpu_ms_per_req"] for r in rounds) > 0
    assert len(report["throughput"]["median"]) == 6
    traffic = {t["config"]: t for t in report["traffic"]}
    assert [traffic[c]["orchestrators"] for c in ("single", "replicas2")] == [1, 2]
    assert all(t["agent_sent_bytes_per_s"] > 0 for t in traffic.values()), traffic  # heartbeats, read by ss

    assert jsonutil.loads(jsonutil.dumps(report)) == report
    table = render(report)
    assert "failover" in table and "2 replicas" in table and "gateway-workers" not in table
