"""vLLM's KV-cache events: decoding its exact frames, refusing bad ones, round trips, feeding the index."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from vllm_disagg.config import SimEngineConfig
from vllm_disagg.errors import ConfigError, KvEventsError, ProtocolError
from vllm_disagg.orchestrator.state.prefix_index import PrefixIndex, apply_batch, prompt_block_hashes
from vllm_disagg.sim_engine.kv import PrefixCache, chain_hashes
from vllm_disagg.wire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    decode_frames,
    encode_batch,
)

BS = 4
PROMPT = list(range(100, 114))  # three full blocks of 4 and a partial tail
BIG = 2648526634189158145  # a real vLLM hash: above 2**61, a msgpack uint64
BIG2 = 18_000_000_000_000_000_000  # above 2**63


def frames(payload: Any, seq: int = 7) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), msgpack.packb(payload)]


def stored_map(**overrides: Any) -> dict[str, Any]:
    """A BlockStored exactly as vLLM 0.32 was seen to send it, extra keys included."""
    return {
        "type": "BlockStored",
        "block_hashes": [BIG, BIG2],
        "parent_block_hash": None,
        "token_ids": PROMPT[:8],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        **overrides,
    }


def test_decodes_vllms_map_events_with_their_extra_keys() -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [BIG2], "medium": "GPU"}
    batch = decode_frames(frames([1763770000.25, [stored_map(), removed, {"type": "AllBlocksCleared"}], 0]))
    assert batch == KvEventBatch(
        seq=7,
        ts=1763770000.25,
        events=(
            BlockStored((BIG, BIG2), None, tuple(PROMPT[:8]), BS),
            BlockRemoved((BIG2,)),
            AllBlocksCleared(),
        ),
    )


def test_decodes_msgspec_tagged_arrays_in_field_order() -> None:
    events = [
        ["BlockStored", [BIG], 5, PROMPT[:4], BS, None, "GPU"],
        ["BlockRemoved", [BIG], "GPU"],
        ["AllBlocksCleared"],
    ]
    batch = decode_frames(frames([2.0, events, None], seq=2**40))
    assert batch.seq == 2**40
    assert batch.events == (
        BlockStored((BIG,), 5, tuple(PROMPT[:4]), BS),
        BlockRemoved((BIG,)),
        AllBlocksCleared(),
    )


def test_bytes_hashes_become_ints() -> None:
    batch = decode_frames(frames([0, [stored_map(block_hashes=[b"\x01\x00"], token_ids=PROMPT[:4])]]))
    assert batch.events == (BlockStored((256,), None, tuple(PROMPT[:4]), BS),)


SHA256 = bytes(range(32))
LOW_64 = int.from_bytes(SHA256[-8:], "big")


@pytest.mark.parametrize(
    ("raw", "folded"),
    [
        pytest.param(SHA256, LOW_64, id="a 32-byte digest keeps its low 64 bits, as vLLM converts it"),
        pytest.param(-1, 2**64 - 1, id="a negative int is its two's complement"),
        pytest.param(-(2**63), 2**63, id="int64 min"),
        pytest.param(2**64 - 1, 2**64 - 1, id="uint64 max is kept"),
        pytest.param(BIG, BIG, id="a 64-bit hash is kept"),
    ],
)
def test_hashes_are_folded_to_64_bits_so_they_fit_msgpack(raw: bytes | int, folded: int) -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [raw]}
    stored = stored_map(block_hashes=[raw], parent_block_hash=raw, token_ids=PROMPT[:4])
    batch = decode_frames(frames([0, [stored, removed]]))
    assert batch.events == (BlockStored((folded,), folded, tuple(PROMPT[:4]), BS), BlockRemoved((folded,)))


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param([b"kv-events", b"\x00" * 8], id="two-frames"),
        pytest.param([b"kv-events", b"\x00" * 4, msgpack.packb([0.0, []])], id="short-seq-frame"),
        pytest.param([b"kv-events", b"\x00" * 8, b"\xc1"], id="not-msgpack"),
        pytest.param([b"kv-events", b"\x00" * 8, msgpack.packb([0.0, []]) + b"\x00"], id="trailing-bytes"),
        pytest.param(frames({"ts": 0.0}), id="payload-not-an-array"),
        pytest.param(frames(["now", []]), id="ts-not-a-number"),
        pytest.param(frames([0.0, {}]), id="events-not-a-list"),
        pytest.param(frames([0.0, [{"type": "BlockMoved"}]]), id="unknown-type"),
        pytest.param(frames([0.0, [{"block_hashes": [1]}]]), id="no-type"),
        pytest.param(frames([0.0, [42]]), id="event-not-map-or-array"),
        pytest.param(frames([0.0, [["BlockStored", [1]]]]), id="short-array"),
        pytest.param(frames([0.0, [{"type": "BlockRemoved"}]]), id="missing-field"),
        pytest.param(frames([0.0, [stored_map(block_hashes=["x"])]]), id="string-hash"),
        pytest.param(frames([0.0, [stored_map(block_hashes=[True])]]), id="bool-hash"),
        pytest.param(frames([0.0, [stored_map(token_ids=[1.5])]]), id="float-token"),
        pytest.param(frames([0.0, [stored_map(block_size=0)]]), id="zero-block-size"),
        pytest.param(frames([0.0, [stored_map(parent_block_hash="p")]]), id="string-parent"),
    ],
)
def test_bad_frames_raise_kv_events_error(raw: list[bytes]) -> None:
    with pytest.raises(KvEventsError) as caught:
        decode_frames(raw)
    assert isinstance(caught.value, ProtocolError)


def test_encode_then_decode_is_identity() -> None:
    events = (
        BlockStored((BIG, BIG2, 3), 9, tuple(range(12)), BS),
        BlockRemoved((BIG, 3)),
        AllBlocksCleared(),
    )
    wire = encode_batch(2**63 + 5, 12.5, events)
    assert wire[0] == b"kv-events" and len(wire[1]) == 8
    assert decode_frames(wire) == KvEventBatch(2**63 + 5, 12.5, events)


def test_applied_events_give_the_prompts_matched_blocks() -> None:
    index = PrefixIndex(BS)
    keys = prompt_block_hashes(PROMPT, BS)
    apply_batch(index, "a", decode_frames(frames([0.0, [stored_map()]])))  # blocks 0-1
    apply_batch(
        index,
        "a",
        decode_frames(
            frames([0.0, [stored_map(block_hashes=[3], parent_block_hash=BIG2, token_ids=PROMPT[8:12])]])
        ),
    )
    apply_batch(
        index, "b", decode_frames(frames([0.0, [stored_map(block_hashes=[1], token_ids=PROMPT[:4])]]))
    )
    assert index.match(keys) == {"a": 3, "b": 1}
    apply_batch(index, "a", KvEventBatch(1, 0.0, (BlockRemoved((BIG2,)),)))
    assert index.match(keys) == {"a": 1, "b": 1}
    apply_batch(index, "b", KvEventBatch(2, 0.0, (AllBlocksCleared(),)))
    assert index.match(keys) == {"a": 1}


def test_a_block_size_the_index_does_not_use_is_refused_before_any_change() -> None:
    index = PrefixIndex(BS)
    batch = KvEventBatch(
        0,
        0.0,
        (BlockStored((1,), None, tuple(PROMPT[:4]), BS), BlockStored((2,), None, tuple(PROMPT[:8]), 8)),
    )
    with pytest.raises(KvEventsError, match="8-token blocks"):
        apply_batch(index, "a", batch)
    assert len(index) == 0


class Recorder:
    def __init__(self) -> None:
        self.events: list[object] = []

    def stored(self, hashes: Any, parent: int | None, token_ids: Any) -> None:
        self.events.append(BlockStored(tuple(hashes), parent, tuple(token_ids), BS))

    def removed(self, hashes: Any) -> None:
        self.events.append(BlockRemoved(tuple(hashes)))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())


def test_the_sim_prefix_cache_reports_new_runs_evictions_and_clears() -> None:
    cache = PrefixCache(capacity_blocks=3, block_size=BS)
    cache.listener = rec = Recorder()
    h = chain_hashes(PROMPT, BS)
    cache.insert(h[:1], PROMPT)
    cache.insert(h, PROMPT)  # block 0 cached already: blocks 1-2 chain to it
    cache.insert(h, PROMPT)  # nothing new
    other = chain_hashes([1] * 8, BS)
    cache.insert(other, [1] * 8)  # two new blocks push out the two least recently used, first (as vLLM)
    cache.clear()
    assert rec.events == [
        BlockStored(h[:1], None, tuple(PROMPT[:4]), BS),
        BlockStored(h[1:], h[0], tuple(PROMPT[4:12]), BS),
        BlockRemoved(h[:2]),
        BlockStored(other, None, tuple([1] * 8), BS),
        AllBlocksCleared(),
    ]


def test_the_sim_prefix_cache_never_reports_more_blocks_than_it_holds() -> None:
    """Replaying the events gives the cache's content at every step, and never more than its capacity
    (the orchestrator's index reads them one by one), even for a prompt longer than the whole cache."""
    cache = PrefixCache(capacity_blocks=3, block_size=BS)
    cache.listener = rec = Recorder()
    held: set[int] = set()
    prompts = [PROMPT, [7] * 8, PROMPT, list(range(20)), [7] * 8 + [9] * 4]
    for prompt in prompts:
        cache.insert(chain_hashes(prompt, BS), prompt)
        for event in rec.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            assert len(held) <= 3 or len(chain_hashes(prompt, BS)) > 3, (prompt, event)
        rec.events.clear()
        assert len(held) == len(cache) <= 3


@pytest.mark.parametrize("port", [-1, 65536], ids=["negative", "above-65535"])
def test_the_sim_refuses_a_kv_events_port_that_is_not_a_port(port: int) -> None:
    with pytest.raises(ConfigError, match="kv_events_port"):
        SimEngineConfig(kv_events_port=port)


@pytest.mark.parametrize(
    ("extra", "keyed"),
    [
        pytest.param({}, False, id="plain-blocks-are-indexable"),
        pytest.param({"lora_id": None, "lora_name": None, "extra_keys": [None]}, False, id="empty-extras"),
        pytest.param({"lora_name": "adapter"}, True, id="a-lora-block"),
        pytest.param({"lora_id": 3}, True, id="a-lora-block-by-id"),
        pytest.param({"extra_keys": [None, ["salt"]]}, True, id="a-salted-or-multimodal-block"),
    ],
)
def test_blocks_whose_hash_covers_more_than_tokens_are_marked_keyed(
    extra: dict[str, object], keyed: bool
) -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
    }
    payload = msgpack.packb([0.0, [event | extra], 0])
    (stored,) = decode_frames([b"kv-events", (1).to_bytes(8, "big"), payload]).events
    assert isinstance(stored, BlockStored) and stored.keyed is keyed


def test_the_medium_says_whose_blocks_the_engine_s_or_a_connector_tier_s() -> None:
    frames = encode_batch(
        7,
        1.0,
        [
            BlockStored((1,), None, (5,) * 4, 4),
            BlockStored((2,), None, (5,) * 4, 4, medium="cpu"),
            BlockRemoved((2,), medium="storage"),
        ],
    )
    events = decode_frames(frames).events
    assert [getattr(e, "medium", None) for e in events] == ["gpu", "cpu", "storage"]
    raw = msgpack.unpackb(frames[2])
    raw[1][0]["medium"] = None  # older vLLM: no medium, the engine's own cache
    raw[1][1]["medium"] = 7
    with pytest.raises(KvEventsError, match="medium"):
        decode_frames([frames[0], frames[1], msgpack.packb(raw)])
    del raw[1][1:]
    assert decode_frames([frames[0], frames[1], msgpack.packb(raw)]).events[0] == BlockStored(
        (1,), None, (5,) * 4, 4
    )
