"""The cluster simulator's traces: synthetic arrival processes and prompt structures, the Mooncake
loader and writer, and the statistics a report prints."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_disagg.cluster_sim import traces
from vllm_disagg.cluster_sim.mooncake import dump_mooncake, load_mooncake
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest, prompt_token_ids
from vllm_disagg.cluster_sim.traces import (
    SYNTHETIC,
    Bursty,
    Diurnal,
    Independent,
    Lengths,
    MultiTurn,
    Phase,
    Poisson,
    PrefixShared,
    describe,
)

PRESETS = sorted(SYNTHETIC)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def _common_prefix(sequences: list[tuple[int, ...]]) -> int:
    """How many leading blocks all ``sequences`` share."""
    shortest = min(len(s) for s in sequences)
    return next((i for i in range(shortest) if len({s[i] for s in sequences}) > 1), shortest)


def _times(process: traces.Arrivals, n: int, seed: int = 1) -> list[float]:
    return list(itertools.islice(process.times(random.Random(seed)), n))


# --- every preset


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_is_a_function_of_its_seed(name: str) -> None:
    preset = SYNTHETIC[name]
    first = preset(n_requests=300, seed=7)
    assert first.requests == preset(n_requests=300, seed=7).requests
    assert first.requests != preset(n_requests=300, seed=8).requests
    assert len(first.requests) == 300
    assert first.name == name


@pytest.mark.parametrize("name", PRESETS)
def test_a_longer_horizon_extends_a_shorter_one(name: str) -> None:
    # Requests are drawn lazily in arrival order, so asking for more never reshuffles the start.
    short = SYNTHETIC[name](n_requests=100, seed=3, duration_s=10_000)
    long = SYNTHETIC[name](n_requests=400, seed=3, duration_s=10_000)
    assert long.requests[:100] == short.requests


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_stops_at_its_duration(name: str) -> None:
    trace = SYNTHETIC[name](duration_s=60, rate_per_s=5)
    assert trace.requests[0].at_s == 0
    assert 0 < trace.duration_s <= 60
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(trace.requests))


@pytest.mark.parametrize("name", PRESETS)
def test_block_ids_follow_mooncake(name: str) -> None:
    """Each prompt has one id per block; an id always sits at one position after one predecessor, so
    equal ids mean equal prefixes, and the token ids agree wherever the blocks do."""
    block_tokens = 16
    trace = SYNTHETIC[name](n_requests=400, seed=1, block_tokens=block_tokens)
    seen: dict[int, tuple[int, int | None]] = {}
    for r in trace.requests:
        assert len(r.block_ids) == math.ceil(r.input_tokens / block_tokens)
        assert len(prompt_token_ids(r)) == r.input_tokens
        for position, block in enumerate(r.block_ids):
            where = (position, r.block_ids[position - 1] if position else None)
            assert seen.setdefault(block, where) == where


# --- arrival processes


def test_poisson_arrivals_have_the_rate_and_exponential_gaps() -> None:
    times = _times(Poisson(5.0), 20_000)
    gaps = _gaps(times)
    assert len(gaps) / times[-1] == pytest.approx(5.0, rel=0.03)
    assert _cv(gaps) == pytest.approx(1.0, abs=0.05)
    # Exponential: P(gap > mean) = 1/e, and P(gap > 3 * mean) = e^-3.
    mean = statistics.fmean(gaps)
    assert sum(g > mean for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)
    assert sum(g > 3 * mean for g in gaps) / len(gaps) == pytest.approx(math.exp(-3), abs=0.01)


def test_bursty_arrivals_keep_the_mean_rate_with_clustered_gaps() -> None:
    times = _times(Bursty(4.0), 20_000)
    gaps = _gaps(times)
    assert _cv(gaps) > 1.5  # a Poisson process has 1
    assert len(gaps) / times[-1] == pytest.approx(4.0, rel=0.2)


def test_diurnal_arrivals_peak_where_the_sinusoid_peaks() -> None:
    period, peak_at = 100.0, 35.0
    process = Diurnal(20.0, period_s=period, amplitude=0.8, peak_at_s=peak_at)
    times = [t for t in _times(process, 40_000) if t < 10 * period]
    bins = Counter(int((t % period) // (period / 10)) for t in times)  # ten 10 s slices of a day
    assert max(bins, key=lambda b: bins[b]) == 3  # the slice holding the peak at 35 s
    assert min(bins, key=lambda b: bins[b]) == 8  # the trough is at 85 s
    assert bins[3] > 4 * bins[8]
    assert len(times) / (10 * period) == pytest.approx(20.0, rel=0.05)  # the mean rate holds


@pytest.mark.parametrize(
    ("process", "message"),
    [
        (lambda: Poisson(0), "rate_per_s"),
        (lambda: Bursty(1, burst_fraction=1), "burst_fraction"),
        (lambda: Diurnal(1, amplitude=1.5), "amplitude"),
        (lambda: Lengths(10, low=20), "low <= median"),
        (lambda: Independent(arrivals=Poisson(1)), "n_requests or duration_s"),
        (lambda: Independent(arrivals=Poisson(1), n_requests=5, phases=(Phase(1.0),)), "start at 0"),
        (lambda: MultiTurn(arrivals=Poisson(1), n_requests=5, turns_low=3, turns_high=2), "turns_low"),
    ],
    ids=[
        "a rate must be positive",
        "bursts cannot take all the time",
        "a diurnal rate cannot go negative",
        "lengths must bracket their median",
        "a trace must end somewhere",
        "phases must cover the start",
        "a session needs a turn range",
    ],
)
def test_specs_refuse_bad_values(process: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        process()


# --- prompt structures


def test_lengths_stay_within_bounds_around_the_median() -> None:
    lengths = Lengths(200, sigma=1.0, low=50, high=800)
    rng = random.Random(0)
    drawn = [lengths.sample(rng) for _ in range(5000)]
    assert min(drawn) == 50 and max(drawn) == 800
    assert statistics.median(drawn) == pytest.approx(200, rel=0.1)
    assert Lengths(77, sigma=0).sample(rng) == 77


def test_independent_prompts_share_no_block() -> None:
    trace = traces.independent_trace(Independent(arrivals=Poisson(10), n_requests=500))
    blocks = [b for r in trace.requests for b in r.block_ids]
    assert len(blocks) == len(set(blocks))
    assert describe(trace)["prefix_hit_ratio"] == 0


def test_zipf_documents_are_shared_by_popularity() -> None:
    spec = PrefixShared(arrivals=Poisson(10), n_requests=3000, documents=50, zipf_s=1.1)
    trace = traces.prefix_trace(spec)
    readers: defaultdict[int, list[tuple[int, ...]]] = defaultdict(list)
    for r in trace.requests:
        readers[r.block_ids[0]].append(r.block_ids)  # a document's first block names it
    counts = sorted((len(group) for group in readers.values()), reverse=True)
    assert counts[0] > 8 * counts[len(counts) // 2]
    # A prompt is a whole document (at least 256 tokens here) and then blocks no one else has.
    tails: list[int] = []
    for group in readers.values():
        if len(group) > 1:
            document = _common_prefix(group)
            assert document >= 256 // 16
            tails += [b for blocks in group for b in blocks[document:]]
    assert len(tails) == len(set(tails))
    assert describe(trace)["prefix_hit_ratio"] > 0.5


def test_multiturn_prompts_grow_from_the_previous_turn() -> None:
    trace = SYNTHETIC["multiturn"](n_requests=600, seed=2, block_tokens=16)
    turns: defaultdict[str, list[TraceRequest]] = defaultdict(list)
    for r in trace.requests:
        turns[r.session].append(r)
    assert "" not in turns
    assert sum(len(t) > 2 for t in turns.values()) > 10
    system = trace.requests[0].block_ids[: 256 // 16]
    for session in turns.values():
        assert session[0].block_ids[: len(system)] == system  # every session shares the system prompt
        for before, after in itertools.pairwise(session):
            kept = before.input_tokens // 16  # full blocks; a partial one is refilled, so renamed
            assert after.block_ids[:kept] == before.block_ids[:kept]
            if kept < len(before.block_ids):
                assert after.block_ids[kept] not in before.block_ids
            assert after.input_tokens > before.input_tokens + before.output_tokens
            assert after.at_s > before.at_s
            assert prompt_token_ids(after)[: kept * 16] == prompt_token_ids(before)[: kept * 16]


def test_the_shift_flips_from_long_prompts_to_long_outputs() -> None:
    trace = SYNTHETIC["shift"](duration_s=200, rate_per_s=10)
    before = [r for r in trace.requests if r.at_s < 100]
    after = [r for r in trace.requests if r.at_s >= 100]
    assert len(before) > 500 and len(after) > 500

    def mean(requests: list[TraceRequest], field: str) -> float:
        return statistics.fmean(getattr(r, field) for r in requests)

    assert mean(before, "input_tokens") > 5 * mean(after, "input_tokens")
    assert mean(after, "output_tokens") > 10 * mean(before, "output_tokens")


# --- Mooncake


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_mooncake(tmp_path: Path) -> Path:
    return _write_jsonl(
        tmp_path / "tiny.jsonl",
        [
            '{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}',
            "",
            '{"timestamp": 500, "input_length": 1300, "output_length": 20, "hash_ids": [1, 2, 3]}',
            '{"timestamp": 2000, "input_length": 1536, "output_length": 30, "hash_ids": [1, 7, 8]}',
        ],
    )


@pytest.mark.parametrize(
    ("options", "inputs", "blocks", "outputs", "times"),
    [
        ({"length_scale": 1 / 8}, [125, 162, 192], [8, 11, 12], [10, 20, 30], [0, 0.5, 2]),
        ({"length_scale": 1 / 8, "block_tokens": 32}, [125, 162, 192], [4, 6, 6], [10, 20, 30], [0, 0.5, 2]),
        ({"length_scale": 1 / 4}, [250, 325, 384], [16, 21, 24], [10, 20, 30], [0, 0.5, 2]),
        ({"length_scale": 0.1}, [94, 122, 144], [6, 8, 9], [10, 20, 30], [0, 0.5, 2]),
        (
            {"length_scale": 1 / 8, "max_input_tokens": 150},
            [125, 150, 150],
            [8, 10, 10],
            [10, 20, 30],
            [0, 0.5, 2],
        ),
        (
            {"length_scale": 1 / 8, "time_scale": 2, "output_scale": 0.5},
            [125, 162, 192],
            [8, 11, 12],
            [5, 10, 15],
            [0, 0.25, 1],
        ),
    ],
    ids=[
        "a 512-token block becomes four 16-token blocks at 1/8",
        "or two 32-token blocks",
        "a larger scale keeps more tokens",
        "a scale is rounded to whole blocks per Mooncake block (3 x 16 / 512)",
        "long prompts are cut to the cap, blocks with them",
        "time_scale 2 replays twice as fast; output_scale shortens outputs",
    ],
)
def test_mooncake_lines_are_scaled_to_the_model(
    tiny_mooncake: Path,
    options: dict[str, float],
    inputs: list[int],
    blocks: list[int],
    outputs: list[int],
    times: list[float],
) -> None:
    trace = load_mooncake(tiny_mooncake, **options)  # type: ignore[arg-type]
    assert [r.input_tokens for r in trace.requests] == inputs
    assert [len(r.block_ids) for r in trace.requests] == blocks
    assert [r.output_tokens for r in trace.requests] == outputs
    assert [r.at_s for r in trace.requests] == pytest.approx(times)


def test_mooncake_sharing_is_preserved_exactly(tiny_mooncake: Path) -> None:
    first, second, third = load_mooncake(tiny_mooncake, length_scale=1 / 8).requests
    assert second.block_ids[:8] == first.block_ids  # hash ids 1, 2 -> four blocks each
    assert not set(second.block_ids[8:]) & set(first.block_ids)
    assert third.block_ids[:4] == first.block_ids[:4]  # only hash id 1 in common
    assert not set(third.block_ids[4:]) & set(first.block_ids + second.block_ids)
    assert len(set(third.block_ids)) == len(third.block_ids)
    assert describe(load_mooncake(tiny_mooncake, length_scale=1 / 8))["prefix_hit_ratio"] == pytest.approx(
        12 / 31
    )


def test_mooncake_lines_are_ordered_and_limited(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 3000, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
            '{"timestamp": 1000, "input_length": 20, "output_length": 2, "hash_ids": [2]}',
            '{"timestamp": 1000, "input_length": 30, "output_length": 3, "hash_ids": [3]}',
            "not even read",
        ],
    )
    trace = load_mooncake(path, limit=3)
    assert [(r.at_s, r.output_tokens) for r in trace.requests] == [(0, 2), (0, 3), (2, 1)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 10, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}', "'input_length'"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}', "'output_length'"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "'hash_ids'"),
        ('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}', "hash_ids has 1"),
    ],
    ids=[
        "not JSON",
        "not an object",
        "no timestamp",
        "a bool is not a length",
        "a negative output",
        "ids must be integers",
        "too few ids for the prompt",
    ],
)
def test_a_malformed_mooncake_line_is_named_by_its_number(tmp_path: Path, line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line 3: .*{message}"):
        load_mooncake(path)


def test_a_scale_below_one_block_is_refused(tiny_mooncake: Path) -> None:
    with pytest.raises(ValueError, match="length_scale"):
        load_mooncake(tiny_mooncake, length_scale=0.01)


@pytest.mark.parametrize(
    ("name", "block_tokens"),
    [("multiturn", 16), ("prefix", 16), ("shift", 24), ("bursty", 512)],
    ids=[
        "sessions survive",
        "shared prefixes survive",
        "a block size that does not divide 512",
        "Mooncake's own block size",
    ],
)
def test_a_dumped_trace_loads_back(tmp_path: Path, name: str, block_tokens: int) -> None:
    trace = SYNTHETIC[name](n_requests=200, seed=5, block_tokens=block_tokens)
    dump_mooncake(trace, tmp_path / "dump.jsonl")
    back = load_mooncake(tmp_path / "dump.jsonl", block_tokens=block_tokens, length_scale=block_tokens / 512)
    assert [r.at_s for r in back.requests] == pytest.approx([r.at_s for r in trace.requests])
    strip = [
        (r.input_tokens, r.output_tokens, r.block_ids, r.block_tokens, r.session) for r in trace.requests
    ]
    assert [
        (r.input_tokens, r.output_tokens, r.block_ids, r.block_tokens, r.session) for r in back.requests
    ] == strip


# --- statistics


def test_describe_counts_prefix_hits_from_the_start_of_each_prompt() -> None:
    def request(at_s: float, input_tokens: int, output_tokens: int, blocks: tuple[int, ...]) -> TraceRequest:
        return TraceRequest(at_s, input_tokens, output_tokens, blocks, 16)

    trace = Trace(
        "hand",
        [
            request(0, 48, 10, (1, 2, 3)),
            request(1, 40, 20, (1, 2, 4)),  # two blocks seen before
            request(2, 20, 30, (1, 5)),  # one
            request(4, 32, 40, (6, 2)),  # 2 was seen at position 1, but after another prefix: none
        ],
    )
    stats = describe(trace)
    assert stats["requests"] == 4
    assert stats["duration_s"] == 4
    assert stats["rate_per_s"] == 0.75  # three gaps over four seconds
    assert stats["input_tokens_mean"] == 35
    assert stats["input_tokens_p50"] == 32
    assert stats["input_tokens_p99"] == 48
    assert stats["output_tokens_p50"] == 20
    assert stats["prompt_blocks"] == 10
    assert stats["prefix_hit_ratio"] == pytest.approx(3 / 10)


def test_describe_an_empty_trace() -> None:
    stats = describe(Trace("empty", []))
    assert stats["requests"] == 0 and stats["prefix_hit_ratio"] == 0 and stats["rate_per_s"] == 0


def test_blocks_of_different_ids_never_have_the_same_tokens() -> None:
    from vllm_disagg.cluster_sim.trace import block_token_ids

    ids = [0, 1, 31_999, 32_000, 32_001, 64_000, 10**6, 10**6 + 32_000, 987_654_321]
    blocks = [tuple(block_token_ids(i, 16)) for i in ids]
    assert len(set(blocks)) == len(ids) and all(len(b) == 16 for b in blocks)
    assert block_token_ids(5, 1) == [5] and block_token_ids(7, 16) == block_token_ids(7, 16)
