"""``vllm-disagg bench ha``: what replicated orchestrators cost and how fast they fail over.

Two parts, each on real processes on this machine (docs/benchmarks.md):

- **failover** (``ha_failover.py``): etcd, ``--failover-replicas`` (3) replicas and three agents with
  small-delay simulated engines; first the in-flight staleness across replicas (``--stale-samples``
  long streams on one replica, polled on it and on the next), then ``--runs`` times: streaming load
  spread over every replica, the leader SIGKILLed, the time until an agent accepts the new leader's
  first command, the requests that failed on the surviving replicas (should be none) and on the
  killed one's connections, and the survivors' latency before and during the failover. The killed
  replica is started again between runs, as a supervisor would.
- **throughput** (``ha_throughput.py``): requests per second, latency and CPU per request through
  one orchestrator, one with ``--gateway-workers 2``, and 1, 2 and 3 replicas (``--configs``), with
  zero-delay engines, each started afresh for each of ``--runs`` rounds; and each agent's traffic to
  the orchestrators, idle and per request.

``--json`` prints one JSON object; otherwise tables of medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.bench.ha_cluster import HaCluster, Shape
from vllm_disagg.bench.ha_failover import FailoverRun, StalenessSample, failover_run, staleness_sample
from vllm_disagg.bench.ha_throughput import CONFIGS, SCENARIOS, ThroughputRound, Traffic, measure_config
from vllm_disagg.errors import ConfigError
from vllm_disagg.runtime import asyncio_run

# Streams of 16-32 tokens at 10 ms a step last 0.2-0.4 s: some are always in flight when a replica dies.
_SMALL_DELAY = (("decode_step_s", "0.01"), ("prefill_s_per_token", "0.0001"), ("max_num_seqs", "64"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench ha``."""
    parser.add_argument(
        "--runs", type=int, default=3, help="failovers, and throughput rounds per configuration"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=("failover", "throughput"), default=["failover", "throughput"]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--logs", default="", help="where every process's output goes (default: a new temp dir)"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=180.0, help="for a cluster to be ready")
    fail = parser.add_argument_group("failover")
    fail.add_argument("--failover-replicas", type=int, default=3, help="replicas (at least 2)")
    fail.add_argument("--lease-ttl-s", type=int, default=3, help="the leader's etcd lease (2..60)")
    fail.add_argument("--failover-concurrency", type=int, default=12, help="streams in flight")
    fail.add_argument("--before-s", type=float, default=3.0, help="steady load before each kill")
    fail.add_argument("--stale-samples", type=int, default=10, help="long streams for the staleness figure")
    fail.add_argument("--stale-tokens", type=int, default=100, help="their length (10 ms a token)")
    thr = parser.add_argument_group("throughput")
    thr.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    thr.add_argument("--concurrency", type=int, default=64)
    thr.add_argument("--requests", type=int, default=1000, help="measured requests per scenario and round")
    thr.add_argument("--warmup", type=int, default=100, help="unmeasured requests before each")
    thr.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    thr.add_argument("--prompt-chars", type=int, default=256, help="prompt length (sim: 1 token/byte)")
    thr.add_argument(
        "--idle-s", type=float, default=5.0, help="idle time over which agent traffic is counted"
    )


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the parts asked for; the figures as one object."""
    if args.failover_replicas < 2:
        raise ConfigError("--failover-replicas must be at least 2")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="vllm-disagg-bench-ha-"))
    report: dict[str, Any] = {"benchmark": "ha", "cpus": os.cpu_count(), "logs": str(logs), "runs": args.runs}
    if "failover" in args.parts:
        runs, samples = await _failover_part(args, logs)
        report["failover"] = {
            "replicas": args.failover_replicas,
            "lease_ttl_s": args.lease_ttl_s,
            "concurrency": args.failover_concurrency,
            "runs": [asdict(r) for r in runs],
            "median": _failover_medians(runs),
        }
        report["staleness"] = {"samples": [asdict(s) for s in samples], "median": _staleness_medians(samples)}
    if "throughput" in args.parts:
        rounds: list[ThroughputRound] = []
        traffic: list[Traffic] = []
        for n in range(args.runs):
            for name in args.configs:
                measured, idle = await measure_config(name, n, args, logs)
                rounds += measured
                traffic.append(idle)
        report["throughput"] = {
            "engines": "1P1D zero-delay sim",
            "concurrency": args.concurrency,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "prompt_chars": args.prompt_chars,
            "rounds": [asdict(r) for r in rounds],
            "median": _throughput_medians(rounds),
        }
        report["traffic"] = _traffic(traffic, rounds)
    return report


async def _failover_part(
    args: argparse.Namespace, logs: Path
) -> tuple[list[FailoverRun], list[StalenessSample]]:
    n = args.failover_replicas
    shape = Shape(n, lease_ttl_s=args.lease_ttl_s, spare=True, sim_timing=_SMALL_DELAY)
    cluster = HaCluster(shape, logs, "failover")
    runs: list[FailoverRun] = []
    try:
        await cluster.start(args.ready_timeout_s)
        samples = [
            await staleness_sample(cluster, k % n, (k + 1) % n, args.stale_tokens)
            for k in range(args.stale_samples)
        ]
        for k in range(args.runs):
            agreed = await cluster.ready(range(n), args.ready_timeout_s)
            assert agreed is not None
            run = await failover_run(
                cluster, agreed, concurrency=args.failover_concurrency, before_s=args.before_s, seed=k
            )
            runs.append(run)
            if k + 1 < args.runs:
                await cluster.restart(cluster.index_of(run.killed), args.ready_timeout_s)
    finally:
        await cluster.stop()
    return runs, samples


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _failover_medians(runs: list[FailoverRun]) -> dict[str, float]:
    keys = [k for k in FailoverRun.__dataclass_fields__ if k not in ("killed", "new_leader")]
    return {k: _median([float(getattr(r, k)) for r in runs]) for k in keys}


def _staleness_medians(samples: list[StalenessSample]) -> dict[str, float]:
    keys = ("start_lag_ms", "end_lag_ms", "a_start_ms", "poll_ms")
    medians = {k: _median([getattr(s, k) for s in samples]) for k in keys}
    medians |= {f"max_{k}": max((getattr(s, k) for s in samples), default=0.0) for k in keys[:2]}
    return medians


def _throughput_medians(rounds: list[ThroughputRound]) -> list[dict[str, Any]]:
    """Per configuration and scenario, the median of each figure over rounds."""
    fixed = ("config", "round", "stream", "unique", "requests")
    keys = [k for k in ThroughputRound.__dataclass_fields__ if k not in fixed]
    out = []
    for name in dict.fromkeys(r.config for r in rounds):
        for stream, unique in SCENARIOS:
            mine = [r for r in rounds if (r.config, r.stream, r.unique) == (name, stream, unique)]
            if mine:
                row: dict[str, Any] = {"config": name, "label": CONFIGS[name][0], "stream": stream}
                out.append(
                    row | {"unique": unique} | {k: _median([getattr(r, k) for r in mine]) for k in keys}
                )
    return out


def _traffic(idle: list[Traffic], rounds: list[ThroughputRound]) -> list[dict[str, Any]]:
    """Per configuration, the medians over rounds of an agent's bytes per second idle, and per request
    under load: with one prompt for all (``same``: plain and streamed) and a prompt each (``unique``)."""
    out = []
    for name in dict.fromkeys(t.config for t in idle):
        mine = [t for t in idle if t.config == name]
        row: dict[str, Any] = {"config": name, "orchestrators": mine[0].orchestrators}
        for key in ("idle_s", "agent_sent_bytes_per_s", "agent_received_bytes_per_s"):
            row[key] = _median([getattr(t, key) for t in mine])
        for unique, kind in ((False, "same"), (True, "unique")):
            loaded = [r for r in rounds if r.config == name and r.unique == unique]
            row[f"agent_sent_bytes_per_req_{kind}"] = _median([r.agent_sent_bytes_per_req for r in loaded])
            row[f"agent_received_bytes_per_req_{kind}"] = _median(
                [r.agent_received_bytes_per_req for r in loaded]
            )
            row[f"agent_sent_bytes_per_s_{kind}"] = _median(
                [r.agent_sent_bytes_per_req * r.rps for r in loaded]
            )
        out.append(row)
    return out


def render(report: dict[str, Any]) -> str:
    """The report as tables of medians."""
    lines = [f"bench ha on {report['cpus']} CPUs, medians of {report['runs']} runs; logs: {report['logs']}"]
    if "failover" in report:
        lines += _render_failover(report["failover"], report["staleness"])
    if "throughput" in report:
        lines += _render_throughput(report["throughput"], report["traffic"])
    return "\n".join(lines)


def _render_failover(failover: dict[str, Any], staleness: dict[str, Any]) -> list[str]:
    m, s = failover["median"], staleness["median"]
    lines = [
        "",
        f"failover: {failover['replicas']} replicas, lease TTL {failover['lease_ttl_s']} s, "
        f"{failover['concurrency']} streams in flight; the leader SIGKILLed",
        f"{'run':>4} {'failover s':>10} {'survivors failed':>16} {'victim in flight/failed':>23} "
        f"{'admin 503s':>10} {'before p50/p99 ms':>18} {'during p50/p99 ms':>18}",
    ]
    rows = [(str(i), r) for i, r in enumerate(failover["runs"])] + [("med", m)]
    for name, r in rows:
        lines.append(
            f"{name:>4} {r['failover_s']:>10.3f} "
            f"{r['survivors_failed']:>7.0f} of {r['survivors_requests']:<6.0f} "
            f"{r['victim_in_flight']:>12.0f} / {r['victim_failed']:<8.0f} {r['admin_writes_refused']:>10.0f} "
            f"{r['before_p50_ms']:>8.1f}/{r['before_p99_ms']:<9.1f} "
            f"{r['during_p50_ms']:>8.1f}/{r['during_p99_ms']:<9.1f}"
        )
    lines.append(
        f"in-flight staleness across replicas ({len(staleness['samples'])} samples; one admin poll "
        f"{s['poll_ms']:.1f} ms): a request's start seen {s['start_lag_ms']:.1f} ms later on the other "
        f"replica (max {s['max_start_lag_ms']:.1f}), its end {s['end_lag_ms']:.1f} ms later "
        f"(max {s['max_end_lag_ms']:.1f})"
    )
    return lines


def _render_throughput(throughput: dict[str, Any], traffic: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        f"throughput: {throughput['engines']}, concurrency {throughput['concurrency']}, "
        f"{throughput['requests']} requests a round, {throughput['max_tokens']} output tokens",
        f"{'control plane':<32} {'stream':>6} {'prompts':>7} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'orch cpu/req ms':>15} {'agents':>7} {'etcd':>6}",
    ]
    for r in throughput["median"]:
        lines.append(
            f"{r['label']:<32} {'yes' if r['stream'] else 'no':>6} {'unique' if r['unique'] else 'same':>7} "
            f"{r['rps']:>7.0f} {r['p50_ms']:>8.2f} "
            f"{r['p99_ms']:>8.2f} {r['orchestrators_cpu_ms_per_req']:>15.3f} "
            f"{r['agents_cpu_ms_per_req']:>7.3f} {r['etcd_cpu_ms_per_req']:>6.3f}"
        )
    lines += [
        "",
        "an agent's bytes to the orchestrators (all of them together): idle, and under load with one",
        "prompt for all requests (same) or a prompt each (unique: KV events)",
        f"{'control plane':<32} {'orchs':>5} {'idle B/s':>9} {'same B/req':>10} {'unique B/req':>12} "
        f"{'unique B/s':>11}",
    ]
    for t in traffic:
        label = CONFIGS[t["config"]][0]
        lines.append(
            f"{label:<32} {t['orchestrators']:>5} {t['agent_sent_bytes_per_s']:>9.0f} "
            f"{t['agent_sent_bytes_per_req_same']:>10.1f} {t['agent_sent_bytes_per_req_unique']:>12.1f} "
            f"{t['agent_sent_bytes_per_s_unique']:>11.0f}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print tables, or JSON with ``--json``."""
    report = asyncio_run(run_benchmark(args))
    print(jsonutil.dumps(report).decode() if args.json else render(report), file=sys.stdout)
    return 0
