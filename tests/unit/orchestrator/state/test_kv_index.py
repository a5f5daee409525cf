"""The orchestrator's KV index: agents' forwarded KV events in, cached prompt tokens per instance out."""

from __future__ import annotations

import pytest

from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.protocol.messages import KvEvent

PROMPT = list(range(1000, 1019))  # 19 tokens: four full blocks of 4, two of 8, a partial tail


def stored(hashes: list[int], tokens: list[int], size: int, parent: int | None = None) -> KvEvent:
    return KvEvent("stored", hashes, parent, tokens, size)


def removed(*hashes: int) -> KvEvent:
    return KvEvent("removed", list(hashes))


CLEARED = KvEvent("cleared")


def test_stored_blocks_are_counted_and_name_the_instance_with_whole_blocks_of_tokens() -> None:
    index = KvIndex()
    assert index.apply("a", [stored([11, 12], PROMPT[:8], 4), stored([13], PROMPT[8:12], 4, parent=12)]) == 2
    assert index.blocks_of("a") == 3
    assert index.cached_tokens(PROMPT) == {"a": 12}
    assert index.cached_tokens(PROMPT[:10]) == {"a": 8}  # the prompt's partial block is never cached
    assert index.cached_tokens(PROMPT[:3]) == {}
    assert index.cached_tokens([7, *PROMPT]) == {}  # the same tokens at another offset: another prefix


@pytest.mark.parametrize(
    ("after", "blocks", "cached"),
    [
        pytest.param([removed(12)], 2, {"a": 4}, id="a removed middle block cuts the prefix there"),
        pytest.param([removed(11, 12, 13)], 0, {}, id="every block removed"),
        pytest.param([removed(99)], 3, {"a": 12}, id="an unknown hash removed changes nothing"),
        pytest.param([CLEARED], 0, {}, id="cleared forgets everything"),
        pytest.param(
            [CLEARED, stored([21], PROMPT[:4], 4)], 1, {"a": 4}, id="blocks stored after a clear count again"
        ),
        pytest.param(
            [stored([31], PROMPT[12:16], 4, parent=777)],
            3,
            {"a": 12},
            id="a block of an unknown parent is skipped",
        ),
    ],
)
def test_removed_and_cleared_events(after: list[KvEvent], blocks: int, cached: dict[str, int]) -> None:
    index = KvIndex()
    index.apply("a", [stored([11, 12, 13], PROMPT[:12], 4)])
    index.apply("a", after)
    assert (index.blocks_of("a"), index.cached_tokens(PROMPT)) == (blocks, cached)


def test_drop_forgets_one_instance_and_keeps_the_others() -> None:
    index = KvIndex()
    index.apply("a", [stored([11, 12], PROMPT[:8], 4)])
    index.apply("b", [stored([51], PROMPT[:4], 4)])
    assert index.cached_tokens(PROMPT) == {"a": 8, "b": 4}
    assert index.total_blocks() == 2  # distinct blocks: both hold the first
    index.drop("a")
    index.drop("never-seen")
    assert (index.blocks_of("a"), index.blocks_of("b")) == (0, 1)
    assert index.cached_tokens(PROMPT) == {"b": 4}
    index.drop("b")
    assert (index.total_blocks(), index.block_sizes(), index.cached_tokens(PROMPT)) == (0, [], {})


def test_instances_with_different_block_sizes_are_matched_each_in_its_own_size() -> None:
    index = KvIndex()
    index.apply("gpu", [stored([1, 2, 3, 4], PROMPT[:16], 4)])
    index.apply("cpu", [stored([1, 2], PROMPT[:16], 8)])  # the same engine hashes mean nothing across sizes
    assert index.block_sizes() == [4, 8]
    assert index.cached_tokens(PROMPT) == {"gpu": 16, "cpu": 16}
    assert index.cached_tokens(PROMPT[:12]) == {"gpu": 12, "cpu": 8}
    index.apply("cpu", [removed(2)])
    assert index.cached_tokens(PROMPT) == {"gpu": 16, "cpu": 8}
    assert (index.blocks_of("gpu"), index.blocks_of("cpu"), index.total_blocks()) == (4, 1, 5)


def test_keys_hashed_with_the_tokenization_match_as_the_tokens_do_in_one_block_size_or_two() -> None:
    index = KvIndex()
    index.apply("a", [stored([1, 2, 3], PROMPT[:12], 4)])
    index.apply("b", [stored([7], PROMPT[:4], 4)])
    for prompt in (PROMPT, PROMPT[:6], PROMPT[4:]):
        assert index.cached_tokens(PromptTokens(prompt)) == index.cached_tokens(prompt)
    assert index.cached_tokens(PromptTokens(PROMPT)) == {"a": 12, "b": 4}
    index.apply("c", [stored([1, 2], PROMPT[:16], 8)])
    for prompt in (PROMPT, PROMPT[:6], PROMPT[4:]):
        assert index.cached_tokens(PromptTokens(prompt)) == index.cached_tokens(prompt)
    assert index.cached_tokens(PromptTokens(PROMPT)) == {"a": 12, "b": 4, "c": 16}


def test_a_new_block_size_from_an_instance_replaces_its_old_entries() -> None:
    index = KvIndex()
    index.apply("a", [stored([11, 12, 13], PROMPT[:12], 4)])
    index.apply("a", [stored([61], PROMPT[:8], 8)])
    assert index.block_sizes() == [8]  # no instance is left under 4: its index is gone
    assert (index.blocks_of("a"), index.cached_tokens(PROMPT)) == (1, {"a": 8})
    index.apply("a", [removed(11)])  # a hash of the old engine means nothing any more
    assert index.blocks_of("a") == 1


def test_events_from_an_instance_the_index_never_saw_store_nothing_and_fail_nothing() -> None:
    index = KvIndex()
    assert index.apply("a", [removed(1), CLEARED]) == 2
    assert index.apply("a", [stored([1], PROMPT[:4], 0)]) == 0  # a block size below 1 is malformed
    assert (index.blocks_of("a"), index.total_blocks(), index.block_sizes()) == (0, 0, [])


def test_an_index_that_takes_another_holds_what_it_held_and_forgets_its_own() -> None:
    """A gateway worker's index on the orchestrator's whole state: the same object, its readers unchanged."""
    ours, whole = KvIndex(), KvIndex()
    ours.apply("old", [stored([1], PROMPT[:4], 4)])
    whole.apply("a", [stored([11, 12], PROMPT[:8], 4)])
    ours.take(whole)
    assert ours.cached_tokens(PROMPT) == {"a": 8} and ours.blocks_of("old") == 0
    ours.apply("a", [stored([13], PROMPT[8:12], 4, parent=12)])
    assert ours.cached_tokens(PROMPT) == {"a": 12}
