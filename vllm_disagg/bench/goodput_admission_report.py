"""``bench goodput --scenario admission|tenants``: the arithmetic, pure. What each request's client saw
(``Outcome``) becomes one point's figures per priority class and per tenant (``AdmissionPoint``);
rounds become medians; the sweep without admission gives the rate where attainment is 75%
(``rate_at_attainment``); and the issue's targets are checked on the points (``verdicts``).

A refused request (429) is a request that did not meet its SLO: it counts in every attainment, never
in goodput. Goodput is the requests meeting both targets per second of the measured window.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from vllm_disagg.bench.compare import percentile

TARGET_ATTAINMENT = 0.75  # the base rate: where attainment without admission is about this
NO_COLLAPSE = 0.9  # past the base rate, goodput stays at least this share of the best at a lower rate
TOP_CLASS_ATTAINMENT = 0.95  # the most important class's attainment past the base rate
STEADY_TENANT_ATTAINMENT = 0.95  # the tenant at its share, while the other floods
K = TypeVar("K", int, str)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as its client saw it: when it was sent, its class and tenant, and its answer."""

    at_s: float  # scheduled arrival, seconds after the trace began
    priority: int
    tenant: str
    status: int  # the HTTP status; 0 when no answer came (timeout, connection lost)
    ok: bool  # a 200 streamed to its end
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    shed_reason: str = ""  # a refusal's X-Disagg-Shed-Reason

    def meets(self, ttft_ms: float, tpot_ms: float) -> bool:
        """Both targets met; a refused or failed request never meets them."""
        return self.ok and self.ttft_s * 1000 <= ttft_ms and self.tpot_s * 1000 <= tpot_ms


@dataclass(frozen=True, slots=True)
class Slice:
    """One class's (or tenant's, or the whole point's) requests: how many, met, refused (429)."""

    requests: int
    met: int
    refused: int
    attainment: float  # met over requests: the refused count as not meeting
    goodput_rps: float

    @property
    def refused_share(self) -> float:
        """The share of its requests refused (0 without requests)."""
        return self.refused / self.requests if self.requests else 0.0


def slice_of(outcomes: Sequence[Outcome], ttft_ms: float, tpot_ms: float, window_s: float) -> Slice:
    """The figures of ``outcomes`` over a measured window of ``window_s`` seconds."""
    met = sum(1 for o in outcomes if o.meets(ttft_ms, tpot_ms))
    n = len(outcomes)
    return Slice(
        requests=n,
        met=met,
        refused=sum(1 for o in outcomes if o.status == 429),
        attainment=round(met / n, 4) if n else 0.0,
        goodput_rps=round(met / max(window_s, 1e-9), 3),
    )


@dataclass
class AdmissionPoint:
    """One arm at one offered load (one round, or the medians over rounds)."""

    arm: str
    rate: float
    multiplier: float  # the rate over the base rate (0 where there is none: the sweep)
    total: Slice
    classes: dict[int, Slice] = field(default_factory=dict)  # by priority
    tenants: dict[str, Slice] = field(default_factory=dict)
    shed: dict[str, int] = field(default_factory=dict)  # refusals by X-Disagg-Shed-Reason
    server_errors: int = 0  # 5xx answers: there should be none
    failed: int = 0  # no answer, a stream cut short, or any other status
    ttft_p90_ms: float = 0.0  # of the requests served (200)
    tpot_p90_ms: float = 0.0
    rounds: int = 1
    goodput_range: tuple[float, float] = (0.0, 0.0)  # min and max over rounds


def summarise(
    arm: str,
    rate: float,
    multiplier: float,
    outcomes: Sequence[Outcome],
    *,
    ttft_ms: float,
    tpot_ms: float,
    warmup_s: float,
    window_s: float,
) -> AdmissionPoint:
    """The point's figures over the requests that arrived after ``warmup_s``."""
    rows = [o for o in outcomes if o.at_s >= warmup_s]
    served = [o for o in rows if o.ok]

    def by(key: Callable[[Outcome], K]) -> dict[K, Slice]:
        groups: dict[K, list[Outcome]] = {}
        for o in rows:
            groups.setdefault(key(o), []).append(o)
        return {k: slice_of(groups[k], ttft_ms, tpot_ms, window_s) for k in sorted(groups)}

    total = slice_of(rows, ttft_ms, tpot_ms, window_s)
    return AdmissionPoint(
        arm=arm,
        rate=rate,
        multiplier=multiplier,
        total=total,
        classes=by(lambda o: o.priority),
        tenants=by(lambda o: o.tenant),
        shed=dict(sorted(Counter(o.shed_reason or "?" for o in rows if o.status == 429).items())),
        server_errors=sum(1 for o in rows if o.status >= 500),
        failed=sum(1 for o in rows if not o.ok and o.status != 429 and o.status < 500),
        ttft_p90_ms=round(percentile([o.ttft_s for o in served], 0.9) * 1000, 1) if served else 0.0,
        tpot_p90_ms=round(percentile([o.tpot_s for o in served], 0.9) * 1000, 1) if served else 0.0,
        goodput_range=(total.goodput_rps, total.goodput_rps),
    )


def _median(values: Iterable[float]) -> float:
    return round(float(statistics.median(values)), 4)


def median_slice(slices: Sequence[Slice]) -> Slice:
    """Each figure's median over rounds."""
    return Slice(
        requests=round(_median(s.requests for s in slices)),
        met=round(_median(s.met for s in slices)),
        refused=round(_median(s.refused for s in slices)),
        attainment=_median(s.attainment for s in slices),
        goodput_rps=_median(s.goodput_rps for s in slices),
    )


def _median_map(maps: Sequence[Mapping[K, Slice]]) -> dict[K, Slice]:
    keys = sorted({k for m in maps for k in m}, key=repr)
    empty = Slice(0, 0, 0, 0.0, 0.0)
    return {k: median_slice([m.get(k, empty) for m in maps]) for k in keys}


def median_point(rounds: Sequence[AdmissionPoint]) -> AdmissionPoint:
    """The medians over rounds of one (arm, rate); the goodput's min and max beside."""
    first = rounds[0]
    goodputs = [p.total.goodput_rps for p in rounds]
    reasons = sorted({r for p in rounds for r in p.shed})
    return AdmissionPoint(
        arm=first.arm,
        rate=first.rate,
        multiplier=first.multiplier,
        total=median_slice([p.total for p in rounds]),
        classes=_median_map([p.classes for p in rounds]),
        tenants=_median_map([p.tenants for p in rounds]),
        shed={r: round(_median(p.shed.get(r, 0) for p in rounds)) for r in reasons},
        server_errors=max(p.server_errors for p in rounds),  # any 5xx in any round shows
        failed=round(_median(p.failed for p in rounds)),
        ttft_p90_ms=_median(p.ttft_p90_ms for p in rounds),
        tpot_p90_ms=_median(p.tpot_p90_ms for p in rounds),
        rounds=len(rounds),
        goodput_range=(min(goodputs), max(goodputs)),
    )


def rate_at_attainment(points: Iterable[tuple[float, float]], target: float = TARGET_ATTAINMENT) -> float:
    """The offered load where attainment crosses ``target``, interpolated linearly between the two
    measured rates around the first crossing, from (rate, attainment) pairs. ``ValueError`` when the
    rates do not bracket it (all above or all below the target)."""
    pairs = sorted(points)
    if not pairs:
        raise ValueError("no rates measured")
    if pairs[0][1] < target:
        raise ValueError(f"attainment is {pairs[0][1]:.1%} at {pairs[0][0]:g} req/s: lower --rates")
    for (r0, a0), (r1, a1) in itertools.pairwise(pairs):
        if a1 < target:
            return round(r0 + (r1 - r0) * (a0 - target) / (a0 - a1), 2)
    raise ValueError(f"attainment is {pairs[-1][1]:.1%} at {pairs[-1][0]:g} req/s: higher --rates")


def next_rate(points: Iterable[tuple[float, float]], target: float = TARGET_ATTAINMENT) -> float | None:
    """The rate to measure next when the (rate, attainment) pairs do not bracket ``target``: a quarter
    above the highest while all attain it, a fifth below the lowest while none does; None once they do."""
    pairs = sorted(points)
    if not pairs:
        raise ValueError("no rates measured")
    if pairs[0][1] < target:
        return round(pairs[0][0] / 1.25, 2)
    if all(a >= target for _, a in pairs):
        return round(pairs[-1][0] * 1.25, 2)
    return None


@dataclass(frozen=True, slots=True)
class Verdict:
    """One target checked on one point: what was measured against what was wanted."""

    arm: str
    rate: float
    what: str
    measured: float
    wanted: float  # measured >= wanted passes

    @property
    def met(self) -> bool:
        return self.measured >= self.wanted


def verdicts(points: Sequence[AdmissionPoint], sheddable_priority: int) -> list[Verdict]:
    """The issue's targets on every point past the base rate (multiplier > 1), each arm on its own:
    goodput at least 90% of the best at any lower rate; the top class's attainment at least 95%; the
    sheddable class refused first (its refused share at least every other class's); no 5xx."""
    out: list[Verdict] = []
    for p in sorted(points, key=lambda p: (p.arm, p.rate)):
        if p.multiplier <= 1:
            continue
        lower = [q.total.goodput_rps for q in points if q.arm == p.arm and q.rate < p.rate]
        if lower and max(lower) > 0:
            ratio = p.total.goodput_rps / max(lower)
            out.append(Verdict(p.arm, p.rate, "goodput over the best at a lower rate", ratio, NO_COLLAPSE))
        if p.classes:
            top = min(p.classes)
            attained = p.classes[top].attainment
            out.append(
                Verdict(p.arm, p.rate, f"attainment of priority {top}", attained, TOP_CLASS_ATTAINMENT)
            )
        shed = [s.refused_share for k, s in p.classes.items() if k >= sheddable_priority]
        others = [s.refused_share for k, s in p.classes.items() if k < sheddable_priority]
        if shed and others and p.total.refused:
            first = min(shed) - max(others)
            out.append(
                Verdict(p.arm, p.rate, "refused share: sheddable less the most of another", first, 0.0)
            )
        out.append(Verdict(p.arm, p.rate, "5xx answers (negated)", -p.server_errors, 0.0))
    return out


def tenant_verdicts(points: Sequence[AdmissionPoint], steady: str) -> list[Verdict]:
    """The steady tenant's attainment on every point, against 95%; no 5xx."""
    out = []
    for p in points:
        if steady in p.tenants:
            attained = p.tenants[steady].attainment
            out.append(Verdict(p.arm, p.rate, f"attainment of {steady}", attained, STEADY_TENANT_ATTAINMENT))
        out.append(Verdict(p.arm, p.rate, "5xx answers (negated)", -p.server_errors, 0.0))
    return out


# -- the tables ---------------------------------------------------------------------------------


def _goodput(p: AdmissionPoint) -> str:
    low, high = p.goodput_range
    return f"{p.total.goodput_rps:g}" + (f" [{low:g}-{high:g}]" if p.rounds > 1 else "")


def _shed(shed: Mapping[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in shed.items() if n) or "-"


def render_sweep(points: Sequence[AdmissionPoint]) -> list[str]:
    """The sweep without admission that finds the base rate."""
    lines = [
        "| offered req/s | arm | requests | attainment | goodput req/s [min-max] | TTFT p90 ms | TPOT p90 ms "
        "| 5xx | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(points, key=lambda p: p.rate):
        lines.append(
            f"| {p.rate:g} | {p.arm} | {p.total.requests} | {p.total.attainment:.1%} | {_goodput(p)} "
            f"| {p.ttft_p90_ms:g} | {p.tpot_p90_ms:g} | {p.server_errors} | {p.failed} |"
        )
    return lines


def _times(p: AdmissionPoint) -> str:
    return f"{p.multiplier:g}" if p.multiplier else "-"


def render_totals(points: Sequence[AdmissionPoint]) -> list[str]:
    """Per arm and rate, the whole point. Refused requests count as missing."""
    lines = [
        "| x base | offered req/s | arm | requests | attainment (refused = missed) | goodput req/s [min-max] "
        "| refused | shed by reason | 5xx | failed | TTFT p90 ms | TPOT p90 ms |",
        "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for p in points:
        t = p.total
        lines.append(
            f"| {_times(p)} | {p.rate:g} | {p.arm} | {t.requests} | {t.attainment:.1%} | {_goodput(p)} "
            f"| {t.refused} | {_shed(p.shed)} | {p.server_errors} | {p.failed} | {p.ttft_p90_ms:g} "
            f"| {p.tpot_p90_ms:g} |"
        )
    return lines


def render_points(points: Sequence[AdmissionPoint]) -> list[str]:
    """Per arm and rate: the whole point, then its classes."""
    ordered = sorted(points, key=lambda p: (p.rate, p.arm))
    by_class = render_slices(ordered, "priority", lambda p: {str(k): s for k, s in p.classes.items()})
    return [*render_totals(ordered), "", *by_class]


def render_slices(
    points: Sequence[AdmissionPoint], title: str, slices: Callable[[AdmissionPoint], Mapping[str, Slice]]
) -> list[str]:
    """One row per (point, class or tenant)."""
    lines = [
        f"| x base | offered req/s | arm | {title} | requests | refused | attainment (refused = missed) "
        "| goodput req/s |",
        "|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for p in points:
        for name, s in slices(p).items():
            lines.append(
                f"| {_times(p)} | {p.rate:g} | {p.arm} | {name} | {s.requests} "
                f"| {s.refused} ({s.refused_share:.1%}) | {s.attainment:.1%} | {s.goodput_rps:g} |"
            )
    return lines


def render_verdicts(found: Sequence[Verdict]) -> list[str]:
    """One line per target checked: met or not, and by how much."""
    return [
        f"{'met' if v.met else 'NOT MET'}: {v.arm} at {v.rate:g} req/s, {v.what}: {v.measured:.3g} "
        f"(wanted >= {v.wanted:g})"
        for v in found
    ]
