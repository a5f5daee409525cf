"""What a simulated run comes to: goodput, attainment, latency percentiles and the orchestrator's
interventions, from the requests' outcomes; and the comparison table of several runs.

A request *meets its SLO* when it finished (``ok``), its TTFT is within the TTFT target and its
TPOT within the TPOT target (a one-token answer has no TPOT, so only its TTFT counts). A failed
request never meets it, however fast it failed. Over a trace:

- ``attainment``: the fraction of the trace's requests that meet their SLO;
- ``goodput``: the requests that meet their SLO per second of the trace (first arrival to last);
- latency percentiles (nearest rank) are over the requests that finished;
- ``prefix_hit_rate``: prompt tokens the engines found in their prefix caches over the prompt tokens
  they had to have (found + computed), summed over every engine; KV a decode engine received from a
  prefill engine is in neither;
- ``shed``: requests refused before any engine saw them (admission's 429s and no-capacity 503s), by
  reason; a shed request is also a failed one;
- the same attainment and goodput per priority class and per tenant (goodput still over the trace's
  whole duration, so the classes' goodputs add up to the run's).

Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from vllm_disagg.cluster_sim.cluster import Outcome
from vllm_disagg.cluster_sim.control import ControlEvent
from vllm_disagg.orchestrator.admission.policy import SHED_REASONS

# (reason, requests), in ``SHED_REASONS`` order, none at 0; a float because a median may be a half.
Counts = tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class Slo:
    """The targets every request is judged by."""

    ttft_s: float
    tpot_s: float


class TokenCounters(Protocol):
    """What the prefix hit rate needs of an engine (``engine.Engine`` has it)."""

    cached_tokens: int
    computed_tokens: int


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50, p90 and p99 of some latency, in milliseconds (0 where there were no samples)."""

    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0


@dataclass(frozen=True, slots=True)
class ClassResult:
    """One priority class's or one tenant's share of a run."""

    key: int | str  # the priority, or the tenant's name
    requests: int
    met: int
    shed: int
    goodput: float  # its met requests per second of the whole trace
    attainment: float  # met / requests
    shed_by_reason: Counts = ()

    def to_json(self, name: str) -> dict[str, Any]:
        """The class as ``--json`` prints it, its key under ``name`` (``priority`` or ``tenant``)."""
        return {
            name: self.key,
            "requests": self.requests,
            "met": self.met,
            "shed": self.shed,
            "goodput": self.goodput,
            "attainment": self.attainment,
            "shed_by_reason": dict(self.shed_by_reason),
        }


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run (a policy on a trace at an offered rate) or the medians of several."""

    policy: str
    rate: float  # offered requests per second
    requests: int
    failed: int
    met: int  # requests that met both targets
    goodput: float  # met requests per second of the trace
    attainment: float  # met / requests
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    prefix_hit_rate: float
    shifts: int  # role shifts the planner made
    retries: int
    resumes: int
    fallbacks: int  # requests that ran colocated after no prefill instance could do their prompt
    duration_s: float  # the trace's, over which goodput is counted
    wall_s: float = 0.0
    events: int = 0
    seeds: tuple[int, ...] = ()  # the seed of each run this stands for
    # (bucket start s, attainment of the requests arriving in it); empty buckets are left out
    over_time: tuple[tuple[float, float], ...] = field(default=())
    # What the rollouts and role changes did (``control.ControlEvent``); of the first round in medians.
    control: tuple[ControlEvent, ...] = ()
    shed: int = 0  # refused before any engine saw them (also counted in ``failed``)
    shed_by_reason: Counts = ()
    by_priority: tuple[ClassResult, ...] = ()  # most important first
    by_tenant: tuple[ClassResult, ...] = ()  # by name
    admission_checks: int = 0  # heads the admission pump decided again (route_request + fit each)

    def to_json(self) -> dict[str, Any]:
        """The result as ``--json`` prints it."""
        return {
            "policy": self.policy,
            "rate": self.rate,
            "seeds": list(self.seeds),
            "requests": self.requests,
            "failed": self.failed,
            "met": self.met,
            "goodput": self.goodput,
            "attainment": self.attainment,
            "ttft_ms": {"p50": self.ttft_ms.p50, "p90": self.ttft_ms.p90, "p99": self.ttft_ms.p99},
            "tpot_ms": {"p50": self.tpot_ms.p50, "p90": self.tpot_ms.p90, "p99": self.tpot_ms.p99},
            "prefix_hit_rate": self.prefix_hit_rate,
            "shifts": self.shifts,
            "retries": self.retries,
            "resumes": self.resumes,
            "fallbacks": self.fallbacks,
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
            "events": self.events,
            "attainment_over_time": [list(point) for point in self.over_time],
            "control": [e.to_json() for e in self.control],
            "shed": self.shed,
            "shed_by_reason": dict(self.shed_by_reason),
            "by_priority": [c.to_json("priority") for c in self.by_priority],
            "by_tenant": [c.to_json("tenant") for c in self.by_tenant],
            "admission_checks": self.admission_checks,
        }


def meets(outcome: Outcome, slo: Slo) -> bool:
    """Whether the request finished within both targets."""
    if not outcome.ok or outcome.ttft_s is None or outcome.ttft_s > slo.ttft_s:
        return False
    return outcome.tpot_s is None or outcome.tpot_s <= slo.tpot_s


def attainment(outcomes: Sequence[Outcome], slo: Slo) -> float:
    """The fraction of requests that met both targets (0 for no requests)."""
    return sum(meets(o, slo) for o in outcomes) / len(outcomes) if outcomes else 0.0


def goodput(outcomes: Iterable[Outcome], slo: Slo, duration_s: float) -> float:
    """Requests that met both targets per second of ``duration_s`` (0 for an instant trace)."""
    met = sum(meets(o, slo) for o in outcomes)
    return met / duration_s if duration_s > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it (0 if none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


def percentiles_ms(seconds: Sequence[float]) -> Percentiles:
    """p50, p90 and p99 of ``seconds``, in milliseconds."""
    p50, p90, p99 = (percentile(seconds, q) * 1000 for q in (0.5, 0.9, 0.99))
    return Percentiles(p50, p90, p99)


def prefix_hit_rate(engines: Iterable[TokenCounters]) -> float:
    """Cached over cached + computed prompt tokens, over all engines (0 if no prompt was seen)."""
    cached = computed = 0
    for engine in engines:
        cached += engine.cached_tokens
        computed += engine.computed_tokens
    return cached / (cached + computed) if cached + computed else 0.0


def attainment_over_time(
    outcomes: Iterable[Outcome], slo: Slo, bucket_s: float
) -> tuple[tuple[float, float], ...]:
    """Per ``bucket_s`` of arrival time: (the bucket's start, the attainment of the requests that
    arrived in it), in time order; buckets nobody arrived in are left out."""
    if bucket_s <= 0:
        raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
    counts: dict[int, list[int]] = {}
    for o in outcomes:
        bucket = counts.setdefault(int(o.arrival_s // bucket_s), [0, 0])
        bucket[0] += meets(o, slo)
        bucket[1] += 1
    return tuple((k * bucket_s, met / n) for k, (met, n) in sorted(counts.items()))


def shed_counts(outcomes: Iterable[Outcome]) -> Counts:
    """Refused requests by reason, in ``SHED_REASONS`` order (then any other), reasons at 0 left out."""
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.shed_reason:
            counts[o.shed_reason] = counts.get(o.shed_reason, 0) + 1
    order: dict[str, int] = {reason: i for i, reason in enumerate(SHED_REASONS)}
    return tuple(sorted(counts.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def by_class(
    outcomes: Iterable[Outcome], slo: Slo, duration_s: float, key: Callable[[Outcome], int | str]
) -> tuple[ClassResult, ...]:
    """Attainment, goodput and refusals of each value of ``key`` (a priority, a tenant), in its order."""
    groups: dict[int | str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(key(o), []).append(o)
    return tuple(
        ClassResult(
            k,
            len(group),
            sum(meets(o, slo) for o in group),
            sum(1 for o in group if o.shed_reason),
            goodput(group, slo, duration_s),
            attainment(group, slo),
            shed_counts(group),
        )
        for k, group in sorted(groups.items(), key=lambda kv: kv[0])
    )


def summarise(
    policy: str,
    rate: float,
    outcomes: Sequence[Outcome],
    slo: Slo,
    *,
    duration_s: float,
    engines: Iterable[TokenCounters] = (),
    shifts: int = 0,
    bucket_s: float = 10.0,
    wall_s: float = 0.0,
    events: int = 0,
    seed: int | None = None,
    control: Sequence[ControlEvent] = (),
    admission_checks: int = 0,
) -> RunResult:
    """One run's result from its outcomes and the cluster's counters."""
    done = [o for o in outcomes if o.ok]
    return RunResult(
        policy=policy,
        rate=rate,
        requests=len(outcomes),
        failed=len(outcomes) - len(done),
        met=sum(meets(o, slo) for o in outcomes),
        goodput=goodput(outcomes, slo, duration_s),
        attainment=attainment(outcomes, slo),
        ttft_ms=percentiles_ms([o.ttft_s for o in done if o.ttft_s is not None]),
        tpot_ms=percentiles_ms([o.tpot_s for o in done if o.tpot_s is not None]),
        prefix_hit_rate=prefix_hit_rate(engines),
        shifts=shifts,
        retries=sum(o.retries for o in outcomes),
        resumes=sum(o.resumes for o in outcomes),
        fallbacks=sum(o.fallback for o in outcomes),
        duration_s=duration_s,
        wall_s=wall_s,
        events=events,
        seeds=() if seed is None else (seed,),
        over_time=attainment_over_time(outcomes, slo, bucket_s),
        control=tuple(control),
        shed=sum(1 for o in outcomes if o.shed_reason),
        shed_by_reason=shed_counts(outcomes),
        by_priority=by_class(outcomes, slo, duration_s, lambda o: o.priority),
        by_tenant=by_class(outcomes, slo, duration_s, lambda o: o.tenant),
        admission_checks=admission_checks,
    )


def _median_over_time(runs: Sequence[RunResult]) -> tuple[tuple[float, float], ...]:
    by_start: dict[float, list[float]] = {}
    for run in runs:
        for start, value in run.over_time:
            by_start.setdefault(start, []).append(value)
    return tuple((start, statistics.median(values)) for start, values in sorted(by_start.items()))


def _median_percentiles(values: Sequence[Percentiles]) -> Percentiles:
    return Percentiles(*(statistics.median(getattr(p, q) for p in values) for q in ("p50", "p90", "p99")))


_MEDIAN_FIELDS = (
    "requests", "failed", "met", "goodput", "attainment", "prefix_hit_rate", "shifts", "retries",
    "resumes", "fallbacks", "duration_s", "wall_s", "events", "shed", "admission_checks",
)  # fmt: skip


def _median_counts(counts: Sequence[Counts]) -> Counts:
    """Each reason's median over the runs (a run without it counts 0)."""
    reasons = dict.fromkeys(reason for c in counts for reason, _ in c)
    medians = ((r, statistics.median(dict(c).get(r, 0) for c in counts)) for r in reasons)
    return tuple((r, m) for r, m in medians if m)


def _median_classes(runs: Sequence[tuple[ClassResult, ...]]) -> tuple[ClassResult, ...]:
    """Each class's fields' medians over the runs it appears in."""
    groups: dict[int | str, list[ClassResult]] = {}
    for classes in runs:
        for c in classes:
            groups.setdefault(c.key, []).append(c)

    def med(group: list[ClassResult], name: str) -> Any:
        return statistics.median(getattr(c, name) for c in group)

    return tuple(
        ClassResult(
            key,
            med(group, "requests"),
            med(group, "met"),
            med(group, "shed"),
            med(group, "goodput"),
            med(group, "attainment"),
            _median_counts([c.shed_by_reason for c in group]),
        )
        for key, group in groups.items()
    )


def median(runs: Sequence[RunResult]) -> RunResult:
    """The medians, field by field, of runs of one policy at one rate (seeds or rounds)."""
    if not runs:
        raise ValueError("median of no runs")
    first = runs[0]
    if len(runs) == 1:
        return first

    def med(name: str) -> Any:
        return statistics.median(getattr(r, name) for r in runs)

    return replace(
        first,
        **{name: med(name) for name in _MEDIAN_FIELDS},
        ttft_ms=_median_percentiles([r.ttft_ms for r in runs]),
        tpot_ms=_median_percentiles([r.tpot_ms for r in runs]),
        seeds=tuple(s for r in runs for s in r.seeds),
        over_time=_median_over_time(runs),
        shed_by_reason=_median_counts([r.shed_by_reason for r in runs]),
        by_priority=_median_classes([r.by_priority for r in runs]),
        by_tenant=_median_classes([r.by_tenant for r in runs]),
    )


def medians(runs: Iterable[RunResult]) -> list[RunResult]:
    """One result per (policy, rate): the median of its runs, ordered by rate, then first appearance."""
    groups: dict[tuple[str, float], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((run.policy, run.rate), []).append(run)
    order = {key: i for i, key in enumerate(groups)}
    return [median(groups[key]) for key in sorted(groups, key=lambda k: (k[1], order[k]))]


_COLUMNS = (
    "policy", "rate req/s", "requests", "failed", "goodput req/s", "attainment", "TTFT p50/p90/p99 ms",
    "TPOT p50/p90/p99 ms", "prefix hit", "shifts", "retries", "resumes", "fallbacks", "shed",
)  # fmt: skip


def _ms(p: Percentiles) -> str:
    return f"{p.p50:.0f}/{p.p90:.0f}/{p.p99:.0f}" if p.p99 >= 10 else f"{p.p50:.1f}/{p.p90:.1f}/{p.p99:.1f}"


def _num(x: float) -> str:
    return f"{x:g}" if float(x).is_integer() else f"{x:.1f}"


def _row(r: RunResult) -> tuple[str, ...]:
    return (
        r.policy, f"{r.rate:.4g}", _num(r.requests), _num(r.failed), f"{r.goodput:.2f}",
        f"{r.attainment:.1%}", _ms(r.ttft_ms), _ms(r.tpot_ms), f"{r.prefix_hit_rate:.1%}",
        _num(r.shifts), _num(r.retries), _num(r.resumes), _num(r.fallbacks), _num(r.shed),
    )  # fmt: skip


def table(results: Sequence[RunResult]) -> str:
    """A markdown table, one row per result (pass ``medians(runs)`` for one row per policy and rate)."""
    return _markdown(_COLUMNS, [_row(r) for r in results])


_CLASS_COLUMNS = (
    "policy", "rate req/s", "class", "requests", "goodput req/s", "attainment", "shed", "shed by reason",
)  # fmt: skip


def _priorities(r: RunResult) -> tuple[ClassResult, ...]:
    return r.by_priority


def _tenants(r: RunResult) -> tuple[ClassResult, ...]:
    return r.by_tenant


def _reasons(counts: Counts) -> str:
    return ", ".join(f"{reason} {_num(n)}" for reason, n in counts) or "-"


def has_classes(results: Sequence[RunResult]) -> bool:
    """Whether ``class_table`` has anything to add: several priorities or tenants, or refusals."""
    return any(len(r.by_priority) > 1 or len(r.by_tenant) > 1 or r.shed for r in results)


def class_table(results: Sequence[RunResult]) -> str:
    """A markdown table of each result's priority classes and tenants: the run ("all"), then a row
    per priority (most important first) and per tenant, each with its refusals by reason; priorities
    and tenants only where some result has several."""
    kinds = [
        (kind, get)
        for kind, get in (("priority", _priorities), ("tenant", _tenants))
        if any(len(get(r)) > 1 for r in results)
    ]
    rows: list[tuple[str, ...]] = []
    for r in results:
        head = (r.policy, f"{r.rate:.4g}")
        rows.append((*head, "all", _num(r.requests), f"{r.goodput:.2f}", f"{r.attainment:.1%}",
                     _num(r.shed), _reasons(r.shed_by_reason)))  # fmt: skip
        for kind, get in kinds:
            for c in get(r):
                rows.append((*head, f"{kind} {c.key}", _num(c.requests), f"{c.goodput:.2f}",
                             f"{c.attainment:.1%}", _num(c.shed), _reasons(c.shed_by_reason)))  # fmt: skip
    return _markdown(_CLASS_COLUMNS, rows, left=(0, 2, 7))


def _markdown(columns: Sequence[str], rows: Sequence[tuple[str, ...]], left: Sequence[int] = (0,)) -> str:
    """Rows under a header, padded to line up; the ``left`` columns aligned left, the others right."""
    widths = [max([len(c), *(len(row[i]) for row in rows)]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )
        return "| " + " | ".join(padded) + " |"

    # Markdown alignment: names left, numbers right.
    rule = (
        "| " + " | ".join("-" * w if i in left else "-" * (w - 1) + ":" for i, w in enumerate(widths)) + " |"
    )
    return "\n".join([line(columns), rule, *(line(row) for row in rows)])
