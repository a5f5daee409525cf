"""vLLM's chained block hash with ``--prefix-caching-hash-algo sha256_cbor``, computed outside vLLM.

A block's hash is ``sha256(cbor((parent_hash, tuple(token_ids), extra_keys)))`` in canonical CBOR, and a
prompt's first block hangs from ``NONE_HASH = sha256(cbor(seed))`` where the seed is ``PYTHONHASHSEED``
when set, else ``"vllm-none-hash"`` (vllm/v1/core/kv_cache_utils.py, 0.32). So the agents, the
orchestrator and every engine name a block of a prompt the same way with no engine to ask: the pool
keys on it, and a receiving agent knows which blocks a prompt needs before its engine sees it.
A block of a LoRA adapter, of multimodal inputs or of a salted prompt carries vLLM's ``extra_keys``
(``generate_block_hash_extra_keys``): a tuple of tagged tuples such as ``("lora", name, path)``,
``("mm", identifier, offset)``, ``("cache_salt", salt)`` (the first block only),
``("prompt_embeds", digest)``. ``block_hash`` takes them as they are (``Extra``), so such a block's key
can be checked against its tokens and extra keys like any other.

The encoder is the few lines of canonical CBOR this shape needs, not a CBOR library: integers, byte
and text strings, arrays and null. ``tests/unit/wire/test_block_hash.py`` checks it against
vLLM's own function.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence

DEFAULT_SEED = "vllm-none-hash"
HASH_ALGO = "sha256_cbor"  # the --prefix-caching-hash-algo that makes the hashes reproducible


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([(major << 5) | n])
    if n < 1 << 8:
        return bytes([(major << 5) | 24, n])
    if n < 1 << 16:
        return bytes([(major << 5) | 25]) + struct.pack(">H", n)
    if n < 1 << 32:
        return bytes([(major << 5) | 26]) + struct.pack(">I", n)
    return bytes([(major << 5) | 27]) + struct.pack(">Q", n)


def _uint(n: int) -> bytes:
    if n < 0:
        raise ValueError(f"token ids are non-negative, got {n}")
    return _head(0, n)


Extra = tuple[tuple[str | int | bytes, ...], ...]  # vLLM's extra keys of one block


MAX_EXTRA_ITEMS = 64  # extra keys of one block, and items of one: vLLM's are a few short tuples


def read_extra(raw: object) -> Extra | None:
    """Extra keys as they travel (msgpack arrays, or tuples), checked: ``ValueError`` for any other
    shape; None for none."""
    if raw is None:
        return None
    if not isinstance(raw, list | tuple) or not 0 < len(raw) <= MAX_EXTRA_ITEMS:
        raise ValueError("extra keys: expected a list of 1 to 64 tuples")
    out = []
    for key in raw:
        if not isinstance(key, list | tuple) or not 0 < len(key) <= MAX_EXTRA_ITEMS:
            raise ValueError("extra keys: each is a tuple of 1 to 64 items")
        if not all(isinstance(v, str | bytes | int) and not isinstance(v, bool) for v in key):
            raise ValueError("extra keys: items are strings, byte strings or integers")
        out.append(tuple(key))
    return tuple(out)


def _item(value: object) -> bytes:
    """One item of an extra key, as canonical CBOR."""
    if isinstance(value, bool):
        raise ValueError("an extra key holds strings, byte strings and integers, not booleans")
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, str):
        raw = value.encode()
        return _head(3, len(raw)) + raw
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, tuple | list):
        return _head(4, len(value)) + b"".join(_item(v) for v in value)
    raise ValueError(f"an extra key holds strings, byte strings and integers, got {type(value).__name__}")


def none_hash(seed: str | None = None) -> bytes:
    """The parent of every prompt's first block."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    raw = seed.encode()
    return hashlib.sha256(_head(3, len(raw)) + raw).digest()


def block_hash(parent: bytes, token_ids: Sequence[int], extra: Extra | None = None) -> bytes:
    """One block's hash from its parent's, its own token ids and its extra keys (None: a plain text
    block's)."""
    body = b"".join(_uint(t) for t in token_ids)
    cbor = (
        b"\x83"  # array of 3
        + _head(2, len(parent))
        + parent
        + _head(4, len(token_ids))
        + body
        + (b"\xf6" if extra is None else _item(extra))  # extra_keys: null, or its tuples
    )
    return hashlib.sha256(cbor).digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, *, seed: str | None = None) -> list[bytes]:
    """The hashes of a prompt's full blocks, first to last (a partial last block has none)."""
    parent = none_hash(seed)
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


def event_hash(key: bytes) -> int:
    """The 64-bit integer a KV event carries for a block hash (vLLM's ``maybe_convert_block_hash``)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)
