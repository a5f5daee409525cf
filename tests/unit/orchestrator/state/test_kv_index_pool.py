"""The KV index keeps the agents' KV pools (``medium: "pool"``) apart from the engines' prefix caches:
pool entries never count as cached tokens (prefix affinity is unchanged), and answer which pool holds
how much of a prompt."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.protocol.messages import KvEvent
from vllm_disagg.wire.block_hash import event_hash, prompt_block_hashes

PROMPT = list(range(1000, 1019))  # 19 tokens: four full blocks of 4 and a partial tail
KEYS = prompt_block_hashes(PROMPT, 4)
HASHES = [event_hash(k) for k in KEYS]


def pool(kind: str = "stored", blocks: int = 4, parent: int | None = None) -> KvEvent:
    """A pool event the way agents send them: event hashes of the pool's keys."""
    if kind == "stored":
        return KvEvent("stored", HASHES[:blocks], parent, PROMPT[: 4 * blocks], 4, medium="pool")
    if kind == "removed":
        return KvEvent("removed", HASHES[blocks:], medium="pool")
    return KvEvent("cleared", medium="pool")


GPU = KvEvent("stored", [11, 12], None, PROMPT[:8], 4)


def test_pool_blocks_are_not_the_engines_cache_and_the_engines_are_not_the_pools() -> None:
    index = KvIndex()
    assert not index.has_pools
    assert index.apply("p0", [pool()]) == 1
    assert index.apply("d0", [GPU]) == 1
    assert index.has_pools
    assert index.cached_tokens(PROMPT) == {"d0": 8}
    assert index.pooled_tokens(PROMPT) == {"p0": 16}
    assert (index.blocks_of("p0"), index.pool_blocks_of("p0")) == (0, 4)
    assert (index.blocks_of("d0"), index.pool_blocks_of("d0")) == (2, 0)
    assert (index.total_blocks(), index.pool_total_blocks()) == (2, 4)
    assert index.pool_entries("p0") == dict(zip(HASHES, index.pool_entries("p0").values(), strict=True))


def test_prompt_tokens_with_their_keys_match_the_same_as_plain_ids() -> None:
    index = KvIndex()
    index.apply("p0", [pool(blocks=3)])
    assert index.pooled_tokens(PromptTokens(PROMPT)) == index.pooled_tokens(PROMPT) == {"p0": 12}


@pytest.mark.parametrize(
    ("after", "pooled", "cached"),
    [
        pytest.param(
            [pool("removed", blocks=2)], {"p0": 8}, {"p0": 8}, id="a pool removal cuts the pool only"
        ),
        pytest.param([pool("cleared")], {}, {"p0": 8}, id="a pool cleared leaves the engine's cache"),
        pytest.param([KvEvent("cleared")], {"p0": 16}, {}, id="the engine's cache cleared leaves the pool"),
        pytest.param(
            [KvEvent("removed", [12])], {"p0": 16}, {"p0": 4}, id="an engine removal leaves the pool"
        ),
    ],
)
def test_each_medium_is_changed_only_by_its_own_events(
    after: list[KvEvent], pooled: dict[str, int], cached: dict[str, int]
) -> None:
    index = KvIndex()
    index.apply("p0", [GPU, pool()])  # one instance, both media
    index.apply("p0", after)
    assert (index.pooled_tokens(PROMPT), index.cached_tokens(PROMPT)) == (pooled, cached)


def test_drop_forgets_both_media_of_the_instance_only() -> None:
    index = KvIndex()
    index.apply("p0", [GPU, pool()])
    index.apply("p1", [pool(blocks=1)])
    index.drop("p0")
    assert index.pooled_tokens(PROMPT) == {"p1": 4}
    assert index.cached_tokens(PROMPT) == {}
    index.drop("p1")
    assert not index.has_pools and index.pooled_tokens(PROMPT) == {}


def test_an_event_of_a_medium_this_release_does_not_know_is_ignored() -> None:
    index = KvIndex()
    later = dataclasses.replace(pool(), medium="nvme-of-the-future")
    assert index.apply("p0", [later, GPU]) == 1
    assert index.pooled_tokens(PROMPT) == {} and index.cached_tokens(PROMPT) == {"p0": 8}


def disk(kind: str = "stored", blocks: int = 4) -> KvEvent:
    return dataclasses.replace(pool(kind, blocks), medium="disk")


def test_a_pools_disk_tier_counts_as_pooled_and_the_longer_of_memory_and_disk_wins() -> None:
    index = KvIndex()
    assert index.apply("p0", [disk(blocks=3)]) == 1
    assert index.has_pools  # a disk tier alone is a pool the decider reads
    assert index.pooled_tokens(PROMPT) == {"p0": 12}
    assert (index.pool_blocks_of("p0"), index.disk_blocks_of("p0")) == (0, 3)
    index.apply("p0", [pool(blocks=2)])
    assert index.pooled_tokens(PROMPT) == {"p0": 12}  # memory's 2 blocks do not hide the disk's 3
    index.apply("p1", [pool()])
    assert index.pooled_tokens(PROMPT) == {"p0": 12, "p1": 16}
    index.apply("p0", [disk("cleared")])
    assert index.pooled_tokens(PROMPT) == {"p0": 8, "p1": 16}
    assert index.cached_tokens(PROMPT) == {}  # neither tier is the engine's own cache


def test_drop_forgets_the_disk_tier_too() -> None:
    index = KvIndex()
    index.apply("p0", [disk()])
    index.drop("p0")
    assert not index.has_pools and index.disk_blocks_of("p0") == 0


def test_a_pool_of_another_block_size_is_indexed_under_its_own() -> None:
    index = KvIndex()
    index.apply("p0", [pool()])
    index.apply("p1", [KvEvent("stored", [5, 6], None, PROMPT[:16], 8, medium="pool")])
    assert index.pooled_tokens(PROMPT) == {"p0": 16, "p1": 16}
    assert index.block_sizes() == []  # the engines' sizes: no engine cache is indexed
