"""The prefix index: longest cached prefix per instance, fed by vLLM-shaped KV events."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.orchestrator.state.prefix_index import PrefixIndex, PromptTokens, prompt_block_hashes

BS = 4
PROMPT = list(range(100, 116))  # four full blocks of 4 tokens
KEYS = prompt_block_hashes([*PROMPT, 7, 7], BS)  # the partial tail is not a block


def blocks(first: int, count: int) -> list[int]:
    return PROMPT[first * BS : (first + count) * BS]


def test_a_prompt_has_one_key_per_full_block_and_keys_chain() -> None:
    assert len(KEYS) == 4
    assert prompt_block_hashes(PROMPT[:8], BS) == KEYS[:2]
    # Same block tokens under another parent is another block.
    assert prompt_block_hashes(PROMPT[4:8], BS)[0] != KEYS[1]


def test_each_instance_gets_its_longest_leading_run_of_blocks() -> None:
    index = PrefixIndex(BS)
    index.stored("a", [11, 12, 13], None, blocks(0, 3))
    index.stored("b", [21], None, blocks(0, 1))
    index.stored("c", [31, 32], None, PROMPT[4:12])  # blocks 2-3 as a prompt of their own: no match
    assert index.match(KEYS) == {"a": 3, "b": 1}


def test_events_chain_through_the_engines_parent_hash() -> None:
    index = PrefixIndex(BS)
    index.stored("a", [11, 12], None, blocks(0, 2))
    index.stored("a", [13], 12, blocks(2, 1))
    assert index.match(KEYS) == {"a": 3}


def test_a_block_whose_parent_was_never_seen_is_not_indexed() -> None:
    index = PrefixIndex(BS)
    index.stored("a", [13], 999, blocks(2, 1))
    assert len(index) == 0


def test_keys_do_not_depend_on_the_engines_hashes() -> None:
    index = PrefixIndex(BS)
    index.stored("a", [11, 12], None, blocks(0, 2))
    index.stored("b", [901, 902], None, blocks(0, 2))  # another seed or algorithm, same tokens
    assert len(index) == 2
    assert index.match(KEYS) == {"a": 2, "b": 2}


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (lambda i: i.removed("a", [12]), {"a": 1, "b": 3}),
        (lambda i: i.removed("a", [11]), {"b": 3}),
        (lambda i: i.cleared("a"), {"b": 3}),
        (lambda i: i.drop("a"), {"b": 3}),
        (lambda i: i.removed("zzz", [11]), {"a": 3, "b": 3}),
    ],
    ids=[
        "a-removed-middle-block-ends-its-prefix-there",
        "a-removed-first-block-matches-nothing",
        "all-blocks-cleared-forgets-the-instance",
        "a-dead-instance-loses-its-entries",
        "events-of-an-unknown-instance-change-nothing",
    ],
)
def test_removal_clear_and_death_are_honoured(
    event: Callable[[PrefixIndex], None], expected: dict[str, int]
) -> None:
    index = PrefixIndex(BS)
    index.stored("a", [11, 12, 13], None, blocks(0, 3))
    index.stored("b", [21, 22, 23], None, blocks(0, 3))
    event(index)
    assert index.match(KEYS) == expected


def test_a_dropped_instances_slot_is_reused_without_stale_blocks() -> None:
    index = PrefixIndex(BS)
    index.stored("a", [11, 12], None, blocks(0, 2))
    index.drop("a")
    index.stored("new", [41], None, blocks(0, 1))
    assert index.match(KEYS) == {"new": 1}
    assert len(index) == 1


prompts = st.lists(st.integers(0, 3), min_size=BS, max_size=5 * BS)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), prompts, st.booleans()),
        min_size=1,
        max_size=12,
    ),
    prompts,
)
def test_match_equals_a_naive_model_of_cached_prefixes(
    ops: list[tuple[str, list[int], bool]], query: list[int]
) -> None:
    # Each op stores a prompt's full blocks on an instance, or (flag) clears the instance first.
    index = PrefixIndex(BS)
    naive: dict[str, set[tuple[int, ...]]] = {}
    engine_hash = iter(range(1, 10_000))
    for instance, prompt, clear_first in ops:
        if clear_first:
            index.cleared(instance)
            naive[instance] = set()
        full = len(prompt) // BS
        index.stored(instance, [next(engine_hash) for _ in range(full)], None, prompt[: full * BS])
        naive.setdefault(instance, set()).update(tuple(prompt[: (k + 1) * BS]) for k in range(full))
    expected = {}
    for instance, prefixes in naive.items():
        depth = 0
        while depth * BS + BS <= len(query) and tuple(query[: (depth + 1) * BS]) in prefixes:
            depth += 1
        if depth:
            expected[instance] = depth
    assert index.match(prompt_block_hashes(query, BS)) == expected
    assert index.match_prompt(query) == expected, "hashing lazily finds the same prefixes"
    prompt = PromptTokens(query)
    assert index.match(prompt.block_keys(BS)) == expected, "and so do keys kept with the tokens"
    assert prompt.block_keys(BS) is prompt.block_keys(BS), "hashed once"


def test_blocks_with_the_same_holders_share_one_mask_and_dead_masks_are_dropped() -> None:
    index = PrefixIndex(BS)
    index.stored("a", [1, 2, 3, 4], None, PROMPT)
    index.stored("b", [5, 6, 7, 8], None, PROMPT)
    masks = [index._holders[k] for k in KEYS]
    assert all(m is masks[0] for m in masks), "one object for the four blocks both instances hold"
    for i in range(3000):  # churn through many distinct holder sets
        instance = f"i{i}"
        index.stored(instance, [10_000 + i], None, PROMPT[:BS])
        index.drop(instance)
    assert len(index._masks) <= 2 * len(index) + 1024, "the table is rebuilt from the live masks"
    assert index.match_prompt(PROMPT) == {"a": 4, "b": 4}
