"""The KV pool's wire shapes: the project's connector's ``kv_transfer_params``, and the limits and
block keys of the ``kv_grant`` / ``kv_fetch`` commands (protocol 1.3).

A pool block is named by vLLM's chained block hash (``wire/block_hash.py``), written as lowercase hex.

- A prefill engine launched with the ``vllm-disagg`` connector answers a prefill leg with
  ``kv_transfer_params = {"vllm_disagg": {"block_size": N, "keys": ["<hex>", ...]}}``: the prompt's
  full blocks it saved in its agent's pool, first to last (``pool_handle`` / ``read_pool_handle``).
- The orchestrator then moves them to the decode instance's agent: ``kv_grant`` to the holder, and
  after its Ack ``kv_fetch`` to the receiver (their payloads: ``protocol/commands.py``). Up to 1.4
  command args were a string map, so keys travelled comma-joined (``split_keys`` reads them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

POOL_PARAMS = "vllm_disagg"  # the key of the connector's handle in ``kv_transfer_params``
# Keys one command carries at most: 8,192 keys of 32 bytes are 270 kB (530 kB as the hex of 1.4),
# under the 1 MiB frame limit. A longer prompt's later blocks are not moved; the receiving engine
# computes them.
MAX_COMMAND_KEYS = 8192
MAX_KEY_BYTES = 64  # vLLM's block hashes are 32 bytes (sha256); room for a longer one
# The longest a grant may pin blocks unfetched, and a fetch may take: the orchestrator's settings are
# bounded by these, and an agent caps what it is told by them too (a stalled receiver, or an
# orchestrator's mistake, never pins a holder's blocks for long). A grant in use ends, its pins
# released, by ``ttl_s + MAX_STREAM_S`` after it was made, whatever its fetch said.
MAX_GRANT_TTL_S = 300.0
MAX_FETCH_TIMEOUT_S = 60.0
MAX_STREAM_S = MAX_FETCH_TIMEOUT_S + 5.0  # a receiver has given up by then: nothing it asked lands
_HEX = re.compile(r"(?:[0-9a-f]{2}){1,64}")
ENDPOINT = re.compile(r"[a-z]+://\S+")  # a ZeroMQ endpoint, e.g. tcp://10.0.0.5:11100
Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")  # a CurveZMQ public key


@dataclass(frozen=True, slots=True)
class PoolHandle:
    """What a prefill engine saved in its agent's pool for a request: its block size and block keys."""

    block_size: int
    keys: tuple[str, ...]  # lowercase hex, first block first


def pool_handle(block_size: int, keys: Iterable[bytes]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill engine with the project's connector answers with."""
    return {POOL_PARAMS: {"block_size": block_size, "keys": [k.hex() for k in keys]}}


def read_pool_handle(params: Mapping[str, Any]) -> PoolHandle | None:
    """The pool handle in ``kv_transfer_params``; None when they carry none (a NIXL handle).

    ``ValueError`` with the reason when the handle is there but malformed.
    """
    raw = params.get(POOL_PARAMS)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"kv_transfer_params.{POOL_PARAMS} must be an object")
    block_size, keys = raw.get("block_size"), raw.get("keys")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"kv_transfer_params.{POOL_PARAMS}.block_size must be an integer >= 1")
    if not isinstance(keys, list) or not all(isinstance(k, str) and _HEX.fullmatch(k) for k in keys):
        raise ValueError(f"kv_transfer_params.{POOL_PARAMS}.keys must be a list of lowercase hex strings")
    return PoolHandle(block_size, tuple(keys))


def split_keys(text: str) -> list[bytes]:
    """A ``keys`` argument of 1.4 (comma-joined hex) as block keys; ``ValueError`` naming the first
    bad one."""
    if not text:
        raise ValueError("'keys' names no block")
    parts = text.split(",")
    if len(parts) > MAX_COMMAND_KEYS:
        raise ValueError(f"'keys' names {len(parts)} blocks, more than {MAX_COMMAND_KEYS}")
    out = []
    for i, part in enumerate(parts):
        if not _HEX.fullmatch(part):
            raise ValueError(f"'keys'[{i}] is not a lowercase hex block key: {part[:80]!r}")
        out.append(bytes.fromhex(part))
    return out
