"""The simulator's trace library: synthetic workloads and ``describe`` (the Mooncake loader and writer
are in ``mooncake``).

Synthetic workloads are pure functions of a frozen spec: the same spec (seed included) gives the same
trace, and a longer horizon extends a shorter one rather than reshuffling it, because requests are
drawn lazily in arrival order. A spec combines an arrival process (``Poisson``, ``Bursty``,
``Diurnal``), length distributions (``Lengths``) and a prompt structure: ``Independent`` prompts
(two phases make a workload shift), ``PrefixShared`` documents with Zipf popularity, or
``MultiTurn`` sessions. ``SYNTHETIC`` names the presets the CLI offers.

Block ids follow Mooncake: an id names its whole prefix, so two prompts carry the same id at a
position only if they are equal up to the end of that block. Every generator draws fresh ids from one
counter, so an unshared block can never collide with a shared one, and a partial last block always
gets a fresh id (Mooncake's own files never reuse a partial block's id either: its content changes
once a later prompt extends it).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_disagg.cluster_sim.trace import Trace, TraceRequest

DEFAULT_RATE_PER_S = 4.0
DEFAULT_DURATION_S = 300.0
DEFAULT_BLOCK_TOKENS = 16  # vLLM's default block size


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


# --- arrival processes: each yields 0.0 first (the trace's first request), then increasing times


class Arrivals(Protocol):
    """An arrival process: an endless, increasing run of arrival times starting at 0."""

    def times(self, rng: random.Random) -> Iterator[float]:
        """The arrival times, drawn from ``rng``."""
        ...


@dataclass(frozen=True, slots=True)
class Poisson:
    """Arrivals at a constant rate with exponential gaps."""

    rate_per_s: float

    def __post_init__(self) -> None:
        check(self.rate_per_s > 0, f"poisson: rate_per_s must be > 0, got {self.rate_per_s}")

    def times(self, rng: random.Random) -> Iterator[float]:
        """Memoryless, so starting with an arrival at 0 biases nothing."""
        t = 0.0
        while True:
            yield t
            t += rng.expovariate(self.rate_per_s)


@dataclass(frozen=True, slots=True)
class Bursty:
    """A two-state Markov-modulated Poisson process: calm spells and bursts ``burst_ratio`` times as
    busy, bursts taking ``burst_fraction`` of the time; the long-run mean rate is ``rate_per_s``.

    Bursts that last many inter-arrival gaps make the gaps' coefficient of variation well above 1
    (about 1.9 with the defaults), where a Poisson process has exactly 1.
    """

    rate_per_s: float
    burst_ratio: float = 10.0
    burst_fraction: float = 0.2
    mean_burst_s: float = 5.0

    def __post_init__(self) -> None:
        check(self.rate_per_s > 0, f"bursty: rate_per_s must be > 0, got {self.rate_per_s}")
        check(self.burst_ratio >= 1, f"bursty: burst_ratio must be >= 1, got {self.burst_ratio}")
        check(0 < self.burst_fraction < 1, f"bursty: burst_fraction not in (0, 1): {self.burst_fraction}")
        check(self.mean_burst_s > 0, f"bursty: mean_burst_s must be > 0, got {self.mean_burst_s}")

    def times(self, rng: random.Random) -> Iterator[float]:
        """Within a state arrivals are Poisson; at a state change the pending gap is redrawn, which
        memorylessness allows."""
        calm_rate = self.rate_per_s / (1 + self.burst_fraction * (self.burst_ratio - 1))
        rates = (calm_rate, calm_rate * self.burst_ratio)
        spells = (self.mean_burst_s * (1 - self.burst_fraction) / self.burst_fraction, self.mean_burst_s)
        state = int(rng.random() < self.burst_fraction)  # start in the stationary distribution
        t = 0.0
        end = rng.expovariate(1 / spells[state])
        yield t
        while True:
            gap = rng.expovariate(rates[state])
            if t + gap < end:
                t += gap
                yield t
            else:
                t, state = end, 1 - state
                end = t + rng.expovariate(1 / spells[state])


@dataclass(frozen=True, slots=True)
class Diurnal:
    """A rate that follows a day: ``rate_per_s * (1 + amplitude * cos(2π (t - peak_at_s) / period_s))``,
    drawn by thinning (Lewis-Shedler) a Poisson process at the peak rate."""

    rate_per_s: float
    period_s: float = DEFAULT_DURATION_S
    amplitude: float = 0.8
    peak_at_s: float = DEFAULT_DURATION_S / 2

    def __post_init__(self) -> None:
        check(self.rate_per_s > 0, f"diurnal: rate_per_s must be > 0, got {self.rate_per_s}")
        check(self.period_s > 0, f"diurnal: period_s must be > 0, got {self.period_s}")
        check(0 <= self.amplitude <= 1, f"diurnal: amplitude must be in [0, 1], got {self.amplitude}")

    def rate_at(self, t: float) -> float:
        """The instantaneous rate at ``t``."""
        phase = 2 * math.pi * (t - self.peak_at_s) / self.period_s
        return self.rate_per_s * (1 + self.amplitude * math.cos(phase))

    def times(self, rng: random.Random) -> Iterator[float]:
        """Candidates at the peak rate, each kept with probability ``rate_at(t) / peak``."""
        peak = self.rate_per_s * (1 + self.amplitude)
        t = 0.0
        yield t
        while True:
            t += rng.expovariate(peak)
            if rng.random() * peak < self.rate_at(t):
                yield t


# --- lengths and block ids


@dataclass(frozen=True, slots=True)
class Lengths:
    """Token counts drawn log-normally around ``median`` (``sigma`` in log space; 0: always the
    median), clipped to [``low``, ``high``]. The mean is about ``median * exp(sigma² / 2)``."""

    median: int
    sigma: float = 0.5
    low: int = 1
    high: int = 4096

    def __post_init__(self) -> None:
        check(1 <= self.low <= self.median <= self.high, f"lengths: need 1 <= low <= median <= high: {self}")
        check(self.sigma >= 0, f"lengths: sigma must be >= 0, got {self.sigma}")

    def sample(self, rng: random.Random) -> int:
        """One length."""
        if self.sigma == 0:
            return self.median
        drawn = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, drawn))


def blocks_of(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


class _Ids:
    """Fresh block ids from one counter: an id handed out once is never handed out again."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        first = self.next
        self.next += n
        return tuple(range(first, self.next))


def _rngs(seed: int) -> tuple[random.Random, random.Random]:
    """Separate streams for arrivals and content, so presets with one seed and rate share arrival
    times. String seeds hash with SHA-512 (stable across runs) and keep -1 apart from 1, which
    ``random.Random`` would merge for ints."""
    return random.Random(f"{seed}/arrivals"), random.Random(f"{seed}/content")


# --- workload specs


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """What every synthetic spec has: arrivals, a seed, the block size and the horizon. Generation
    stops after ``n_requests`` requests or past ``duration_s`` seconds, whichever comes first."""

    arrivals: Arrivals
    seed: int = 0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    n_requests: int | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        self._check_run()

    def _check_run(self) -> None:
        check(self.block_tokens >= 1, f"block_tokens must be >= 1, got {self.block_tokens}")
        n, duration = self.n_requests, self.duration_s
        check(n is not None or duration is not None, "a trace needs n_requests or duration_s to end")
        check(n is None or n >= 1, f"n_requests must be >= 1, got {n}")
        check(duration is None or duration >= 0, f"duration_s must be >= 0, got {duration}")


DEFAULT_PROMPT = Lengths(512, sigma=0.8, low=32, high=4096)
DEFAULT_OUTPUT = Lengths(128, sigma=0.8, low=8, high=1024)


@dataclass(frozen=True, slots=True)
class Phase:
    """From ``start_s`` on, prompts and outputs follow these lengths."""

    start_s: float
    prompt: Lengths = DEFAULT_PROMPT
    output: Lengths = DEFAULT_OUTPUT


@dataclass(frozen=True, slots=True, kw_only=True)
class Independent(Run):
    """Prompts that share nothing; a request's lengths follow the phase its arrival falls in (one
    phase: a steady workload; two: a workload shift)."""

    phases: tuple[Phase, ...] = (Phase(0.0),)

    def __post_init__(self) -> None:
        self._check_run()
        starts = [p.start_s for p in self.phases]
        check(bool(starts) and starts[0] == 0, f"independent: the first phase must start at 0: {starts}")
        check(starts == sorted(set(starts)), f"independent: phase starts must increase: {starts}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixShared(Run):
    """Each request reads one of ``documents`` shared documents, picked with Zipf popularity (rank r
    with weight ``r ** -zipf_s``), then asks a question of its own: prompt = the document's blocks
    + unique question blocks. Documents are whole blocks, so the question starts a fresh block."""

    documents: int = 100
    zipf_s: float = 1.1
    document: Lengths = Lengths(1024, sigma=0.5, low=256, high=3072)
    question: Lengths = Lengths(64, sigma=0.6, low=8, high=512)
    output: Lengths = DEFAULT_OUTPUT

    def __post_init__(self) -> None:
        self._check_run()
        check(self.documents >= 1, f"prefix: documents must be >= 1, got {self.documents}")
        check(self.zipf_s >= 0, f"prefix: zipf_s must be >= 0, got {self.zipf_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiTurn(Run):
    """Chat sessions: ``arrivals`` starts sessions; each has ``turns_low``..``turns_high`` turns
    (uniform) ``think_s`` apart on average (exponential; open loop, so it includes the time to
    answer). Turn 1 = a system prompt shared by all sessions (rounded up to whole blocks) + a first
    question; turn k = turn k-1's prompt + its output + a new question, so a session's prefix grows.
    A session ends early rather than exceed ``max_prompt_tokens`` (a context limit)."""

    turns_low: int = 2
    turns_high: int = 8
    think_s: float = 15.0
    system_tokens: int = 256
    first: Lengths = Lengths(256, sigma=0.6, low=16, high=2048)
    question: Lengths = Lengths(64, sigma=0.6, low=8, high=512)
    output: Lengths = Lengths(128, sigma=0.6, low=8, high=1024)
    max_prompt_tokens: int = 4096

    def __post_init__(self) -> None:
        self._check_run()
        check(1 <= self.turns_low <= self.turns_high, f"multiturn: turns_low/high: {self}")
        check(self.think_s > 0, f"multiturn: think_s must be > 0, got {self.think_s}")
        # The system prompt is whole blocks and must leave room for a first question.
        system = blocks_of(self.system_tokens, self.block_tokens) * self.block_tokens
        fits = self.system_tokens >= 0 and system < self.max_prompt_tokens
        check(fits, f"multiturn: system_tokens must leave room in max_prompt_tokens: {self}")


# --- generators


def _take(requests: Iterator[TraceRequest], run: Run) -> list[TraceRequest]:
    """The stream's requests up to the horizon; the stream is in arrival order."""
    out: list[TraceRequest] = []
    for request in requests:
        if run.duration_s is not None and request.at_s > run.duration_s:
            break
        out.append(request)
        if run.n_requests is not None and len(out) >= run.n_requests:
            break
    return out


def _independent_requests(spec: Independent) -> Iterator[TraceRequest]:
    arrival_rng, rng = _rngs(spec.seed)
    ids, size = _Ids(), spec.block_tokens
    phase = 0
    for t in spec.arrivals.times(arrival_rng):
        while phase + 1 < len(spec.phases) and t >= spec.phases[phase + 1].start_s:
            phase += 1
        prompt = spec.phases[phase].prompt.sample(rng)
        output = spec.phases[phase].output.sample(rng)
        yield TraceRequest(t, prompt, output, ids.take(blocks_of(prompt, size)), size)


def independent_trace(spec: Independent, name: str = "independent") -> Trace:
    """Requests with unshared prompts (steady, or shifting between phases)."""
    return Trace(name, _take(_independent_requests(spec), spec), repr(spec))


def _prefix_requests(spec: PrefixShared) -> Iterator[TraceRequest]:
    arrival_rng, rng = _rngs(spec.seed)
    ids, size = _Ids(), spec.block_tokens
    docs = [ids.take(blocks_of(spec.document.sample(rng), size)) for _ in range(spec.documents)]
    cumulative: list[float] = []
    total = 0.0
    for rank in range(1, spec.documents + 1):
        total += rank**-spec.zipf_s
        cumulative.append(total)
    for t in spec.arrivals.times(arrival_rng):
        doc = docs[min(bisect.bisect_right(cumulative, rng.random() * total), spec.documents - 1)]
        question = spec.question.sample(rng)
        blocks = doc + ids.take(blocks_of(question, size))
        yield TraceRequest(t, len(doc) * size + question, spec.output.sample(rng), blocks, size)


def prefix_trace(spec: PrefixShared, name: str = "prefix") -> Trace:
    """Requests that share Zipf-popular documents as prefixes."""
    return Trace(name, _take(_prefix_requests(spec), spec), repr(spec))


@dataclass(slots=True)
class _Session:
    name: str
    turns_left: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    blocks: tuple[int, ...] = ()


def _multiturn_requests(spec: MultiTurn) -> Iterator[TraceRequest]:
    """Session starts and later turns merged in time order through a heap, drawn lazily."""
    arrival_rng, rng = _rngs(spec.seed)
    ids, size = _Ids(), spec.block_tokens
    system = ids.take(blocks_of(spec.system_tokens, size))
    starts = spec.arrivals.times(arrival_rng)
    next_start = next(starts)
    pending: list[tuple[float, int, _Session]] = []  # (next turn's time, push order, session)
    sessions = pushes = 0
    while True:
        if pending and pending[0][0] < next_start:
            t, _, session = heapq.heappop(pending)
            grown = session.prompt_tokens + session.output_tokens + spec.question.sample(rng)
            if grown > spec.max_prompt_tokens:
                continue
            # Full blocks carry over; the old partial block is refilled, so it gets a fresh id.
            full = session.prompt_tokens // size
            session.blocks = session.blocks[:full] + ids.take(blocks_of(grown, size) - full)
            session.prompt_tokens = grown
        else:
            t, next_start = next_start, next(starts)
            session = _Session(f"s{sessions}", rng.randint(spec.turns_low, spec.turns_high))
            sessions += 1
            first = min(spec.first.sample(rng), spec.max_prompt_tokens - len(system) * size)
            session.blocks = system + ids.take(blocks_of(first, size))
            session.prompt_tokens = len(system) * size + first
        session.output_tokens = spec.output.sample(rng)
        session.turns_left -= 1
        yield TraceRequest(
            t, session.prompt_tokens, session.output_tokens, session.blocks, size, session.name
        )
        if session.turns_left > 0:
            pushes += 1  # a deterministic tie-break, so sessions themselves are never compared
            heapq.heappush(pending, (t + rng.expovariate(1 / spec.think_s), pushes, session))


def multiturn_trace(spec: MultiTurn, name: str = "multiturn") -> Trace:
    """Multi-turn chat sessions whose prompts grow turn by turn."""
    return Trace(name, _take(_multiturn_requests(spec), spec), repr(spec))


# --- presets: the named workloads the CLI offers, sized for a small tiny-model cluster


class Preset(Protocol):
    """A named synthetic workload; with neither horizon given it runs ``DEFAULT_DURATION_S``."""

    def __call__(
        self,
        *,
        rate_per_s: float = ...,
        duration_s: float | None = ...,
        n_requests: int | None = ...,
        seed: int = ...,
        block_tokens: int = ...,
    ) -> Trace: ...


@dataclass(frozen=True, slots=True)
class _Horizon:
    run: dict[str, Any]  # the ``Run`` fields a preset passes on: seed, block size, horizon
    span_s: float  # how long the trace should last, to place a shift or a day in it


def _preset(build: Callable[[float, _Horizon], Trace]) -> Preset:
    """``build`` behind the presets' common keyword signature and defaults."""

    def preset(
        *,
        rate_per_s: float = DEFAULT_RATE_PER_S,
        duration_s: float | None = None,
        n_requests: int | None = None,
        seed: int = 0,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> Trace:
        check(rate_per_s > 0, f"rate_per_s must be > 0, got {rate_per_s}")
        if duration_s is None and n_requests is None:
            duration_s = DEFAULT_DURATION_S
        span = duration_s if duration_s is not None else (n_requests or 1) / rate_per_s
        run = {"seed": seed, "block_tokens": block_tokens, "n_requests": n_requests, "duration_s": duration_s}
        return build(rate_per_s, _Horizon(run, span))

    preset.__name__ = preset.__qualname__ = build.__name__
    preset.__doc__ = build.__doc__
    return preset


@_preset
def preset_poisson(rate: float, h: _Horizon) -> Trace:
    """Poisson arrivals, unshared prompts of median 512 tokens (32..4096), outputs of median 128."""
    return independent_trace(Independent(arrivals=Poisson(rate), **h.run), "poisson")


@_preset
def preset_bursty(rate: float, h: _Horizon) -> Trace:
    """``poisson``'s lengths, ``Bursty`` arrivals: 5 s bursts at 10x the calm rate, 20% of the time."""
    return independent_trace(Independent(arrivals=Bursty(rate), **h.run), "bursty")


@_preset
def preset_diurnal(rate: float, h: _Horizon) -> Trace:
    """``poisson``'s lengths over one "day" as long as the trace: the rate swings ±80% around
    ``rate_per_s``, quiet at both ends and peaking halfway."""
    arrivals = Diurnal(rate, period_s=h.span_s, peak_at_s=h.span_s / 2)
    return independent_trace(Independent(arrivals=arrivals, **h.run), "diurnal")


SHIFT_BEFORE = Phase(
    0.0, Lengths(2048, sigma=0.3, low=1024, high=4096), Lengths(32, sigma=0.5, low=4, high=128)
)
SHIFT_AFTER_PROMPT = Lengths(256, sigma=0.5, low=32, high=1024)
SHIFT_AFTER_OUTPUT = Lengths(512, sigma=0.3, low=128, high=2048)


@_preset
def preset_shift(rate: float, h: _Horizon) -> Trace:
    """Poisson arrivals; the first half of the trace sends long prompts (median 2048) for short
    outputs (median 32), the second half short prompts (median 256) for long outputs (median 512):
    the prefill/decode balance flips, which the planner should follow."""
    phases = (SHIFT_BEFORE, Phase(h.span_s / 2, SHIFT_AFTER_PROMPT, SHIFT_AFTER_OUTPUT))
    return independent_trace(Independent(arrivals=Poisson(rate), phases=phases, **h.run), "shift")


PREFIX_DOCUMENTS = 2000
PREFIX_DOCUMENT = Lengths(2048, sigma=0.4, low=512, high=4096)
PREFIX_ZIPF_S = 0.9


@_preset
def preset_prefix(rate: float, h: _Horizon) -> Trace:
    """Poisson arrivals; each prompt = one of 2,000 documents (median 2,048 tokens, about 4.5M tokens in
    all: more than one engine's KV cache holds, on a GPU as on the simulated engine; Zipf s=0.9, a long
    tail) + a question of median 64 tokens; outputs median 128. Where a document's KV is matters."""
    spec = PrefixShared(
        arrivals=Poisson(rate), documents=PREFIX_DOCUMENTS, document=PREFIX_DOCUMENT, zipf_s=PREFIX_ZIPF_S,
        **h.run,
    )  # fmt: skip
    return prefix_trace(spec, "prefix")


@_preset
def preset_multiturn(rate: float, h: _Horizon) -> Trace:
    """Chat sessions of 2..8 turns about 15 s apart after a shared 256-token system prompt, prompts
    growing to at most 4096 tokens; sessions start at ``rate_per_s / 5`` so that requests arrive at
    about ``rate_per_s`` once sessions overlap (fewer in the first minute)."""
    return multiturn_trace(MultiTurn(arrivals=Poisson(rate / 5), **h.run), "multiturn")  # 5: mean turns


SYNTHETIC: dict[str, Preset] = {
    "poisson": preset_poisson,
    "bursty": preset_bursty,
    "diurnal": preset_diurnal,
    "shift": preset_shift,
    "prefix": preset_prefix,
    "multiturn": preset_multiturn,
}


# --- statistics


def _percentile(ordered: list[int], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)]) if ordered else 0.0


def prefix_hits(trace: Trace) -> tuple[int, int]:
    """(prompt blocks that repeat an earlier request's block at the same position, all prompt blocks).

    A request's hits are its longest run of such blocks from the start: a prefix cache can reuse
    nothing past the first block it has not seen, whatever ids follow."""
    seen: dict[int, int] = {}  # block id -> position it was first seen at
    hits = total = 0
    for r in trace.requests:
        blocks = r.block_ids
        run = 0
        while run < len(blocks) and seen.get(blocks[run]) == run:
            run += 1
        hits += run
        total += len(blocks)
        for position in range(run, len(blocks)):
            seen.setdefault(blocks[position], position)
    return hits, total


def describe(trace: Trace) -> dict[str, float]:
    """The numbers a report prints about a trace: size, rate, length percentiles and the ideal
    prefix-hit ratio (what an infinite, shared prefix cache would reuse, in blocks)."""
    reqs = trace.requests
    inputs = sorted(r.input_tokens for r in reqs)
    outputs = sorted(r.output_tokens for r in reqs)
    hits, blocks = prefix_hits(trace)
    duration = trace.duration_s
    return {
        "requests": len(reqs),
        "sessions": len({r.session for r in reqs if r.session}),
        "duration_s": duration,
        # From the mean gap between arrivals: n - 1 gaps span the trace.
        "rate_per_s": (len(reqs) - 1) / duration if duration > 0 else 0.0,
        "input_tokens_mean": sum(inputs) / len(inputs) if inputs else 0.0,
        "input_tokens_p50": _percentile(inputs, 0.50),
        "input_tokens_p99": _percentile(inputs, 0.99),
        "output_tokens_mean": sum(outputs) / len(outputs) if outputs else 0.0,
        "output_tokens_p50": _percentile(outputs, 0.50),
        "output_tokens_p99": _percentile(outputs, 0.99),
        "prompt_blocks": blocks,
        "prefix_hit_ratio": hits / blocks if blocks else 0.0,
    }
