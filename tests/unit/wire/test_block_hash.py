"""vLLM's sha256_cbor chained block hash, computed outside vLLM, equals vLLM's own."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.wire.block_hash import (
    DEFAULT_SEED,
    block_hash,
    event_hash,
    none_hash,
    prompt_block_hashes,
)

ids = st.one_of(st.integers(0, 2**17), st.integers(2**16 - 2, 2**16 + 2), st.integers(2**32 - 2, 2**64 - 1))


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    """vLLM's hashing, imported once: the import takes seconds."""
    with warnings.catch_warnings():  # vLLM's torch import warns of torch's own deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core import kv_cache_utils

    return SimpleNamespace(sha256_cbor=sha256_cbor, k=kv_cache_utils)


def vllm_none_hash(vllm: SimpleNamespace) -> bytes:
    """NONE_HASH as an engine started in this environment derives it."""
    vllm.k.init_none_hash(vllm.sha256_cbor)
    none: bytes = vllm.k.NONE_HASH
    return none


def vllm_chain(vllm: SimpleNamespace, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    hash_block: Callable[..., Any] = vllm.k.hash_block_tokens
    out: list[bytes] = []
    parent: bytes | None = None  # vLLM hangs the first block from NONE_HASH
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = bytes(hash_block(vllm.sha256_cbor, parent, token_ids[start : start + block_size], None))
        out.append(parent)
    return out


@pytest.fixture
def no_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_none_hash_with_no_seed_is_vllms(vllm: SimpleNamespace, no_seed: None) -> None:
    assert none_hash() == vllm_none_hash(vllm)
    assert none_hash() == vllm.sha256_cbor(DEFAULT_SEED)


def test_pythonhashseed_in_the_environment_seeds_none_hash_as_in_vllm(
    vllm: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert none_hash() == vllm_none_hash(vllm)
    assert none_hash() == none_hash(seed="1234")
    assert none_hash() != none_hash(seed=DEFAULT_SEED)


@pytest.mark.parametrize(
    "seed",
    [
        pytest.param("0", id="zero"),
        pytest.param("x" * 30, id="a seed needing a one-byte length"),
        pytest.param("s" * 300, id="a seed needing a two-byte length"),
    ],
)
def test_an_explicit_seed_derives_none_hash_as_vllm_does(vllm: SimpleNamespace, seed: str) -> None:
    assert none_hash(seed=seed) == vllm.sha256_cbor(seed)


# An empty parent is vLLM's "no parent" (it hangs the block from NONE_HASH); real parents are 32 bytes.
@settings(max_examples=200, deadline=None)
@given(parent=st.binary(min_size=1, max_size=40), token_ids=st.lists(ids, max_size=40))
def test_a_block_hash_is_vllms_for_any_parent_and_token_ids(
    vllm: SimpleNamespace, parent: bytes, token_ids: list[int]
) -> None:
    expected = vllm.k.hash_block_tokens(vllm.sha256_cbor, parent, token_ids, None)
    assert block_hash(parent, token_ids) == bytes(expected)


@pytest.mark.parametrize(
    "token_id",
    [
        pytest.param(23, id="fits the head byte"),
        pytest.param(24, id="one byte"),
        pytest.param(2**8, id="two bytes"),
        pytest.param(2**16, id="four bytes from 2**16"),
        pytest.param(2**32, id="eight bytes from 2**32"),
        pytest.param(2**64 - 1, id="the largest unsigned 64-bit id"),
    ],
)
def test_each_integer_width_hashes_as_in_vllm(vllm: SimpleNamespace, token_id: int) -> None:
    parent = none_hash(seed=DEFAULT_SEED)
    token_ids = [token_id - 1, token_id]
    assert block_hash(parent, token_ids) == bytes(
        vllm.k.hash_block_tokens(vllm.sha256_cbor, parent, token_ids, None)
    )


def test_a_long_block_hashes_as_in_vllm(vllm: SimpleNamespace) -> None:
    parent = none_hash(seed=DEFAULT_SEED)
    for n in (23, 24, 255, 256, 2**16):  # every width of the array's length
        token_ids = list(range(n))
        assert block_hash(parent, token_ids) == bytes(
            vllm.k.hash_block_tokens(vllm.sha256_cbor, parent, token_ids, None)
        )


def test_a_negative_token_id_is_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        block_hash(none_hash(seed=DEFAULT_SEED), [1, -1])


@settings(max_examples=100, deadline=None)
@given(token_ids=st.lists(ids, max_size=50), block_size=st.integers(1, 16))
def test_a_prompts_block_hashes_are_vllms_chain_of_full_blocks(
    vllm: SimpleNamespace, token_ids: list[int], block_size: int
) -> None:
    vllm_none_hash(vllm)  # whatever PYTHONHASHSEED this process has, as both sides read it
    hashes = prompt_block_hashes(token_ids, block_size)
    assert hashes == vllm_chain(vllm, token_ids, block_size)
    assert len(hashes) == len(token_ids) // block_size  # a partial last block has no hash


def test_a_partial_last_block_changes_no_hash() -> None:
    full = list(range(32))
    assert prompt_block_hashes([*full, 7, 8, 9], 16, seed="s") == prompt_block_hashes(full, 16, seed="s")
    assert prompt_block_hashes(full[:15], 16, seed="s") == []


def test_a_block_hash_names_its_whole_prefix() -> None:
    a = prompt_block_hashes([1, 2, 3, 4], 2, seed="s")
    b = prompt_block_hashes([9, 2, 3, 4], 2, seed="s")
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other prefix: another key


def test_the_seed_given_overrides_the_environment(
    vllm: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_ids = list(range(8))
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    seeded = prompt_block_hashes(token_ids, 4)
    vllm_none_hash(vllm)
    assert seeded == vllm_chain(vllm, token_ids, 4)
    assert prompt_block_hashes(token_ids, 4, seed="42") == seeded
    assert prompt_block_hashes(token_ids, 4, seed=DEFAULT_SEED) != seeded
    monkeypatch.delenv("PYTHONHASHSEED")
    assert prompt_block_hashes(token_ids, 4) == prompt_block_hashes(token_ids, 4, seed=DEFAULT_SEED)


@settings(max_examples=200, deadline=None)
@given(key=st.binary(min_size=0, max_size=40))
def test_a_kv_events_block_hash_is_the_keys_low_64_bits(key: bytes) -> None:
    assert event_hash(key) == int.from_bytes(key, "big") & (2**64 - 1)


def test_event_hash_matches_vllms_conversion_of_a_real_key(
    vllm: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    key = prompt_block_hashes(list(range(16)), 16, seed="s")[0]
    assert event_hash(key) == vllm.k.maybe_convert_block_hash(key)
    assert event_hash(key) == int.from_bytes(key[-8:], "big")


extra_items = st.one_of(st.text(max_size=20), st.binary(max_size=20), st.integers(-(2**40), 2**40))
extras = st.lists(
    st.tuples(st.sampled_from(["lora", "mm", "cache_salt", "prompt_embeds"]), extra_items), max_size=3
)


@settings(max_examples=200, deadline=None)
@given(parent=st.binary(min_size=1, max_size=40), token_ids=st.lists(ids, max_size=20), extra=extras)
def test_a_block_with_extra_keys_hashes_as_in_vllm(
    vllm: SimpleNamespace, parent: bytes, token_ids: list[int], extra: list[tuple[str, object]]
) -> None:
    keys = tuple(extra) or None
    expected = vllm.k.hash_block_tokens(vllm.sha256_cbor, parent, token_ids, keys)
    assert block_hash(parent, token_ids, keys) == bytes(expected)  # type: ignore[arg-type]


def test_vllm_s_own_extra_keys_of_a_lora_and_a_salted_request_hash_as_in_vllm(vllm: SimpleNamespace) -> None:
    parent = none_hash(seed=DEFAULT_SEED)
    for keys in (
        (("lora", "ada", "/adapters/ada"),),
        (("lora", "ada", "/a"), ("cache_salt", "s1")),
        (("mm", "h", -3),),
    ):
        expected = vllm.k.hash_block_tokens(vllm.sha256_cbor, parent, [1, 2, 3], keys)
        assert block_hash(parent, [1, 2, 3], keys) == bytes(expected)
    assert block_hash(parent, [1, 2, 3], (("cache_salt", "s1"),)) != block_hash(parent, [1, 2, 3])
