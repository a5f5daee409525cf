"""``bench goodput --scenario admission`` and ``--scenario tenants``: the gateway's admission queue
(docs/admission.md) past capacity, on the sweep's simulated 4P4D cluster and trace (goodput.py).

Every request carries its targets (``x-slo-ttft-ms``, ``x-slo-tpot-ms``: ``--ttft-ms``, ``--tpot-ms``),
a priority in the body (``--priorities`` in ``--priority-shares``: vLLM's numbers, lower is sooner,
``>= 1`` the sheddable class) and a tenant (``x-tenant-id``), drawn per request from the seed, so
request *i* has the same class and tenant at every rate and in every arm. Arms: ``admission-off``
and ``admission-on`` (``--admission off|on``), the cluster otherwise as the sweep's "before" (no
planner: the capacity holds still).

- **admission**: the *base rate* is where attainment without admission is 75% (``--base-rate``, or
  ``auto``: found first by a sweep of ``admission-off`` over ``--rates``); both arms then run at
  ``--multipliers`` times it. Past the base rate goodput should stay within 90% of the best at any
  lower rate, the top class attain 95%, and the sheddable class be refused first.
- **tenants**: one class (priority 0); tenant A sends at its share (``--share-rps``: by default half
  the goodput at the base rate without admission, 75% of it) and tenant B at ``--flood`` (3) times
  that, with equal weights; A should attain 95%.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import itertools
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.goodput import TraceRequest, cluster_spec, make_trace, serving, trace_spec
from vllm_disagg.bench.goodput_admission_report import (
    TARGET_ATTAINMENT,
    AdmissionPoint,
    Outcome,
    Verdict,
    median_point,
    next_rate,
    rate_at_attainment,
    render_points,
    render_slices,
    render_sweep,
    render_totals,
    render_verdicts,
    summarise,
    tenant_verdicts,
    verdicts,
)
from vllm_disagg.bench.streams import time_stream
from vllm_disagg.cli.up import ClusterSpec
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import SHED_REASON_HEADER, ConfigError
from vllm_disagg.orchestrator.gateway.slo import TPOT_HEADER, TTFT_HEADER
from vllm_disagg.runtime import asyncio_run

SCENARIOS = ("arms", "admission", "tenants")
ARMS = ("admission-off", "admission-on")
# Where attainment without admission is 75% on this cluster and trace, measured with --base-rate auto
# (docs/benchmarks.md, "Admission": 77.0% at 15 req/s, 50.0% at 17). Another machine, or other flags,
# need --base-rate auto.
DEFAULT_BASE_RATE = 15.1
SHEDDABLE = AdmissionConfig().sheddable_priority  # the cluster runs with the default
STEADY, FLOOD = "tenant-a", "tenant-b"
SEARCH_STEPS = 3  # rates added to --rates at most, while they do not bracket 75%
_TENANT_HEADER = AdmissionConfig().tenant_header


def _base_rate(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 or 'auto', got {text!r}")
    return rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the admission scenarios (``bench goodput``'s own are in goodput.py)."""
    parser.add_argument(
        "--scenario", choices=SCENARIOS, default="arms",
        help="arms: the sweep of --arms; admission: admission off and on past the base rate; "
        "tenants: one tenant flooding while another stays at its share",
    )  # fmt: skip
    parser.add_argument(
        "--base-rate", type=_base_rate, default=DEFAULT_BASE_RATE,
        help=f"req/s where attainment without admission is 75%% (default {DEFAULT_BASE_RATE:g}, measured "
        "here); auto: found by a sweep of admission-off over --rates first",
    )  # fmt: skip
    parser.add_argument(
        "--multipliers", type=float, nargs="+", default=[1.0, 1.5, 2.0],
        help="admission: the rates run, as multiples of the base rate",
    )  # fmt: skip
    parser.add_argument(
        "--priorities", type=int, nargs="+", default=[-1, 0, 1],
        help="admission: the requests' priorities (vLLM's: lower is sooner; >= 1: sheddable)",
    )  # fmt: skip
    parser.add_argument(
        "--priority-shares", type=float, nargs="+", default=[0.2, 0.6, 0.2],
        help="admission: the share of the requests at each of --priorities",
    )  # fmt: skip
    parser.add_argument("--admission-arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument(
        "--share-rps", type=float, default=None,
        help="tenants: tenant A's rate, its share (default: half the goodput at the base rate without "
        "admission, base rate x 0.75 / 2)",
    )  # fmt: skip
    parser.add_argument("--flood", type=float, default=3.0, help="tenants: tenant B's rate over its share")


# -- the requests -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Labelled:
    """A request of the trace with its class and tenant."""

    request: TraceRequest
    priority: int = 0
    tenant: str = "default"


def _cdf(shares: Sequence[tuple[object, float]]) -> list[float]:
    total = sum(share for _, share in shares)
    return list(itertools.accumulate(share / total for _, share in shares))


def _pick(rng: random.Random, cdf: Sequence[float]) -> int:
    return min(bisect.bisect_right(cdf, rng.random()), len(cdf) - 1)


def label(
    trace: Sequence[TraceRequest],
    seed: int,
    priorities: Sequence[tuple[int, float]] = ((0, 1.0),),
    tenants: Sequence[tuple[str, float]] = (("default", 1.0),),
) -> list[Labelled]:
    """Each request's priority and tenant, drawn with the given shares: request *i* draws the same at
    every rate (one generator per aspect, in trace order). Drawing a tenant per request splits Poisson
    arrivals into independent Poisson streams, each at its share of the rate."""
    out = []
    pick_p, pick_t = (random.Random(f"bench-goodput/{seed}/{aspect}") for aspect in ("priority", "tenant"))
    p_cdf, t_cdf = _cdf(priorities), _cdf(tenants)
    for request in trace:
        out.append(Labelled(request, priorities[_pick(pick_p, p_cdf)][0], tenants[_pick(pick_t, t_cdf)][0]))
    return out


async def one(
    session: aiohttp.ClientSession, url: str, item: Labelled, args: argparse.Namespace, start: float
) -> Outcome:
    """One streamed completion at its time, with its targets, priority and tenant, as its client saw it."""
    request = item.request
    await asyncio.sleep(max(0.0, start + request.at_s - time.perf_counter()))
    body = {
        "model": "sim-model", "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
        "priority": item.priority,
    }  # fmt: skip
    headers = {
        "Content-Type": "application/json", _TENANT_HEADER: item.tenant,
        TTFT_HEADER: f"{args.ttft_ms:g}", TPOT_HEADER: f"{args.tpot_ms:g}",
    }  # fmt: skip
    seen = Outcome(request.at_s, item.priority, item.tenant, 0, False)
    t0 = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/completions", data=jsonutil.dumps(body), headers=headers,
            timeout=aiohttp.ClientTimeout(total=args.request_timeout_s),
        ) as resp:  # fmt: skip
            seen = dataclasses.replace(seen, status=resp.status)
            if resp.status != 200:
                await resp.read()
                return dataclasses.replace(seen, shed_reason=resp.headers.get(SHED_REASON_HEADER, ""))
            timing = await time_stream(resp, t0)
    except (aiohttp.ClientError, TimeoutError):
        return seen  # the status it had, if any: the stream was cut or never came
    ok = timing.tokens == request.max_tokens
    return dataclasses.replace(seen, ok=ok, ttft_s=timing.ttft_s, tpot_s=timing.tpot_s)


def admission_spec(arm: str, args: argparse.Namespace) -> ClusterSpec:
    """The sweep's "before" cluster (no planner, no default targets: each request carries its own),
    with the gateway's admission queue off or on."""
    spec = cluster_spec("before", args, "")
    return dataclasses.replace(spec, extra_orchestrator_args=("--admission", arm.removeprefix("admission-")))


async def run_point(
    arm: str,
    rate: float,
    multiplier: float,
    items: Sequence[Labelled],
    args: argparse.Namespace,
    log: IO[bytes],
) -> AdmissionPoint:
    """A fresh cluster for one arm, the labelled trace at ``rate`` through it (open loop)."""
    spec = admission_spec(arm, args)
    async with serving(spec, log) as session:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(session, spec.base_url, i, args, start) for i in items))
    window = args.duration_s - args.warmup_s
    return summarise(
        arm, rate, multiplier, outcomes,
        ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, warmup_s=args.warmup_s, window_s=window,
    )  # fmt: skip


# -- the scenarios ------------------------------------------------------------------------------

Plan = list[tuple[str, float, float, list[Labelled]]]  # (arm, rate, multiplier, requests) per point


def run_plan(plan: Plan, args: argparse.Namespace) -> list[AdmissionPoint]:
    """Every point of ``plan`` in each of ``--rounds`` rounds (a machine that slows down slows every
    point of a round alike); the medians over rounds, in the plan's order."""
    per_point: dict[tuple[str, float], list[AdmissionPoint]] = {}
    # The processes' output is kept where the error names it when a point fails; removed otherwise.
    logs = tempfile.mkdtemp(prefix="bench-goodput-admission-")
    for _ in range(args.rounds):
        for arm, rate, multiplier, items in plan:
            with open(os.path.join(logs, f"{arm}-{rate:g}.log"), "wb") as log:
                point = asyncio_run(run_point(arm, rate, multiplier, items, args, log))
            per_point.setdefault((arm, rate), []).append(point)
    shutil.rmtree(logs, ignore_errors=True)
    return [median_point(rounds) for rounds in per_point.values()]


def find_base_rate(args: argparse.Namespace) -> tuple[float, list[AdmissionPoint]]:
    """The rate where attainment without admission is 75%, from a sweep of ``admission-off`` over
    ``--rates`` with the scenario's classes, extended by up to ``SEARCH_STEPS`` rates while they do not
    bracket 75% (the given ``--base-rate`` when not ``auto``)."""
    if args.base_rate is not None:
        return args.base_rate, []
    spec = trace_spec(args)

    def sweep_at(rates: Sequence[float]) -> list[AdmissionPoint]:
        items = {r: label(make_trace(spec, r, args.duration_s), args.seed, _mix(args)) for r in rates}
        return run_plan([("admission-off", r, 0.0, items[r]) for r in rates], args)

    sweep = sweep_at(args.rates)
    for _ in range(SEARCH_STEPS):
        rate = next_rate((p.rate, p.total.attainment) for p in sweep)
        if rate is None:
            break
        sweep += sweep_at([rate])
    try:
        base = rate_at_attainment((p.rate, p.total.attainment) for p in sweep)
    except ValueError as exc:
        raise ConfigError(f"--base-rate auto: {exc}\n" + "\n".join(render_sweep(sweep))) from None
    return base, sweep


def _mix(args: argparse.Namespace) -> list[tuple[int, float]]:
    """(priority, share) pairs of ``--priorities`` and ``--priority-shares``."""
    if len(args.priorities) != len(args.priority_shares):
        raise ConfigError("need one --priority-shares value per --priorities value")
    if any(s < 0 for s in args.priority_shares) or not sum(args.priority_shares) > 0:
        raise ConfigError("need --priority-shares >= 0, one of them > 0")
    return list(zip(args.priorities, args.priority_shares, strict=True))


def _header(args: argparse.Namespace, what: str) -> str:
    return (
        f"bench goodput --scenario {args.scenario}: {args.prefill}P{args.decode}D simulated, "
        f"seed {args.seed}, {args.duration_s:g} s per point ({args.warmup_s:g} s warm-up), "
        f"targets TTFT {args.ttft_ms:g} ms and TPOT {args.tpot_ms:g} ms (sent as headers), {what}; "
        f"medians over {args.rounds} round(s)"
    )


def run_admission(args: argparse.Namespace) -> dict[str, Any]:
    """The admission scenario: the base rate, then both arms at its multiples."""
    base, sweep = find_base_rate(args)
    spec = trace_spec(args)
    plan: Plan = []
    for m in sorted(set(args.multipliers)):
        rate = round(base * m, 2)
        items = label(make_trace(spec, rate, args.duration_s), args.seed, _mix(args))
        plan += [(arm, rate, m, items) for arm in args.admission_arms]
    points = run_plan(plan, args)
    found = verdicts(points, SHEDDABLE)
    mix = ", ".join(f"priority {p} {s:.0%}" for p, s in _mix(args))
    lines = [_header(args, f"base rate {base:g} req/s, {mix} (>= {SHEDDABLE}: sheddable)")]
    if sweep:
        lines += ["", "the sweep without admission:", *render_sweep(sweep), f"75% attained at {base:g} req/s"]
    lines += ["", *render_points(points), "", *render_verdicts(found)]
    return {
        "scenario": "admission", "base_rate": base, "sweep": [point_json(p) for p in sweep],
        "points": [point_json(p) for p in points], "verdicts": [_json_verdict(v) for v in found],
        "table": "\n".join(lines),
    }  # fmt: skip


def run_tenants(args: argparse.Namespace) -> dict[str, Any]:
    """The tenants scenario: A at its share, B at ``--flood`` times it, equal weights, both arms."""
    base, sweep = (0.0, []) if args.share_rps is not None else find_base_rate(args)
    share = args.share_rps if args.share_rps is not None else round(base * TARGET_ATTAINMENT / 2, 2)
    if not share > 0 or not args.flood > 0:
        raise ConfigError("need --share-rps > 0 and --flood > 0")
    rate = round(share * (1 + args.flood), 2)
    trace = make_trace(trace_spec(args), rate, args.duration_s)
    items = label(trace, args.seed, tenants=((STEADY, 1.0), (FLOOD, args.flood)))
    points = run_plan([(arm, rate, 0.0, items) for arm in args.admission_arms], args)
    found = tenant_verdicts(points, STEADY)
    what = f"{STEADY} at {share:g} req/s (its share), {FLOOD} at {share * args.flood:g} ({args.flood:g}x)"
    lines = [_header(args, what + ", equal weights, priority 0")]
    if sweep:
        lines += ["", "the sweep without admission:", *render_sweep(sweep), f"75% attained at {base:g} req/s"]
    lines += ["", *render_totals(points), "", *render_slices(points, "tenant", lambda p: p.tenants)]
    lines += ["", *render_verdicts(found)]
    return {
        "scenario": "tenants", "share_rps": share, "flood": args.flood,
        "sweep": [point_json(p) for p in sweep], "points": [point_json(p) for p in points],
        "verdicts": [_json_verdict(v) for v in found], "table": "\n".join(lines),
    }  # fmt: skip


def point_json(point: AdmissionPoint) -> dict[str, Any]:
    """A point as JSON-ready values (priorities as string keys)."""
    out = dataclasses.asdict(point)
    out["classes"] = {str(k): v for k, v in out["classes"].items()}  # JSON keys are strings
    return out


def _json_verdict(v: Verdict) -> dict[str, Any]:
    return {**dataclasses.asdict(v), "met": v.met}


def run(args: argparse.Namespace) -> int:
    """Run ``--scenario`` (admission or tenants); print its tables (or JSON)."""
    if not 0 <= args.warmup_s < args.duration_s or args.rounds < 1:
        raise ConfigError("need 0 <= --warmup-s < --duration-s and --rounds >= 1")
    if any(m <= 0 for m in args.multipliers):
        raise ConfigError("need --multipliers > 0")
    _mix(args)
    report = run_admission(args) if args.scenario == "admission" else run_tenants(args)
    table = report.pop("table")
    print(jsonutil.dumps({"benchmark": "goodput", **report}).decode() if args.json else table)
    return 0
