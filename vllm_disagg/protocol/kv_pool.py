"""The KV pool's wire shapes: the project's connector's ``kv_transfer_params``, and the arguments of the
``kv_grant`` / ``kv_fetch`` commands (protocol 1.3).

A pool block is named by vLLM's chained block hash (``wire/block_hash.py``), written as lowercase hex.

- A prefill engine launched with the ``vllm-disagg`` connector answers a prefill leg with
  ``kv_transfer_params = {"vllm_disagg": {"block_size": N, "keys": ["<hex>", ...]}}``: the prompt's
  full blocks it saved in its agent's pool, first to last (``pool_handle`` / ``read_pool_handle``).
- The orchestrator then moves them to the decode instance's agent: ``kv_grant`` to the holder
  (``GrantArgs``), and after its Ack ``kv_fetch`` to the receiver (``FetchArgs``). Command args are a
  string map, so keys travel comma-joined and numbers as decimal strings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

POOL_PARAMS = "vllm_disagg"  # the key of the connector's handle in ``kv_transfer_params``
# Keys one command carries at most: 8,192 keys of 32 bytes are 530 kB of hex, under the 1 MiB frame
# limit. A longer prompt's later blocks are not moved; the receiving engine computes them.
MAX_COMMAND_KEYS = 8192
_HEX = re.compile(r"(?:[0-9a-f]{2}){1,64}")
_ENDPOINT = re.compile(r"[a-z]+://\S+")
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")


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


def join_keys(keys: Iterable[str]) -> str:
    """Hex keys as one command argument."""
    return ",".join(keys)


def split_keys(text: str) -> list[bytes]:
    """A command's ``keys`` argument as block keys; ``ValueError`` naming the first bad one."""
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


def grant_command(token: str, keys: Sequence[str], peer_key: bytes | None, ttl_s: float) -> dict[str, str]:
    """``kv_grant``'s args: the agent with ``peer_key`` may fetch hex ``keys`` with ``token``."""
    return {"token": token, "keys": join_keys(keys), "peer_key": _z85(peer_key), "ttl_s": repr(ttl_s)}


def fetch_command(
    token: str, keys: Sequence[str], endpoint: str, peer_key: bytes | None, timeout_s: float
) -> dict[str, str]:
    """``kv_fetch``'s args: fetch hex ``keys`` from the holder at ``endpoint`` (its key ``peer_key``)."""
    return {
        "token": token,
        "keys": join_keys(keys),
        "endpoint": endpoint,
        "peer_key": _z85(peer_key),
        "timeout_s": repr(timeout_s),
    }


def _z85(key: bytes | None) -> str:
    return key.decode("ascii") if key else ""


def _seconds(args: Mapping[str, str], name: str) -> float:
    text = args.get(name, "")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"'{name}' must be a number of seconds, got {text[:40]!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"'{name}' must be > 0 seconds, got {text[:40]!r}")
    return value


def _peer_key(args: Mapping[str, str]) -> bytes | None:
    text = args.get("peer_key", "")
    if not text:
        return None
    if not _Z85_KEY.fullmatch(text):
        raise ValueError("'peer_key' must be a CurveZMQ public key (40 z85 characters) or empty")
    return text.encode("ascii")


def _token(args: Mapping[str, str]) -> str:
    token = args.get("token", "")
    if not token:
        raise ValueError("'token' must not be empty")
    return token


@dataclass(frozen=True, slots=True)
class GrantArgs:
    """``kv_grant``, to the holder: the agent with ``peer_key`` may fetch ``keys`` with ``token``."""

    token: str
    keys: Sequence[bytes]
    peer_key: bytes | None  # the receiver agent's public key (z85); None without agent keys
    ttl_s: float

    @staticmethod
    def parse(args: Mapping[str, str]) -> GrantArgs:
        """A command's args; ``ValueError`` saying which is wrong."""
        keys = split_keys(args.get("keys", ""))
        return GrantArgs(_token(args), keys, _peer_key(args), _seconds(args, "ttl_s"))


@dataclass(frozen=True, slots=True)
class FetchArgs:
    """``kv_fetch``, to the receiver: fetch ``keys`` from the holder at ``endpoint`` with ``token``."""

    token: str
    keys: Sequence[bytes]
    endpoint: str  # the holder's ``InstanceInfo.kv_pool_endpoint``
    peer_key: bytes | None  # the holder agent's public key (z85); None without agent keys
    timeout_s: float

    @staticmethod
    def parse(args: Mapping[str, str]) -> FetchArgs:
        """A command's args; ``ValueError`` saying which is wrong."""
        endpoint = args.get("endpoint", "")
        if not _ENDPOINT.fullmatch(endpoint):
            raise ValueError(f"'endpoint' must be a ZeroMQ endpoint (tcp://host:port), got {endpoint[:80]!r}")
        return FetchArgs(
            _token(args),
            split_keys(args.get("keys", "")),
            endpoint,
            _peer_key(args),
            _seconds(args, "timeout_s"),
        )
