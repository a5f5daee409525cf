"""The simulated engine's timing/batching model and KV bookkeeping, as tables of pure decisions."""

from __future__ import annotations

import pytest

from vllm_disagg.config import SimTiming
from vllm_disagg.errors import ConfigError
from vllm_disagg.sim_engine import perf_model
from vllm_disagg.sim_engine.kv import PrefixCache, TransferHolds, chain_hashes
from vllm_disagg.sim_engine.metrics import Histogram

TIMING = SimTiming(
    prefill_s_per_token=0.001,
    decode_step_s=0.01,
    decode_step_s_per_seq=0.002,
    kv_transfer_s_per_token=0.0005,
)


@pytest.mark.parametrize(
    ("prefill_tokens", "batch", "expected"),
    [
        (0, 0, 0.0),
        (0, 1, 0.01 + 0.002),
        (0, 4, 0.01 + 0.008),
        (100, 1, 0.1 + 0.01 + 0.002),
        (100, 3, 0.1 + 0.01 + 0.006),
    ],
    ids=[
        "an empty batch takes no time",
        "a decode-only step costs the base plus one sequence",
        "each running sequence adds its share",
        "newly admitted prompt tokens add prefill time",
        "prefill and decode share one step",
    ],
)
def test_step_duration(prefill_tokens: int, batch: int, expected: float) -> None:
    assert perf_model.step_duration(TIMING, prefill_tokens, batch) == pytest.approx(expected)


def test_zero_timing_makes_every_step_free() -> None:
    timing = SimTiming()
    assert timing.zero_delay
    assert perf_model.step_duration(timing, 1000, 8) == 0.0
    assert perf_model.kv_transfer_duration(timing, 1000) == 0.0


def test_kv_transfer_costs_per_token() -> None:
    assert perf_model.kv_transfer_duration(TIMING, 64) == pytest.approx(0.032)
    assert not TIMING.zero_delay


@pytest.mark.parametrize(
    ("waiting_blocks", "running", "free_blocks", "max_num_seqs", "admitted"),
    [
        ([], 0, 100, 4, 0),
        ([1, 1, 1], 0, 100, 4, 3),
        ([1, 1, 1, 1, 1], 0, 100, 4, 4),
        ([1, 1, 1], 3, 100, 4, 1),
        ([1, 1], 4, 100, 4, 0),
        ([5, 5, 5], 0, 12, 8, 2),
        ([20, 1, 1], 0, 10, 8, 0),
        ([3, 7], 0, 10, 8, 2),
    ],
    ids=[
        "nothing waits: nothing is admitted",
        "all fit: all join the batch",
        "the batch stops at max_num_seqs",
        "running requests count toward max_num_seqs",
        "a full batch admits nobody",
        "admission stops when KV blocks run out",
        "a head that does not fit blocks the queue (FCFS, no starvation)",
        "exactly filling the cache is allowed",
    ],
)
def test_admit(
    waiting_blocks: list[int], running: int, free_blocks: int, max_num_seqs: int, admitted: int
) -> None:
    assert perf_model.admit(waiting_blocks, running, free_blocks, max_num_seqs) == admitted


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "block_size", "full", "moved", "needed", "cacheable"),
    [
        (15, 1, 16, 0, 1, 1, 0),
        (16, 1, 16, 1, 1, 2, 0),
        (17, 1, 16, 1, 2, 2, 1),
        (40, 8, 16, 2, 3, 3, 2),
        (48, 16, 16, 3, 3, 4, 2),
    ],
    ids=[
        "a prompt shorter than a block has no full block but moves one partial block",
        "a prompt of exactly one block: its last token is always computed",
        "one token past a block makes that block cacheable and moves a second block",
        "reservation covers prompt and output",
        "an exact multiple keeps its last block uncached",
    ],
)
def test_block_arithmetic(
    prompt_len: int, max_tokens: int, block_size: int, full: int, moved: int, needed: int, cacheable: int
) -> None:
    assert perf_model.full_blocks(prompt_len, block_size) == full
    assert len(TransferHolds(block_size, lease_s=30).hold("r", list(range(prompt_len)), now=0.0)) == moved
    assert perf_model.blocks_needed(prompt_len, max_tokens, block_size) == needed
    assert perf_model.cacheable_blocks(prompt_len, block_size) == cacheable


@pytest.mark.parametrize(
    ("prompt_len", "cached", "external", "split"),
    [
        (100, 0, 0, (100, 0, 0)),
        (100, 96, 0, (4, 96, 0)),
        (100, 0, 96, (4, 0, 96)),
        (32, 0, 32, (0, 0, 32)),
    ],
    ids=["colocated", "prefix cache hit", "KV transferred", "whole prompt transferred"],
)
def test_prompt_sources(prompt_len: int, cached: int, external: int, split: tuple[int, int, int]) -> None:
    s = perf_model.prompt_sources(prompt_len, cached, external)
    assert (s.local_compute, s.local_cache_hit, s.external_kv_transfer) == split


def test_prompt_sources_refuse_more_tokens_than_the_prompt() -> None:
    with pytest.raises(ValueError, match="cannot split"):
        perf_model.prompt_sources(10, 8, 8)


def test_timing_config_refuses_negative_costs_and_empty_batches() -> None:
    with pytest.raises(ConfigError, match="decode_step_s"):
        SimTiming(decode_step_s=-1)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SimTiming(max_num_seqs=0)


# -- KV bookkeeping ----------------------------------------------------------------------------


def test_chain_hashes_cover_full_blocks_and_depend_on_everything_before() -> None:
    a = chain_hashes(list(range(40)), 16)
    assert len(a) == 2
    assert chain_hashes(list(range(40)), 16) == a
    changed_first = chain_hashes([99, *range(1, 40)], 16)
    assert changed_first[0] != a[0] and changed_first[1] != a[1], "a block's hash covers its parents"
    assert chain_hashes(list(range(32)) + [7] * 8, 16) == a, "the partial tail block is not hashed"


def test_prefix_cache_matches_leading_blocks_only() -> None:
    cache = PrefixCache(capacity_blocks=10)
    hashes = chain_hashes(list(range(64)), 16)
    assert cache.match(hashes, limit=4) == 0
    cache.insert(hashes[:2])
    assert cache.match(hashes, limit=4) == 2
    assert cache.match(hashes, limit=1) == 1, "the limit keeps the last token computed"
    other = chain_hashes([5, *range(1, 64)], 16)
    assert cache.match(other, limit=4) == 0


def test_prefix_cache_evicts_least_recently_used_beyond_capacity() -> None:
    cache = PrefixCache(capacity_blocks=2)
    a, b, c = (chain_hashes([i] * 16, 16) for i in range(3))
    cache.insert(a)
    cache.insert(b)
    assert cache.match(a, 1) == 1  # a is now the most recently used
    cache.insert(c)
    assert len(cache) == 2
    assert (cache.match(a, 1), cache.match(b, 1), cache.match(c, 1)) == (1, 0, 1)


def test_held_blocks_are_pulled_once_in_the_order_asked() -> None:
    holds = TransferHolds(block_size=4, lease_s=30)
    ids = holds.hold("req-1", list(range(10)), now=0.0)  # two full blocks and the partial tail
    assert len(ids) == 3 and holds.held_blocks == 3
    out = holds.pull(list(reversed(ids)), "req-1", now=1.0)
    assert out.token_ids == (8, 9, 4, 5, 6, 7, 0, 1, 2, 3)
    assert holds.held_blocks == 0
    again = holds.pull(ids, "req-1", now=1.0)
    assert again.token_ids is None and "already pulled" in again.reason


@pytest.mark.parametrize(
    ("ask_ids", "ask_request", "reason"),
    [
        ([999], "req-1", "no KV blocks held"),
        ([], "req-1", "no block ids"),
        (None, "someone-else", "belong to request"),
        ("duplicate", "req-1", "duplicate"),
    ],
    ids=["unknown ids", "no ids", "another request's blocks", "the same block twice"],
)
def test_refused_pulls_say_why_and_take_nothing(
    ask_ids: list[int] | str | None, ask_request: str, reason: str
) -> None:
    holds = TransferHolds(block_size=4, lease_s=30)
    ids = list(holds.hold("req-1", list(range(8)), now=0.0))
    asked = ids if ask_ids is None else [ids[0], ids[0]] if ask_ids == "duplicate" else ask_ids
    assert isinstance(asked, list)
    out = holds.pull(asked, ask_request, now=1.0)
    assert out.token_ids is None and reason in out.reason
    assert holds.held_blocks == 2


def test_held_blocks_expire_after_the_lease() -> None:
    holds = TransferHolds(block_size=4, lease_s=30)
    first = holds.hold("a", list(range(8)), now=0.0)
    holds.hold("b", list(range(4)), now=10.0)
    assert holds.next_deadline() == 30.0
    assert holds.expire(29.9) == 0
    assert holds.expire(30.0) == 2
    assert holds.held_blocks == 1 and holds.next_deadline() == 40.0
    assert holds.pull(first, "a", now=30.0).token_ids is None
    assert holds.pull(first, None, now=30.0).token_ids is None


def test_next_deadline_skips_leases_already_pulled() -> None:
    holds = TransferHolds(block_size=4, lease_s=30)
    ids = holds.hold("a", list(range(4)), now=0.0)
    holds.hold("b", list(range(4)), now=5.0)
    assert holds.pull(ids, "a", now=1.0).token_ids == (0, 1, 2, 3)
    assert holds.next_deadline() == 35.0


def test_a_prompt_shorter_than_a_block_holds_one_partial_block() -> None:
    holds = TransferHolds(block_size=16, lease_s=30)
    ids = holds.hold("a", list(range(10)), now=0.0)
    assert len(ids) == 1
    assert holds.held_blocks == 1 and holds.next_deadline() == 30.0
    assert holds.pull(ids, "a", now=1.0).token_ids == tuple(range(10)), "the whole short prompt moves"
    assert holds.held_blocks == 0


def test_an_empty_prompt_holds_nothing() -> None:
    holds = TransferHolds(block_size=16, lease_s=30)
    assert holds.hold("a", [], now=0.0) == ()
    assert holds.held_blocks == 0 and holds.next_deadline() is None


def test_histogram_counts_many_equal_samples_at_once_with_le_semantics() -> None:
    h = Histogram([1, 2, 5])
    h.observe(1.0)  # equal to a bound: inside it
    h.observe(0.0, n=3)
    h.observe(7.0)
    assert h.buckets() == [("1.0", 4.0), ("2.0", 4.0), ("5.0", 4.0), ("+Inf", 5.0)]
    assert (h.count, h.sum) == (5, 8.0)
