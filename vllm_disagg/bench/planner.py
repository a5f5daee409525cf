"""``vllm-disagg bench planner``: a workload that moves from long prompts to long outputs, on a
simulated 3P3D cluster, with the planner shifting roles and with the split held static.

Each arm starts its own local cluster of simulated engines (real processes: orchestrator, agents,
engines) whose timing model makes prompts cost prefill time and batches cost decode time. Closed-loop
clients stream completions: first ``--phase-s`` seconds of long prompts with short outputs (the
prefill pool is short), then as long of short prompts with long outputs (the decode pool is short).
Each request's TTFT (first byte) and TPOT (between the first and the last token) are measured by the
client against ``--ttft-ms`` and ``--tpot-ms``. The table gives, per arm and phase, the requests,
the attainment (both targets met), the goodput (requests meeting both, per second), TTFT and TPOT p90,
over the whole phase and over its second half (after the planner had time to act), and the shifts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.compare import percentile
from vllm_disagg.bench.streams import time_stream
from vllm_disagg.cli.up import ClusterSpec, LocalCluster
from vllm_disagg.runtime import asyncio_run

_JSON = {"Content-Type": "application/json"}
PHASES = (("long prompts", 1800, 8), ("long outputs", 64, 96))  # (name, prompt chars = tokens, max_tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench planner``."""
    parser.add_argument("--prefill", type=int, default=3)
    parser.add_argument("--decode", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=40.0, help="seconds of each workload phase")
    parser.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--ttft-ms", type=float, default=600.0, help="TTFT target")
    parser.add_argument("--tpot-ms", type=float, default=20.0, help="TPOT target")
    parser.add_argument("--port", type=int, default=18600, help="gateway port (engines use the next ones)")
    parser.add_argument("--arms", nargs="+", choices=("static", "planner"), default=["static", "planner"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


@dataclass
class Sample:
    """One request as the client saw it."""

    phase: int
    started: float  # seconds since the phase began
    ok: bool
    ttft_s: float
    tpot_s: float


@dataclass
class PhaseResult:
    """One phase of one arm (``late``: its second half only)."""

    arm: str
    phase: str
    window: str
    requests: int
    failed: int
    attainment: float
    goodput_rps: float
    ttft_p90_ms: float
    tpot_p90_ms: float


@dataclass
class ArmResult:
    arm: str
    phases: list[PhaseResult] = field(default_factory=list)
    shifts: list[dict[str, Any]] = field(default_factory=list)


def planner_yaml(dry_run: bool, args: argparse.Namespace) -> str:
    return (
        "apiVersion: vllm-disagg/v1alpha1\nkind: PlannerConfig\n"
        f"dryRun: {str(dry_run).lower()}\nintervalS: 1\nwindowS: 8\nsustain: 2\ncooldownS: 4\n"
        f"minSamples: 10\nttftTargetS: {args.ttft_ms / 1000}\ntpotTargetS: {args.tpot_ms / 1000}\n"
    )


async def one(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> tuple[bool, float, float]:
    """(ok, TTFT, TPOT) of one streamed completion."""
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", data=jsonutil.dumps(body), headers=_JSON) as resp:
        if resp.status != 200:
            await resp.read()
            return False, 0.0, 0.0
        timing = await time_stream(resp, t0)
    return timing.tokens > 0, timing.ttft_s, timing.tpot_s


async def run_arm(arm: str, args: argparse.Namespace, config: str) -> ArmResult:
    """One cluster (its planner configured by the file ``config``), both phases, its planner's record."""
    spec = ClusterSpec(
        engine="sim", model="sim-model", prefill=args.prefill, decode=args.decode,
        port=args.port, zmq_port=args.port + 1, engine_base_port=args.port + 2, stop_grace_s=5.0,
        sim_timing=(
            ("prefill_s_per_token", "0.0001"), ("decode_step_s", "0.004"),
            ("decode_step_s_per_seq", "0.0015"), ("max_num_seqs", "64"),
        ),
        extra_orchestrator_args=("--planner-config", config),
    )  # fmt: skip
    cluster = LocalCluster(spec)
    result = ArmResult(arm)
    try:
        await cluster.start()
        if not await cluster.wait_ready(120.0):
            raise RuntimeError("the benchmark cluster did not become ready")
        samples: list[Sample] = []
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for index, (_, chars, max_tokens) in enumerate(PHASES):
                await _phase(session, spec.base_url, index, chars, max_tokens, args, samples)
            headers = {"Authorization": f"Bearer {spec.admin_token}"}
            async with session.get(f"{spec.base_url}/admin/v1/planner", headers=headers) as resp:
                result.shifts = list((await resp.json()).get("shifts", []))
        result.phases = summarise(arm, samples, args)
    finally:
        await cluster.stop()
    return result


async def _phase(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    chars: int,
    max_tokens: int,
    args: argparse.Namespace,
    samples: list[Sample],
) -> None:
    start = time.perf_counter()
    deadline = start + args.phase_s
    counter = [0]

    async def client(n: int) -> None:
        while time.perf_counter() < deadline:
            counter[0] += 1
            # A prefix of its own per request: nothing is a prefix-cache hit, each prompt costs its prefill.
            prompt = f"{index}-{n}-{counter[0]} " + "x" * chars
            began = time.perf_counter() - start
            try:
                ok, ttft, tpot = await one(session, url, prompt[:chars], max_tokens)
            except (aiohttp.ClientError, TimeoutError):
                ok, ttft, tpot = False, 0.0, 0.0
            samples.append(Sample(index, began, ok, ttft, tpot))

    await asyncio.gather(*(client(n) for n in range(args.clients)))


def summarise(arm: str, samples: list[Sample], args: argparse.Namespace) -> list[PhaseResult]:
    """Per phase, over the whole phase and over its second half."""
    out = []
    for index, (name, _, _) in enumerate(PHASES):
        for window, since in (("whole", 0.0), ("2nd half", args.phase_s / 2)):
            rows = [s for s in samples if s.phase == index and s.started >= since]
            good = [s for s in rows if s.ok]
            met = [s for s in good if s.ttft_s * 1000 <= args.ttft_ms and s.tpot_s * 1000 <= args.tpot_ms]
            span = args.phase_s - since
            out.append(
                PhaseResult(
                    arm=arm,
                    phase=name,
                    window=window,
                    requests=len(rows),
                    failed=len(rows) - len(good),
                    attainment=round(len(met) / len(rows), 3) if rows else 0.0,
                    goodput_rps=round(len(met) / span, 2),
                    ttft_p90_ms=round(percentile([s.ttft_s for s in good], 0.9) * 1000, 1) if good else 0.0,
                    tpot_p90_ms=round(percentile([s.tpot_s for s in good], 0.9) * 1000, 1) if good else 0.0,
                )
            )
    return out


def render(results: list[ArmResult], args: argparse.Namespace) -> str:
    lines = [
        f"bench planner: {args.prefill}P{args.decode}D simulated, {args.clients} clients, {args.phase_s:g} s "
        f"per phase, targets TTFT {args.ttft_ms:g} ms and TPOT {args.tpot_ms:g} ms",
        "| arm | phase | window | requests | failed | attainment | goodput req/s | TTFT p90 ms "
        "| TPOT p90 ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in results:
        for p in arm.phases:
            lines.append(
                f"| {p.arm} | {p.phase} | {p.window} | {p.requests} | {p.failed} | {p.attainment:.1%} | "
                f"{p.goodput_rps} | {p.ttft_p90_ms} | {p.tpot_p90_ms} |"
            )
    for arm in results:
        moves = [f"{s['instance']} {s['from']}->{s['to']} ({s['outcome']})" for s in arm.shifts]
        lines.append(f"{arm.arm}: shifts {', '.join(moves) if moves else 'none'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run each arm in turn; print the table (or JSON)."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms:
            config = os.path.join(tmp, f"{arm}.yaml")
            with open(config, "w", encoding="utf-8") as f:
                f.write(planner_yaml(arm == "static", args))
            results.append(asyncio_run(run_arm(arm, args, config)))
    if args.json:
        print(jsonutil.dumps({"benchmark": "planner", "arms": [asdict(r) for r in results]}).decode())
    else:
        print(render(results, args))
    return 0
