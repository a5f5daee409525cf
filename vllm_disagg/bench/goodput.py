"""``vllm-disagg bench goodput``: goodput and SLO attainment against offered load, on a simulated
cluster, with today's scheduler ("before") and with the planner and the SLO-aware path ("after").

A seeded open-loop trace: Poisson arrivals at each ``--rates`` rate; every request is one of
``--documents`` shared documents, chosen by Zipf popularity, followed by a question of its own, and
asks for a seeded number of output tokens. The trace at a rate is the same requests with the same
unit-rate gaps scaled by ``1 / rate``, and both arms get exactly the same trace. Each (arm, rate) point
starts a fresh cluster of simulated engines (real processes: orchestrator, agents, engines), so no
point inherits another's caches or roles. Each request's TTFT (first token) and TPOT (between the
first and the last token) are measured by the client; a request meets its SLO when both are within
``--ttft-ms`` and ``--tpot-ms``, a failed one never does. Attainment is the share meeting both, goodput
the requests meeting both per second of the measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.compare import percentile
from vllm_disagg.bench.streams import time_stream
from vllm_disagg.cli.up import ClusterSpec, LocalCluster, spawn
from vllm_disagg.errors import ConfigError
from vllm_disagg.runtime import asyncio_run

_JSON = {"Content-Type": "application/json"}
# "before": as shipped; "after": the planner shifting and the SLO targets on. The other two are "after"
# with one of its parts alone, to tell which part did what.
ARMS = ("before", "after", "planner-only", "slo-only")
TARGET_ATTAINMENT = 0.75  # the load compared: where "before" attains about this much (docs/planner.md)
_WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "lambda", "omega", "sigma", "theta", "zeta")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench goodput``."""
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--rates", type=float, nargs="+", default=[8.0, 11.0, 14.0, 17.0], help="req/s")
    parser.add_argument("--duration-s", type=float, default=50.0, help="seconds of arrivals per point")
    parser.add_argument("--warmup-s", type=float, default=20.0, help="first seconds sent but not counted")
    parser.add_argument("--rounds", type=int, default=1, help="repeats of the sweep; the table has medians")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", type=int, default=100_000, help="shared documents")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of document popularity")
    parser.add_argument("--doc-tokens", type=int, nargs=2, default=[400, 1600], metavar=("MIN", "MAX"))
    parser.add_argument("--question-tokens", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[32, 160], metavar=("MIN", "MAX"))
    parser.add_argument("--ttft-ms", type=float, default=1000.0, help="TTFT target")
    parser.add_argument("--tpot-ms", type=float, default=50.0, help="TPOT target")
    parser.add_argument("--request-timeout-s", type=float, default=60.0, help="a slower request failed")
    parser.add_argument("--port", type=int, default=18800, help="gateway port (engines use the next ones)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS[:2]))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


# -- the trace ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Everything a trace is drawn from: the same spec and seed give the same requests."""

    seed: int = 0
    documents: int = 100_000
    zipf: float = 1.1
    doc_tokens: tuple[int, int] = (400, 1600)
    question_tokens: tuple[int, int] = (32, 128)
    output_tokens: tuple[int, int] = (32, 160)

    def __post_init__(self) -> None:
        if self.documents < 1 or self.zipf < 0:
            raise ConfigError(f"need --documents >= 1 and --zipf >= 0, got {self.documents}, {self.zipf}")
        for name in ("doc_tokens", "question_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"--{name.replace('_', '-')}: need 1 <= MIN <= MAX, got {low}, {high}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: when it arrives (seconds after the start), its document, its prompt."""

    at_s: float
    doc: int  # 0 is the most popular
    prompt: str
    max_tokens: int


def _rng(spec: TraceSpec, stream: str) -> random.Random:
    # One generator per aspect, so that changing, say, the output lengths leaves the arrivals as they were.
    return random.Random(f"bench-goodput/{spec.seed}/{stream}")


def zipf_cdf(n: int, exponent: float) -> list[float]:
    """Cumulative probabilities of ranks 1..n with weights ``1 / rank ** exponent``."""
    weights = [1.0 / (rank**exponent) for rank in range(1, n + 1)]
    total = sum(weights)
    cdf, acc = [], 0.0
    for w in weights:
        acc += w / total
        cdf.append(acc)
    cdf[-1] = 1.0
    return cdf


def document(spec: TraceSpec, k: int) -> str:
    """Shared document ``k`` (0 is the most popular): it opens with its id, so that no two share a
    cached block, and has a seeded length; drawn on its own, so a trace makes only those it uses."""
    rng = random.Random(f"bench-goodput/{spec.seed}/document/{k}")
    length = rng.randint(*spec.doc_tokens)
    words = [f"[document {k}]"]
    size = len(words[0])
    while size < length:
        words.append(f"{rng.choice(_WORDS)}{rng.randrange(1000)}")
        size += len(words[-1]) + 1
    return " ".join(words)[:length]


def make_trace(spec: TraceSpec, rate: float, duration_s: float) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` for ``duration_s``. Request i is the same at every rate (same
    document, question and output length) and arrives at (its unit-rate time) / ``rate``."""
    if rate <= 0 or duration_s <= 0:
        raise ConfigError(f"need rates > 0 and --duration-s > 0, got {rate}, {duration_s}")
    docs: dict[int, str] = {}
    cdf = zipf_cdf(spec.documents, spec.zipf)
    gaps, picks, questions, outputs = (
        _rng(spec, s) for s in ("arrivals", "popularity", "questions", "outputs")
    )
    trace: list[TraceRequest] = []
    unit = gaps.expovariate(1.0)
    while unit / rate < duration_s:
        i = len(trace)
        doc = min(bisect.bisect_left(cdf, picks.random()), spec.documents - 1)
        length = questions.randint(*spec.question_tokens)
        question = f"\nQuestion {i}: " + "".join(questions.choice("abcdefghij ") for _ in range(length))
        if doc not in docs:
            docs[doc] = document(spec, doc)
        prompt = docs[doc] + question[:length]
        trace.append(TraceRequest(unit / rate, doc, prompt, outputs.randint(*spec.output_tokens)))
        unit += gaps.expovariate(1.0)
    return trace


# -- measuring ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it."""

    at_s: float  # scheduled arrival, seconds after the trace began
    ok: bool
    ttft_s: float
    tpot_s: float
    mode: str = ""  # X-Disagg-Mode: disaggregated or colocated


@dataclass
class Point:
    """One arm at one offered load (one round, or the medians over rounds)."""

    arm: str
    rate: float
    requests: int
    failed: int
    met: int
    attainment: float
    goodput_rps: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    colocated: float  # share of the requests served colocated
    whole_attainment: float = 0.0  # over every request, the warm-up's included
    rounds: int = 1
    goodput_range: tuple[float, float] = (0.0, 0.0)  # min and max over rounds
    shifts: list[str] = field(default_factory=list)


def meets(sample: Sample, ttft_ms: float, tpot_ms: float) -> bool:
    """Both targets met; a failed request never meets them."""
    return sample.ok and sample.ttft_s * 1000 <= ttft_ms and sample.tpot_s * 1000 <= tpot_ms


def summarise(
    arm: str, rate: float, samples: Sequence[Sample], args: argparse.Namespace, shifts: Sequence[str] = ()
) -> Point:
    """The point's figures over the requests that arrived after the warm-up."""
    rows = [s for s in samples if s.at_s >= args.warmup_s]
    good = [s for s in rows if s.ok]
    met = sum(1 for s in rows if meets(s, args.ttft_ms, args.tpot_ms))
    met_all = sum(1 for s in samples if meets(s, args.ttft_ms, args.tpot_ms))
    window = max(args.duration_s - args.warmup_s, 1e-9)
    goodput = round(met / window, 3)
    return Point(
        arm=arm,
        rate=rate,
        requests=len(rows),
        failed=len(rows) - len(good),
        met=met,
        attainment=round(met / len(rows), 4) if rows else 0.0,
        goodput_rps=goodput,
        ttft_p90_ms=round(percentile([s.ttft_s for s in good], 0.9) * 1000, 1) if good else 0.0,
        tpot_p90_ms=round(percentile([s.tpot_s for s in good], 0.9) * 1000, 1) if good else 0.0,
        colocated=round(sum(1 for s in rows if s.mode == "colocated") / len(rows), 3) if rows else 0.0,
        whole_attainment=round(met_all / len(samples), 4) if samples else 0.0,
        goodput_range=(goodput, goodput),
        shifts=list(shifts),
    )


def median_point(rounds: Sequence[Point]) -> Point:
    """The medians over rounds of one (arm, rate); the goodput's min and max beside."""
    first = rounds[0]

    def med(name: str) -> float:
        return round(float(statistics.median(getattr(p, name) for p in rounds)), 4)

    goodputs = [p.goodput_rps for p in rounds]
    return Point(
        arm=first.arm,
        rate=first.rate,
        requests=round(med("requests")),
        failed=round(med("failed")),
        met=round(med("met")),
        attainment=med("attainment"),
        goodput_rps=med("goodput_rps"),
        ttft_p90_ms=med("ttft_p90_ms"),
        tpot_p90_ms=med("tpot_p90_ms"),
        colocated=med("colocated"),
        whole_attainment=med("whole_attainment"),
        rounds=len(rounds),
        goodput_range=(min(goodputs), max(goodputs)),
        shifts=[s for p in rounds for s in p.shifts],
    )


@dataclass(frozen=True, slots=True)
class Knee:
    """The offered load where "before" attains closest to ``TARGET_ATTAINMENT``, and "after" there."""

    rate: float
    before_attainment: float
    after_attainment: float
    before_goodput: float
    after_goodput: float

    @property
    def gain(self) -> float:
        """After's goodput over before's, minus one (0.15: 15% more)."""
        return self.after_goodput / self.before_goodput - 1 if self.before_goodput > 0 else float("inf")


def knee(points: Sequence[Point]) -> Knee | None:
    """The rate where "before" attains closest to 75% (the lower rate on a tie); None without both arms."""
    before = {p.rate: p for p in points if p.arm == "before"}
    after = {p.rate: p for p in points if p.arm == "after"}
    rates = sorted(set(before) & set(after))
    if not rates:
        return None
    rate = min(rates, key=lambda r: (abs(before[r].attainment - TARGET_ATTAINMENT), r))
    b, a = before[rate], after[rate]
    return Knee(rate, b.attainment, a.attainment, b.goodput_rps, a.goodput_rps)


# -- the clusters -------------------------------------------------------------------------------


def planner_yaml(args: argparse.Namespace) -> str:
    """The "after" arm's planner: it shifts (not dry run), and looks often enough for a short run. The
    cooldown outlasts the window, so the look after a shift judges the new split on requests served
    since, not on the queue the old split left behind (which would move one instance too many)."""
    return (
        "apiVersion: vllm-disagg/v1alpha1\nkind: PlannerConfig\n"
        "dryRun: false\nintervalS: 1\nwindowS: 5\nsustain: 2\ncooldownS: 6\nminSamples: 10\n"
        f"ttftTargetS: {args.ttft_ms / 1000}\ntpotTargetS: {args.tpot_ms / 1000}\n"
    )


def cluster_spec(arm: str, args: argparse.Namespace, planner_config: str) -> ClusterSpec:
    """``--prefill``P``--decode``D (4P4D) of simulated engines. Prefill costs 0.4 ms per uncached prompt
    token (a 1,000-token document 0.4 s), a decode step 12 ms + 0.8 ms per running request, pulling KV
    10 us per token; 4,096 KV blocks of 16 tokens each. "before": the orchestrator as shipped (no SLO
    targets, the planner advisory); "after": the SLO targets as every request's default and the
    planner shifting; "planner-only" and "slo-only": one of the two."""
    planner = ("--planner-config", planner_config) if arm in ("after", "planner-only") else ()
    slo = ("--slo-ttft-ms", f"{args.ttft_ms:g}", "--slo-tpot-ms", f"{args.tpot_ms:g}")
    extra = planner + (slo if arm in ("after", "slo-only") else ())
    return ClusterSpec(
        engine="sim", model="sim-model", prefill=args.prefill, decode=args.decode,
        port=args.port, zmq_port=args.port + 1, engine_base_port=args.port + 2, stop_grace_s=5.0,
        sim_timing=(
            ("prefill_s_per_token", "0.0004"), ("decode_step_s", "0.012"),
            ("decode_step_s_per_seq", "0.0008"), ("kv_transfer_s_per_token", "0.00001"),
            ("max_num_seqs", "64"),
        ),
        extra_orchestrator_args=extra,
    )  # fmt: skip


async def one(
    session: aiohttp.ClientSession, url: str, request: TraceRequest, timeout_s: float
) -> tuple[bool, float, float, str]:
    """(ok, TTFT, TPOT, mode) of one streamed completion."""
    body = {"model": "sim-model", "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True}
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(
        f"{url}/v1/completions", data=jsonutil.dumps(body), headers=_JSON, timeout=timeout
    ) as resp:
        mode = resp.headers.get("X-Disagg-Mode", "")
        if resp.status != 200:
            await resp.read()
            return False, 0.0, 0.0, mode
        timing = await time_stream(resp, t0)
    return timing.tokens == request.max_tokens, timing.ttft_s, timing.tpot_s, mode


async def play(
    session: aiohttp.ClientSession, url: str, trace: Sequence[TraceRequest], timeout_s: float
) -> list[Sample]:
    """Send every request at its time (open loop: nothing waits for an answer), collect them all."""
    start = time.perf_counter()

    async def send(request: TraceRequest) -> Sample:
        await asyncio.sleep(max(0.0, start + request.at_s - time.perf_counter()))
        try:
            ok, ttft, tpot, mode = await one(session, url, request, timeout_s)
        except (aiohttp.ClientError, TimeoutError):
            ok, ttft, tpot, mode = False, 0.0, 0.0, ""
        return Sample(request.at_s, ok, ttft, tpot, mode)

    return list(await asyncio.gather(*(send(r) for r in trace)))


class QuietCluster(LocalCluster):
    """A ``LocalCluster`` whose children write to ``log``, not to our stdout (which ``--json`` owns)."""

    def __init__(self, spec: ClusterSpec, log: IO[bytes]) -> None:
        super().__init__(spec)
        self.log = log

    async def start(self) -> None:
        """Spawn the orchestrator, then every agent, their output to the log."""
        self.orchestrator = await spawn(
            self.spec.orchestrator_argv(), env=self.spec.orchestrator_env(), output=self.log
        )
        for plan in self.plans:
            self.agents[plan.agent_id] = await spawn(self.spec.agent_argv(plan), output=self.log)


@contextlib.asynccontextmanager
async def serving(spec: ClusterSpec, log: IO[bytes]) -> AsyncIterator[aiohttp.ClientSession]:
    """A fresh ``QuietCluster`` of ``spec``, ready, and a client session without a connection limit;
    the cluster stopped on the way out."""
    cluster = QuietCluster(spec, log)
    try:
        await cluster.start()
        if not await cluster.wait_ready(120.0):
            raise RuntimeError(f"the benchmark cluster did not become ready (its output: {log.name})")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            yield session
    finally:
        await cluster.stop()


async def run_point(
    arm: str,
    rate: float,
    trace: Sequence[TraceRequest],
    args: argparse.Namespace,
    planner_config: str,
    log: IO[bytes],
) -> Point:
    """A fresh cluster for one arm, the trace at ``rate`` through it, the planner's shifts."""
    spec = cluster_spec(arm, args, planner_config)
    async with serving(spec, log) as session:
        samples = await play(session, spec.base_url, trace, args.request_timeout_s)
        planned = "--planner-config" in spec.extra_orchestrator_args
        shifts = await _shifts(session, spec) if planned else []
    return summarise(arm, rate, samples, args, shifts)


async def _shifts(session: aiohttp.ClientSession, spec: ClusterSpec) -> list[str]:
    headers = {"Authorization": f"Bearer {spec.admin_token}"}
    async with session.get(f"{spec.base_url}/admin/v1/planner", headers=headers) as resp:
        shifts: list[dict[str, Any]] = list((await resp.json()).get("shifts", []))
    return [f"{s['instance']} {s['from']}->{s['to']} ({s['outcome']})" for s in shifts]


def trace_spec(args: argparse.Namespace) -> TraceSpec:
    """The trace the flags describe."""
    return TraceSpec(
        seed=args.seed,
        documents=args.documents,
        zipf=args.zipf,
        doc_tokens=tuple(args.doc_tokens),
        question_tokens=tuple(args.question_tokens),
        output_tokens=tuple(args.output_tokens),
    )


# -- the report ---------------------------------------------------------------------------------


def render(points: Sequence[Point], args: argparse.Namespace) -> str:
    """The table, the 75% point and the gain there."""
    lines = [
        f"bench goodput: {args.prefill}P{args.decode}D simulated, {args.documents} documents (Zipf "
        f"{args.zipf:g}), seed {args.seed}, {args.duration_s:g} s per point ({args.warmup_s:g} s warm-up), "
        f"targets TTFT {args.ttft_ms:g} ms and TPOT {args.tpot_ms:g} ms; medians over {args.rounds} round(s)",
        "| offered req/s | arm | requests | failed | attainment | goodput req/s [min-max] | TTFT p90 ms "
        "| TPOT p90 ms | colocated | attainment, whole run |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(points, key=lambda p: (p.rate, ARMS.index(p.arm))):
        low, high = p.goodput_range
        spread = f" [{low:g}-{high:g}]" if p.rounds > 1 else ""
        lines.append(
            f"| {p.rate:g} | {p.arm} | {p.requests} | {p.failed} | {p.attainment:.1%} | "
            f"{p.goodput_rps:g}{spread} | {p.ttft_p90_ms:g} | {p.tpot_p90_ms:g} | {p.colocated:.1%} | "
            f"{p.whole_attainment:.1%} |"
        )
    for p in points:
        if p.arm in ("after", "planner-only"):
            lines.append(f"{p.arm} at {p.rate:g} req/s: shifts {', '.join(p.shifts) or 'none'}")
    k = knee(points)
    if k is not None:
        lines.append(
            f"at {k.rate:g} req/s before attains {k.before_attainment:.1%} (closest to "
            f"{TARGET_ATTAINMENT:.0%}): goodput {k.before_goodput:g} -> {k.after_goodput:g} req/s "
            f"({k.gain:+.1%}), attainment {k.after_attainment:.1%} after"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Every round runs every rate on both arms in turn (a machine that slows down slows both alike);
    print the table of medians (or JSON)."""
    if not 0 <= args.warmup_s < args.duration_s or args.rounds < 1:
        raise ConfigError("need 0 <= --warmup-s < --duration-s and --rounds >= 1")
    spec = trace_spec(args)
    traces = {rate: make_trace(spec, rate, args.duration_s) for rate in args.rates}  # one per rate, all arms
    per_point: dict[tuple[str, float], list[Point]] = {}
    # The processes' output is kept where the error names it when a point fails; removed otherwise.
    logs = tempfile.mkdtemp(prefix="bench-goodput-")
    config = os.path.join(logs, "planner.yaml")
    with open(config, "w", encoding="utf-8") as f:
        f.write(planner_yaml(args))
    for _ in range(args.rounds):
        for rate in args.rates:
            for arm in args.arms:
                with open(os.path.join(logs, f"{arm}-{rate:g}.log"), "wb") as log:
                    point = asyncio_run(run_point(arm, rate, traces[rate], args, config, log))
                per_point.setdefault((arm, rate), []).append(point)
    shutil.rmtree(logs, ignore_errors=True)
    points = [median_point(rounds) for rounds in per_point.values()]
    if args.json:
        k = knee(points)
        report = {
            "benchmark": "goodput",
            "points": [asdict(p) for p in points],
            "knee": None if k is None else {**asdict(k), "gain": round(k.gain, 4)},
        }
        print(jsonutil.dumps(report).decode())
    else:
        print(render(points, args))
    return 0
