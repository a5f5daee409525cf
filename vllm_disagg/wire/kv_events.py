"""vLLM's KV-cache events: typed events and the ZeroMQ wire format both ways.

vLLM (``--kv-events-config``, publisher ``zmq``) sends 3 frames per batch: the topic, the sequence
number as 8 big-endian bytes, and msgpack of ``[ts, [event, ...], data_parallel_rank]``. An event is a
map with a ``"type"`` key (what vLLM 0.32 was seen to send, see docs/engine.md) or, as vLLM's msgspec
structs encode with ``array_like=True, tag=True``, an array whose first item is the type name followed
by the fields in declaration order. Fields beyond the ones used here (``lora_id``, ``medium``, ...) are
ignored, so newer vLLM versions that add fields still decode. Hashes are folded to their low 64 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from vllm_disagg.errors import KvEventsError

TOPIC = b"kv-events"
# vLLM's ``medium``: "GPU" (or none) for the engine's own prefix cache, whatever its device; a
# connector's tier says its own ("CPU", "STORAGE" for vLLM's offloading connector). Lowercased here.
GPU = "gpu"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks entered the engine's prefix cache; ``token_ids`` cover one block per hash, in order."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    # The engine's hash also covers a LoRA, multimodal inputs or a cache salt: the same tokens
    # without them would not hit, so such blocks must not be indexed by their tokens.
    keyed: bool = False
    medium: str = GPU  # where: the engine's cache, or a tier its connector keeps (lowercased)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the engine's prefix cache (or, by ``medium``, a tier its connector keeps)."""

    block_hashes: tuple[int, ...]
    medium: str = GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was emptied."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One published batch: the publisher's sequence number, its timestamp, and the events in order."""

    seq: int
    ts: float
    events: tuple[KvEvent, ...]


# Field order of vLLM's msgspec structs, for events encoded as tagged arrays.
# Fields every version has; the rest (LoRA, medium, extra keys) were added over time.
_REQUIRED_FIELDS = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


_HASH_MASK = (1 << 64) - 1


def _hash(value: object, what: str) -> int:
    # Newer vLLM sends bytes digests (sha256: 32 bytes). Keep the low 64 bits, as vLLM itself does
    # when it converts one to an int, so every hash fits msgpack's 64-bit integers on the way on.
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _HASH_MASK
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _HASH_MASK  # a negative or oversized int: its two's-complement low 64 bits
    raise KvEventsError(f"{what} must be an int, got {type(value).__name__}")


def _hashes(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvEventsError(f"{what} must be a list, got {type(value).__name__}")
    return tuple(_hash(h, what) for h in value)


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvEventsError(f"{what} must be a list, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool):
            raise KvEventsError(f"{what} must hold ints, got {type(item).__name__}")
    return tuple(value)


def _fields(raw: object) -> tuple[str, dict[str, Any]]:
    """The type name and the fields of one event, from either encoding."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields: dict[str, Any] = raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _ARRAY_FIELDS.get(kind) if isinstance(kind, str) else None
        needed = _REQUIRED_FIELDS.get(kind, 0) if isinstance(kind, str) else 0
        if names is not None and len(raw) - 1 < needed:
            raise KvEventsError(f"{kind} array has {len(raw) - 1} fields, needs {needed}")
        fields = dict(zip(names or (), raw[1:], strict=False))
    else:
        raise KvEventsError(f"an event must be a map or a tagged array, got {type(raw).__name__}")
    if not isinstance(kind, str) or kind not in _ARRAY_FIELDS:
        raise KvEventsError(f"unknown event type {kind!r}")
    return kind, fields


def _event(raw: object) -> KvEvent:
    kind, fields = _fields(raw)
    try:
        if kind == "BlockStored":
            hashes = _hashes(fields["block_hashes"], "block_hashes")
            parent_raw = fields["parent_block_hash"]
            parent = None if parent_raw is None else _hash(parent_raw, "parent_block_hash")
            token_ids = _ints(fields["token_ids"], "token_ids")
            block_size = fields["block_size"]
            if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
                raise KvEventsError(f"block_size must be a positive int, got {block_size!r}")
            extra = fields.get("extra_keys")
            keyed = (
                fields.get("lora_id") is not None
                or fields.get("lora_name") is not None
                or (isinstance(extra, list) and any(k is not None for k in extra))
            )
            return BlockStored(hashes, parent, token_ids, block_size, keyed, _medium(fields.get("medium")))
        if kind == "BlockRemoved":
            hashes = _hashes(fields["block_hashes"], "block_hashes")
            return BlockRemoved(hashes, _medium(fields.get("medium")))
        return AllBlocksCleared()
    except KeyError as exc:
        raise KvEventsError(f"{kind} lacks field {exc.args[0]!r}") from None


def _medium(raw: object) -> str:
    if raw is None:
        return GPU
    if not isinstance(raw, str) or not raw:
        raise KvEventsError(f"medium must be a string, got {raw!r}")
    return raw.lower()


def decode_frames(frames: list[bytes]) -> KvEventBatch:
    """One batch from the 3 frames vLLM publishes; ``KvEventsError`` if they are not that."""
    if len(frames) != 3:
        raise KvEventsError(f"a KV event batch has 3 frames (topic, seq, payload), got {len(frames)}")
    _, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise KvEventsError(f"the sequence frame must be 8 bytes, got {len(seq_frame)}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise KvEventsError(f"the payload is not msgpack: {exc}") from None
    if not isinstance(body, list) or len(body) < 2:
        raise KvEventsError("the payload must be [ts, [event, ...], data_parallel_rank]")
    ts, events = body[0], body[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KvEventsError(f"ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise KvEventsError(f"events must be a list, got {type(events).__name__}")
    return KvEventBatch(int.from_bytes(seq_frame, "big"), float(ts), tuple(_event(e) for e in events))


def _to_wire(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium.upper(),
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium.upper(),
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(seq: int, ts: float, events: Sequence[KvEvent]) -> list[bytes]:
    """The 3 frames vLLM would publish for these events (maps, data-parallel rank 0)."""
    payload = msgpack.packb([ts, [_to_wire(e) for e in events], 0])
    return [TOPIC, seq.to_bytes(8, "big"), payload]
