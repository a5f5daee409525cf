"""The agents' data-plane frames: what a receiver asks a holder for, and how the bytes come back.

One connection per fetch: the receiver's DEALER connects to the holder's ROUTER and sends a
``FetchRequest``; the holder answers ``Refused`` (and the connection may ask again) or ``Start``, then
streams ``Chunk``s. A chunk is one message of several parts: this module's header, then one part per
block, each part one layer's bytes of one block, sent from the holder's arena without a copy. Chunks
go layer by layer (layer 0 of every block, then layer 1, ...) so the receiver's engine can load the
first layers while the later ones travel. The receiver hands back ``Credit`` as it lands chunks (the
holder never has more than the request's ``window`` unlanded), and ends with ``Done``, which is also
how it cancels. The holder sends ``Ping`` only while it waits on a silent receiver, to learn whether
the connection is still there.

Every header is msgpack ``[op, field, ...]``. ``decode`` checks each field's type and bound and
raises ``MalformedFrame`` with a short reason (the holder sends that reason back in a ``Refused``):
a peer's frame never crashes either side.

**Versions.** Agents meet other agents of other releases during a rolling upgrade, so the link has
a version (``FRAMES_VERSION``), set by the fetch: ``FetchRequest.version`` is the version the
receiver speaks, and the holder answers in it (``Start.version``) or refuses it. A version is
written as one more field after the request's (and the Start's) own, and left out while it is 1:
version 1 is the layout of the agents before versions existed, so they and this one read each other
unchanged. A frame of a later version than this side reads raises ``UnsupportedVersion``, whose
reason names both; the holder sends it back as ``Refused{reason, code: "unsupported_version"}``,
which tells the receiver to ask again in an older version. A later version keeps every field of
version 1 in place and the version where it is, and appends what it adds after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from vllm_disagg.agent.kv.arena import Geometry
from vllm_disagg.errors import MalformedFrame, UnsupportedVersion
from vllm_disagg.wire.block_hash import Extra, read_extra

FRAMES_VERSION = 1  # the newest version of the frames this agent reads and speaks
MAX_KEYS = 1 << 16  # blocks in one fetch: a 1M-token prompt of 16-token blocks
MAX_KEY_BYTES = 64  # vLLM's block hashes are 32 bytes (sha256); room for a longer one
MAX_VERSION = 1 << 16  # a version above it is garbage, not a later release
MAX_TOKEN_CHARS = 256
MAX_REASON_CHARS = 500
MAX_WINDOW = 1024


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """Receiver -> holder: send these blocks of this grant, in this geometry."""

    token: str = field(repr=False)
    keys: tuple[bytes, ...]
    geometry: Geometry  # the receiver's: the holder refuses a fetch into a differently shaped pool
    window: int  # chunks the holder may send ahead of the receiver's credit
    timeout_s: float  # the receiver gives up by then, so the holder's stream may end then too
    version: int = FRAMES_VERSION  # the frames the receiver speaks on this connection


@dataclass(frozen=True, slots=True)
class Start:
    """Holder -> receiver: the first ``blocks`` of the requested keys follow, layer by layer."""

    blocks: int
    geometry: Geometry  # the holder's, so the receiver checks the match too
    # Each block's token ids (empty where the holder does not know them), which the receiver's pool
    # reports with it: ``kv_fetch`` names only keys, and the orchestrator indexes a block by its tokens.
    tokens: tuple[tuple[int, ...], ...]
    version: int = FRAMES_VERSION  # the request's: the frames of this connection
    # Each block's extra keys (LoRA, multimodal, cache salt), which its key covers: the receiver checks
    # them with the tokens. Empty: none has any (a holder of before says none, and such a block's
    # check then fails: it is computed, never served).
    extras: tuple[Extra | None, ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """Holder -> receiver: layer ``layer`` of blocks ``first``, ``first + 1``, ... (one part each)."""

    layer: int
    first: int


@dataclass(frozen=True, slots=True)
class Credit:
    """Receiver -> holder: ``chunks`` more chunks landed; the holder may send that many more."""

    chunks: int


@dataclass(frozen=True, slots=True)
class Done:
    """Receiver -> holder: the fetch is over (``landed`` blocks committed); also a cancel."""

    landed: int


@dataclass(frozen=True, slots=True)
class Refused:
    """Holder -> receiver: this request (or frame) is not served, and why."""

    reason: str
    code: str = ""  # "unsupported_version": ask again in an older version; "" otherwise


@dataclass(frozen=True, slots=True)
class Ping:
    """Holder -> receiver: nothing; the send fails if the receiver's connection is gone."""


Frame = FetchRequest | Start | Chunk | Credit | Done | Refused | Ping


def encode(frame: Frame) -> bytes:
    """The header part of ``frame``."""
    fields: list[Any]
    match frame:
        case FetchRequest():
            fields = [
                "fetch",
                frame.token,
                list(frame.keys),
                frame.geometry.to_wire(),
                frame.window,
                frame.timeout_s,
                *_version(frame.version),
            ]
        case Start():
            tokens = [list(t) for t in frame.tokens]
            fields = ["start", frame.blocks, frame.geometry.to_wire(), tokens, *_version(frame.version)]
            if any(e is not None for e in frame.extras):  # after the version, which is then always said
                fields[4:] = [frame.version, list(frame.extras)]
        case Chunk():
            fields = ["chunk", frame.layer, frame.first]
        case Credit():
            fields = ["credit", frame.chunks]
        case Done():
            fields = ["done", frame.landed]
        case Refused():
            fields = ["refused", frame.reason[:MAX_REASON_CHARS], *([frame.code] if frame.code else [])]
        case Ping():
            fields = ["ping"]
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def _version(version: int) -> list[int]:
    # Version 1 is written as the agents before versions wrote it: without one.
    return [] if version == 1 else [version]


def decode(data: bytes | memoryview, max_bytes: int) -> Frame:
    """The frame a header part holds; ``UnsupportedVersion`` for a later version's, and
    ``MalformedFrame`` with a reason for anything else."""
    if len(data) > max_bytes:
        raise MalformedFrame(f"header of {len(data)} bytes, over the limit of {max_bytes}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.UnpackException, RecursionError):
        raise MalformedFrame("not msgpack") from None
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise MalformedFrame("expected [op, field, ...]")
    op, fields = raw[0], raw[1:]
    decoder = _DECODERS.get(op)
    if decoder is None:
        raise MalformedFrame(f"unknown op {op[:40]!r}")
    want = _ARITY[op]
    if op in _VERSIONED and len(fields) > want:
        version = _int(fields[want], "version", 1, MAX_VERSION)
        if version > FRAMES_VERSION:
            raise UnsupportedVersion(
                f"{op} of KV frames v{version}: this agent reads v1 to v{FRAMES_VERSION} (ask in v1)"
            )
        want += 1
    elif op == "refused" and len(fields) == 2:
        want = 2  # with a code
    if op == "start" and len(fields) == want + 1 and want > _ARITY[op]:
        want += 1  # with each block's extra keys (after the version, which is then always said)
    if len(fields) != want:
        raise MalformedFrame(f"{op}: expected {want} fields, got {len(fields)}")
    return decoder(fields)


def _int(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise MalformedFrame(f"{what}: expected an integer in [{low}, {high}]")
    return value


def _geometry(value: object) -> Geometry:
    try:
        return Geometry.from_wire(value)
    except ValueError:
        raise MalformedFrame("geometry: expected {num_layers, layer_block_bytes, block_size}") from None


def _fetch(fields: list[Any]) -> FetchRequest:
    token, keys, geometry, window, timeout_s = fields[:5]
    version = fields[5] if len(fields) > 5 else 1
    if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
        raise MalformedFrame(f"token: expected a string of 1 to {MAX_TOKEN_CHARS} characters")
    if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS:
        raise MalformedFrame(f"keys: expected a list of 1 to {MAX_KEYS} keys")
    if not all(isinstance(k, bytes) and 0 < len(k) <= MAX_KEY_BYTES for k in keys):
        raise MalformedFrame(f"keys: each must be 1 to {MAX_KEY_BYTES} bytes")
    if not isinstance(timeout_s, float | int) or not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise MalformedFrame("timeout_s: expected a positive number of seconds")
    window = _int(window, "window", 1, MAX_WINDOW)
    return FetchRequest(token, tuple(keys), _geometry(geometry), window, float(timeout_s), version)


def _start(fields: list[Any]) -> Start:
    blocks, geometry, tokens = _int(fields[0], "blocks", 0, MAX_KEYS), _geometry(fields[1]), fields[2]
    if not isinstance(tokens, list) or len(tokens) != blocks:
        raise MalformedFrame(f"tokens: expected the token ids of each of the {blocks} blocks")
    for ids in tokens:
        if not isinstance(ids, list) or len(ids) not in (0, geometry.block_size):
            raise MalformedFrame(f"tokens: expected {geometry.block_size} token ids per block, or none")
        if not all(type(t) is int and t >= 0 for t in ids):
            raise MalformedFrame("tokens: expected non-negative integers")
    version = fields[3] if len(fields) > 3 else 1
    extras: tuple[Extra | None, ...] = ()
    if len(fields) > 4:
        raw = fields[4]
        if not isinstance(raw, list) or len(raw) != blocks:
            raise MalformedFrame(f"extras: expected the extra keys of each of the {blocks} blocks")
        try:
            extras = tuple(read_extra(e) for e in raw)
        except ValueError as e:
            raise MalformedFrame(str(e)) from None
    return Start(blocks, geometry, tuple(tuple(ids) for ids in tokens), version, extras)


def _chunk(fields: list[Any]) -> Chunk:
    return Chunk(_int(fields[0], "layer", 0, 1 << 16), _int(fields[1], "first", 0, MAX_KEYS))


def _refused(fields: list[Any]) -> Refused:
    code = fields[1] if len(fields) > 1 else ""
    if not isinstance(fields[0], str) or not isinstance(code, str):
        raise MalformedFrame("reason: expected a string (and a code)")
    return Refused(fields[0][:MAX_REASON_CHARS], code[:MAX_TOKEN_CHARS])


_DECODERS: dict[str, Callable[[list[Any]], Frame]] = {
    "fetch": _fetch,
    "start": _start,
    "chunk": _chunk,
    "credit": lambda f: Credit(_int(f[0], "chunks", 1, MAX_WINDOW)),
    "done": lambda f: Done(_int(f[0], "landed", 0, MAX_KEYS)),
    "refused": _refused,
    "ping": lambda f: Ping(),
}
# Fields of version 1; the versioned ops may carry the version after them.
_ARITY = {"fetch": 5, "start": 3, "chunk": 2, "credit": 1, "done": 1, "refused": 1, "ping": 0}
_VERSIONED = frozenset({"fetch", "start"})
