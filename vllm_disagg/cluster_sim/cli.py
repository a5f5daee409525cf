"""``vllm-disagg sim``: replay a trace on a simulated cluster under one or more routing policies and
report goodput, SLO attainment, latency percentiles and what the orchestrator did (docs/sim.md,
"Cluster simulator").

Without ``--compare`` each ``--policy`` (default ``ours``) runs once at ``--rate``; with it every
policy (default all of them) runs at every ``--rates`` rate, ``--rounds`` times, the table shows the
medians, and ``--plots DIR`` gets "goodput vs offered rate" and "attainment over time" PNGs.
``--rollout``, ``--rollback`` and ``--role-change`` have the operator act during the run; what the
orchestrator's control steps did follows the table. Admission is on as in the orchestrator
(``--admission off`` sends every request to an engine); ``--priority-mix`` and ``--tenants`` give the
requests classes and tenants, and a second table shows each one's attainment, goodput and refusals.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO, cast

from vllm_disagg import jsonutil
from vllm_disagg.cluster_sim import topology
from vllm_disagg.cluster_sim.classes import PriorityMix, TenantMix, with_classes
from vllm_disagg.cluster_sim.cluster import Cluster, ClusterSpec, Fault, FaultKind
from vllm_disagg.cluster_sim.control import RoleChangePlan, RolloutPlan
from vllm_disagg.cluster_sim.faults import target_problem
from vllm_disagg.cluster_sim.mooncake import load_mooncake
from vllm_disagg.cluster_sim.plot import Series, line_chart
from vllm_disagg.cluster_sim.policies import POLICIES, VARIANTS, scheduler_for
from vllm_disagg.cluster_sim.profile import PROFILES
from vllm_disagg.cluster_sim.report import (
    RunResult,
    Slo,
    class_table,
    has_classes,
    medians,
    summarise,
    table,
)
from vllm_disagg.cluster_sim.trace import Trace
from vllm_disagg.cluster_sim.traces import DEFAULT_RATE_PER_S, SYNTHETIC, describe
from vllm_disagg.config import AdmissionConfig, OrchestratorConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.flags import ADMISSION_FLAGS, parse_tenant_weight
from vllm_disagg.orchestrator.planner.config import PlannerConfig, load_planner_config_file
from vllm_disagg.orchestrator.scheduling.config import SchedulerConfig, default_config, load_config_file
from vllm_disagg.protocol.messages import Role

DEFAULT_PROFILE = "h100-llama3-8b"
BUCKETS = 20  # attainment-over-time buckets across the trace, unless --bucket-s says otherwise
_FAULT = re.compile(
    r"(?P<kind>engine|node|slow-link):(?P<instance>[^@\s]+)@(?P<at>[0-9.]+)"
    r"(?:\+(?P<for>[0-9.]+))?(?:x(?P<slowdown>[0-9.]+))?"
)
_ROLLOUT = re.compile(r"(?P<at>[0-9.]+)(?:\+(?P<every>[0-9.]+))?")
_ROLE_CHANGE = re.compile(r"(?P<instance>[^=@\s]+)=(?P<role>prefill|decode|both)@(?P<at>[0-9.]+)")


def _number(text: str, *, low: float, strict: bool, cast: Callable[[str], float] = float) -> float:
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
    return value


def _positive(text: str) -> float:
    return _number(text, low=0, strict=True)


def _count(text: str) -> int:
    return int(_number(text, low=1, strict=False, cast=int))


def _size(text: str) -> int:
    return int(_number(text, low=0, strict=False, cast=int))


def parse_fault(text: str) -> Fault:
    """``KIND:INSTANCE@AT[+FOR][xSLOWDOWN]`` (seconds of virtual time) as a ``Fault``."""
    m = _FAULT.fullmatch(text)
    try:
        if m is None:
            raise ValueError
        at = float(m["at"])
        for_s = float(m["for"]) if m["for"] else None
        slowdown = float(m["slowdown"]) if m["slowdown"] else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KIND:INSTANCE@AT[+FOR][xSLOWDOWN], KIND one of engine, node, slow-link "
            "(e.g. engine:decode-0@30+20 or slow-link:prefill-1@10x4)"
        ) from None
    if slowdown is not None and m["kind"] != "slow-link":
        raise argparse.ArgumentTypeError(f"{text!r}: only a slow-link fault has a slowdown")
    if slowdown is not None and slowdown < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a slowdown is >= 1")
    kind = cast(FaultKind, m["kind"])  # the pattern admits only these
    return Fault(at, kind, m["instance"], for_s, slowdown if slowdown is not None else 10.0)


def parse_rollout(text: str) -> RolloutPlan:
    """``AT[+EVERY]`` (virtual seconds): the rollout to r2 starts at AT, a new instance joins every EVERY."""
    m = _ROLLOUT.fullmatch(text)
    try:
        if m is None:
            raise ValueError
        return RolloutPlan(float(m["at"]), join_every_s=float(m["every"]) if m["every"] else 5.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not AT[+EVERY] (e.g. 30 or 30+5)") from None


def _mix(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parsed


# The orchestrator's admission flags that mean something here (no headers: requests carry their class).
_ADMISSION_FLAGS = tuple(f for f in ADMISSION_FLAGS if not f[1].endswith("_header"))


def parse_role_change(text: str) -> RoleChangePlan:
    """``INSTANCE=ROLE@AT``: the operator changes INSTANCE to ROLE at AT (virtual seconds)."""
    m = _ROLE_CHANGE.fullmatch(text)
    try:
        if m is None:
            raise ValueError
        return RoleChangePlan(float(m["at"]), m["instance"], cast(Role, m["role"]))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not INSTANCE=ROLE@AT, ROLE one of prefill, decode, both (e.g. decode-1=prefill@20)"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg sim``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a Mooncake JSONL trace")
    source.add_argument(
        "--synthetic",
        choices=sorted(SYNTHETIC),
        metavar="NAME",
        help=f"a synthetic workload: {', '.join(sorted(SYNTHETIC))}",
    )
    parser.add_argument("--prefill", type=_size, required=True, metavar="N", help="prefill instances")
    parser.add_argument("--decode", type=_count, required=True, metavar="M", help="decode instances")
    parser.add_argument(
        "--policy",
        dest="policies",
        action="extend",
        nargs="+",
        choices=(*POLICIES, *VARIANTS),
        metavar="NAME",
        help=f"routing policy, repeatable: {', '.join(POLICIES + VARIANTS)}",
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=DEFAULT_PROFILE,
        metavar="NAME",
        help=f"engine cost model: {', '.join(sorted(PROFILES))} (default {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--rate",
        type=_positive,
        metavar="R",
        help=f"offered req/s (synthetic default {DEFAULT_RATE_PER_S:g}; a file trace "
        "is sped up or slowed down to it)",
    )
    parser.add_argument("--duration-s", type=_positive, metavar="S", help="seconds of arrivals")
    parser.add_argument("--requests", type=_count, metavar="N", help="at most N requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of a synthetic trace and the cluster")
    parser.add_argument("--slo-ttft-ms", type=_positive, default=1000.0, help="TTFT target (1000)")
    parser.add_argument("--slo-tpot-ms", type=_positive, default=50.0, help="TPOT target (50)")
    parser.add_argument("--planner-config", metavar="FILE", help="run the planner (policy ours only)")
    parser.add_argument("--scheduler-config", metavar="FILE", help="ours' scheduler (default: shipped)")
    parser.add_argument("--length-scale", type=_positive, metavar="F", help="file trace: prompt lengths x F")
    parser.add_argument("--time-scale", type=_positive, metavar="F", help="file trace: replay F x as fast")
    parser.add_argument(
        "--fault",
        dest="faults",
        type=parse_fault,
        action="extend",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="KIND:INSTANCE@AT[+FOR][xSLOWDOWN], e.g. engine:decode-0@30+20",
    )
    parser.add_argument(
        "--rollout", type=parse_rollout, metavar="AT[+EVERY]", help="roll to revision r2 at AT (s)"
    )
    parser.add_argument("--rollback", type=_positive, metavar="AT", help="roll the --rollout back at AT")
    parser.add_argument(
        "--role-change",
        dest="role_changes",
        type=parse_role_change,
        action="extend",
        nargs="+",
        default=[],
        metavar="SPEC",
        help="INSTANCE=ROLE@AT, e.g. decode-1=prefill@20",
    )
    parser.add_argument(
        "--role-switch",
        choices=("routing", "restart"),
        default="routing",
        help="how agents change an engine's role (the planner's shifts too): routing (default), restart",
    )
    parser.add_argument(
        "--engine-start-s",
        type=_positive,
        default=10.0,
        metavar="S",
        help="a new engine is ready after S (10)",
    )
    parser.add_argument(
        "--admission",
        choices=("on", "off"),
        default="on",
        help="the gateway's admission queue, as in the orchestrator (default on); off: all go to engines",
    )
    for flag, name, kind, help_text in _ADMISSION_FLAGS:
        default = getattr(AdmissionConfig(), name)
        parser.add_argument(
            flag,
            dest=f"admission_{name}",
            type=kind,
            default=default,
            metavar=name.upper(),
            help=f"{help_text} ({default})",
        )
    parser.add_argument(
        "--tenant-weight",
        dest="tenant_weights",
        type=parse_tenant_weight,
        action="append",
        default=[],
        metavar="TENANT=WEIGHT",
        help="a tenant's weight in admission's fair sharing (repeatable; over --tenants' weight)",
    )
    parser.add_argument(
        "--priority-mix",
        type=_mix(PriorityMix.parse),
        metavar="SHARE:PRIO,...",
        help="each priority's share of the requests, e.g. 0.2:-1,0.6:0,0.2:1 (default: all 0)",
    )
    parser.add_argument(
        "--tenants",
        type=_mix(TenantMix.parse),
        metavar="NAME:WEIGHT:SHARE,...",
        help="tenants, their weights and shares of the requests, e.g. a:1:0.75,b:1:0.25 (default: one)",
    )
    parser.add_argument(
        "--request-slo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="requests carry the SLO as x-slo-* headers would (default); --no-request-slo: no targets",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="every policy (or those given) at every --rates rate: one table of medians",
    )
    parser.add_argument("--rates", type=_positive, nargs="+", metavar="R", help="--compare: offered rates")
    parser.add_argument("--rounds", type=_count, default=1, help="runs per point, seeds seed.. (medians)")
    parser.add_argument("--plots", metavar="DIR", help="--compare: write PNG plots here")
    parser.add_argument(
        "--bucket-s",
        type=_positive,
        metavar="S",
        help=f"attainment-over-time bucket (default: the trace's duration / {BUCKETS})",
    )
    topology.add_arguments(parser)
    parser.add_argument("--progress", action="store_true", help="a progress bar even when not a TTY")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


class Progress:
    """A one-line bar on a stream: the share of the trace's duration simulated so far."""

    WIDTH = 30

    def __init__(self, stream: TextIO, label: str, duration_s: float) -> None:
        self.stream, self.label, self.duration_s = stream, label, duration_s
        self.update(0.0)

    def update(self, now: float) -> None:
        """Redraw at virtual time ``now`` (past the last arrival: 100%, draining)."""
        share = min(1.0, now / self.duration_s) if self.duration_s > 0 else 1.0
        filled = round(share * self.WIDTH)
        tail = " draining" if now > self.duration_s else ""
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {share:4.0%}{tail}\033[K")
        self.stream.flush()

    def close(self) -> None:
        """The bar full, and a new line."""
        self.update(self.duration_s)
        self.stream.write("\n")
        self.stream.flush()


@dataclass(frozen=True, slots=True)
class Setup:
    """Everything checked before the first run."""

    spec: ClusterSpec  # the baselines' (ours adds the planner)
    planner: PlannerConfig | None
    scheduler: SchedulerConfig
    slo: Slo
    policies: tuple[str, ...]
    rates: tuple[float | None, ...]  # None: the trace as it is
    seeds: tuple[int, ...]


def _rate(trace: Trace) -> float:
    """A file trace's offered rate: requests over its duration, goodput's denominator, so that
    goodput is attainment times the offered rate."""
    return len(trace.requests) / trace.duration_s if trace.duration_s > 0 else 0.0


class Traces:
    """The trace of each (rate, seed): a synthetic one made at the rate, a file's time-scaled to it."""

    def __init__(self, args: argparse.Namespace, block_tokens: int) -> None:
        self.args, self.block_tokens = args, block_tokens
        self._natural_rate: float | None = None

    def _load(self, time_scale: float) -> Trace:
        """The file at ``time_scale``, whole (``--requests`` lines at most)."""
        a = self.args
        try:
            trace = load_mooncake(
                a.trace, block_tokens=self.block_tokens, length_scale=a.length_scale or 1.0,
                time_scale=time_scale, limit=a.requests,
            )  # fmt: skip
        except OSError as exc:
            raise ConfigError(f"cannot read the trace {a.trace!r}: {exc.strerror}") from None
        except ValueError as exc:
            raise ConfigError(f"the trace {a.trace!r}: {exc}") from None
        return trace

    def offered(self, rate: float | None, trace: Trace) -> float:
        """The rate a row is labelled with: the one asked for, a preset's default, or a file's own."""
        if rate is not None:
            return rate
        return DEFAULT_RATE_PER_S if self.args.synthetic else _rate(trace)

    def get(self, rate: float | None, seed: int) -> Trace:
        """The trace at ``rate`` (None: as given) for round ``seed``."""
        a = self.args
        if a.synthetic:
            try:
                trace = SYNTHETIC[a.synthetic](
                    rate_per_s=rate or DEFAULT_RATE_PER_S, duration_s=a.duration_s, n_requests=a.requests,
                    seed=seed, block_tokens=self.block_tokens,
                )  # fmt: skip
            except ValueError as exc:
                raise ConfigError(f"synthetic trace {a.synthetic}: {exc}") from None
        else:
            if rate is None:
                trace = self._load(a.time_scale or 1.0)
            else:
                if self._natural_rate is None:
                    self._natural_rate = _rate(self._load(1.0))
                if self._natural_rate <= 0:
                    raise ConfigError(f"the trace {a.trace!r} has no arrival rate to scale (one instant)")
                trace = self._load(rate / self._natural_rate)
            if a.duration_s is not None:  # cut after scaling: seconds of the replay
                kept = [r for r in trace.requests if r.at_s <= a.duration_s]
                trace = Trace(trace.name, kept, trace.description)
        if not trace.requests:
            raise ConfigError("the trace has no requests")
        return with_classes(trace, a.priority_mix, a.tenants, seed)


def _check(args: argparse.Namespace) -> Setup:
    """Every flag's combination and every config file, before anything runs."""
    if args.rates and not args.compare:
        raise ConfigError("--rates needs --compare (one rate: --rate)")
    if args.plots and not args.compare:
        raise ConfigError("--plots needs --compare")
    if args.rates and args.rate is not None:
        raise ConfigError("give --rate or --rates, not both")
    if args.synthetic and (args.length_scale is not None or args.time_scale is not None):
        raise ConfigError("--length-scale and --time-scale apply to a --trace file (use --rate)")
    if args.trace and args.time_scale is not None and (args.rate is not None or args.rates):
        raise ConfigError("give --time-scale or a rate for a trace file, not both")
    instances = {f"prefill-{i}" for i in range(args.prefill)} | {f"decode-{i}" for i in range(args.decode)}
    topo = topology.from_args(args)
    where = topo.place(args.prefill, args.decode) if topo is not None else {}
    for f in args.faults:
        problem = target_problem(f.instance, instances, where) if f.kind == "slow-link" else None
        if problem is not None:
            raise ConfigError(f"--fault: {problem}")
    for name, instance in [("--fault", f.instance) for f in args.faults if f.kind != "slow-link"] + [
        ("--role-change", c.instance) for c in args.role_changes
    ]:
        if instance not in instances:
            raise ConfigError(f"{name}: no instance {instance!r} (the cluster has {sorted(instances)})")
    rollout = args.rollout
    if args.rollback is not None:
        if rollout is None or args.rollback <= rollout.at_s:
            raise ConfigError("--rollback needs a --rollout that starts before it")
        rollout = replace(rollout, rollback_at_s=args.rollback)
    admission = admission_config(args)
    scheduler = load_config_file(args.scheduler_config) if args.scheduler_config else default_config()
    planner = load_planner_config_file(args.planner_config) if args.planner_config else None
    policies = tuple(dict.fromkeys(args.policies or (POLICIES if args.compare else ("ours",))))
    rates: tuple[float | None, ...] = tuple(args.rates) if args.rates else (args.rate,)
    carried = args.request_slo  # what each request asks for; the report judges all by ``slo`` either way
    spec = ClusterSpec(
        args.prefill, args.decode, PROFILES[args.profile], config=OrchestratorConfig(admission=admission),
        slo_ttft_s=args.slo_ttft_ms / 1000 if carried else None,
        slo_tpot_s=args.slo_tpot_ms / 1000 if carried else None, faults=tuple(args.faults), seed=args.seed,
        rollout=rollout, role_changes=tuple(args.role_changes), role_switch=args.role_switch,
        engine_start_s=args.engine_start_s, topology=topo,
    )  # fmt: skip
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    seeds = tuple(range(args.seed, args.seed + args.rounds))
    return Setup(spec, planner, scheduler, slo, policies, rates, seeds)


def admission_config(args: argparse.Namespace) -> AdmissionConfig:
    """The admission flags as the gateway's config: ``--tenants``' weights, then ``--tenant-weight``'s."""
    named = [name for name, _ in args.tenant_weights]
    if len(set(named)) != len(named):
        raise ConfigError("--tenant-weight names a tenant twice")
    weights = dict(args.tenants.weights() if args.tenants else ())
    weights.update(args.tenant_weights)
    return AdmissionConfig(
        enabled=args.admission == "on",
        tenant_weights=tuple(weights.items()),
        **{name: getattr(args, f"admission_{name}") for _, name, _, _ in _ADMISSION_FLAGS},
    )


def run_one(
    setup: Setup,
    policy: str,
    trace: Trace,
    rate: float,
    seed: int,
    bucket_s: float,
    progress: TextIO | None = None,
) -> RunResult:
    """One policy on one trace; a fresh cluster, so no run inherits another's caches or roles."""
    spec = replace(setup.spec, planner=setup.planner if policy == "ours" else None, seed=seed)
    scheduler = scheduler_for(policy, setup.scheduler)
    cluster = Cluster(spec, scheduler)
    bar = Progress(progress, f"{policy} @ {rate:g} req/s", trace.duration_s) if progress else None
    started = time.perf_counter()
    outcomes = cluster.run(trace, on_progress=bar.update if bar else None)
    wall = time.perf_counter() - started
    if bar:
        bar.close()
    return summarise(
        policy, rate, outcomes, setup.slo, duration_s=trace.duration_s, engines=cluster.engines.values(),
        shifts=len(cluster.shifts), bucket_s=bucket_s, wall_s=round(wall, 3), events=cluster.loop.events,
        seed=seed, control=cluster.control.events,
        admission_checks=cluster.admission.checks if cluster.admission else 0,
    )  # fmt: skip


def write_plots(directory: str, results: Sequence[RunResult], title: str) -> list[Path]:
    """The plots, one line per policy: goodput vs offered rate, and attainment over time per rate."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    policies = list(dict.fromkeys(r.policy for r in results))
    goodput = [Series(p, [(r.rate, r.goodput) for r in results if r.policy == p]) for p in policies]
    path = out / "goodput-vs-rate.png"
    path.write_bytes(line_chart(goodput, title=f"goodput vs offered rate, {title}",
                                x_label="offered rate (req/s)", y_label="goodput (req/s)"))  # fmt: skip
    paths = [path]
    for rate in dict.fromkeys(r.rate for r in results):
        series = [Series(r.policy, r.over_time) for r in results if r.rate == rate and r.over_time]
        path = out / f"attainment-over-time-{rate:g}.png"
        path.write_bytes(line_chart(series, title=f"attainment over time at {rate:g} req/s",
                                    x_label="arrival time (s)", y_label="attainment", y_max=1.0))  # fmt: skip
        paths.append(path)
    return paths


def _admission_json(config: AdmissionConfig) -> dict[str, Any]:
    return {
        "enabled": config.enabled,
        **{name: getattr(config, name) for _, name, _, _ in _ADMISSION_FLAGS},
        "tenant_weights": dict(config.tenant_weights),
    }


def run(args: argparse.Namespace) -> int:
    """Run every (policy, rate, seed), print the table or the JSON, write the plots."""
    setup = _check(args)
    if setup.planner is not None and setup.planner.dry_run and "ours" in setup.policies:
        print("sim: the planner config says dryRun (the default), so the planner moves no instance; "
              "set dryRun: false to let it", file=sys.stderr)  # fmt: skip
    traces = Traces(args, setup.spec.profile.block_size)
    show = sys.stderr if args.progress or sys.stderr.isatty() else None
    runs: list[RunResult] = []
    described: list[dict[str, Any]] = []
    for rate in setup.rates:
        first = traces.get(rate, setup.seeds[0])
        offered = traces.offered(rate, first)
        described.append({"rate": offered, **describe(first)})
        bucket_s = args.bucket_s or max(first.duration_s / BUCKETS, 1e-3)
        for seed in setup.seeds:
            trace = first if seed == setup.seeds[0] else traces.get(rate, seed)
            for policy in setup.policies:
                runs.append(run_one(setup, policy, trace, offered, seed, bucket_s, show))
    rows = medians(runs)
    spec = setup.spec
    source = f"synthetic {args.synthetic}" if args.synthetic else Path(args.trace).name
    title = f"{source}, {spec.prefill}P{spec.decode}D {spec.profile.name}"
    if spec.topology is not None:
        title += f", topology {spec.topology.shape}"
    plots = write_plots(args.plots, rows, title) if args.plots else []
    if args.json:
        doc: dict[str, Any] = {
            "trace": source, "traces": described,
            "cluster": {"prefill": spec.prefill, "decode": spec.decode, "profile": spec.profile.name,
                        **({"topology": spec.topology.shape} if spec.topology else {})},
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
            "planner": setup.planner.to_json() if setup.planner else None,
            "admission": _admission_json(spec.config.admission),
            "runs": [r.to_json() for r in runs], "plots": [str(p) for p in plots],
        }  # fmt: skip
        if len(setup.seeds) > 1:
            doc["medians"] = [r.to_json() for r in rows]
        sys.stdout.write(jsonutil.dumps(doc).decode() + "\n")
        return 0
    rounds = f", medians of {len(setup.seeds)} rounds" if len(setup.seeds) > 1 else ""
    print(f"sim: {title}; SLO TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms{rounds}")
    print(table(rows))
    if has_classes(rows):
        print("\nby priority class and tenant (shed: refused before any engine saw them, by reason)")
        print(class_table(rows))
    wall = sum(r.wall_s for r in runs)
    plural = "s" if len(runs) > 1 else ""
    print(f"{len(runs)} run{plural}, {sum(r.events for r in runs):,} events, {wall:.2f} s wall")
    for run_ in runs:
        if run_.control:
            print(f"\n{run_.policy} @ {run_.rate:g} req/s, seed {run_.seeds[0]}: rollouts and role changes")
            for event in run_.control:
                print(event.describe())
    for path in plots:
        print(f"wrote {path}")
    return 0
