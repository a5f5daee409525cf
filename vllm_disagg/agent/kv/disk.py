"""The pool's disk tier: blocks evicted from the host-memory pool, kept in files that outlive the agent.

One file per block, named by its key, under a directory per KV geometry (``<dir>/<layers>x<bytes>x
<tokens>/``: an engine of another shape finds none of them and removes none). A file is

    magic (8) | header length (4) | header (msgpack-free: struct-packed) | payload | checksum (16)

where the header holds the key, the parent key and the block's token ids (what the orchestrator's
index needs to chain it), then, for a block of a LoRA adapter, multimodal inputs or a salted prompt,
its extra keys (msgpack, to the header's end); the payload is the block's bytes exactly as its pool
slot holds them (every layer, layer-major), and the checksum is BLAKE2b-128 over everything before
it. A file is written under a temporary name and renamed, so a reader sees a whole file or none; a
file cut short or changed on disk (a crash before the page cache reached the disk, a bad sector)
fails the checksum and is deleted, never loaded: its engine computes the block again.

Capacity is in bytes; past it the least recently used files go (a load or a spill makes a block the
newest). Blocks on disk have no references: only the memory pool's copy of a promoted block is
pinned, so eviction across the two tiers is the memory pool's LRU with references, then this LRU.
``open`` rebuilds the index from the directory (oldest modification first), so the tier survives a
restart of its agent. Like the pool, it has one owner (the agent's event loop) and no locks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgpack

from vllm_disagg.agent.kv.arena import Capacity, Geometry
from vllm_disagg.agent.kv.pool import BlockKey, chain_order
from vllm_disagg.errors import ConfigError
from vllm_disagg.private_files import private_dir
from vllm_disagg.wire.block_hash import Extra, read_extra

log = logging.getLogger(__name__)

MAGIC = b"vdkvblk1"
SUFFIX = ".kvb"
_CHECKSUM = 16
_LENGTH = struct.Struct("<I")
_MAX_KEY = 64  # vLLM's sha256 block hashes are 32 bytes
_MAX_HEADER = 1 << 20


def disk_bytes(text: str) -> int:
    """A disk tier's capacity: bytes, as ``50GiB`` or ``500MB`` (blocks and shares mean nothing here)."""
    try:
        capacity = Capacity.parse(text)
    except ConfigError:
        capacity = None
    if capacity is None or capacity.unit != "bytes" or capacity.amount < 1:
        raise ConfigError(f"kv disk capacity {text!r}: give bytes, as 50GiB or 500MB")
    return int(capacity.amount)


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """What the tier knows of a block without reading its payload."""

    parent: BlockKey | None
    token_ids: tuple[int, ...]
    size: int  # the file's bytes
    extra: Extra | None = None  # vLLM's extra keys, where its key covers some


@dataclass(frozen=True, slots=True)
class DiskStats:
    blocks: int
    bytes: int
    capacity_bytes: int
    spills: int  # lifetime blocks written
    loads: int  # lifetime blocks read back whole
    corrupt: int  # lifetime files that failed their checksum (deleted, never loaded)
    evictions: int  # lifetime files removed for room


def _pack_header(
    key: BlockKey, parent: BlockKey | None, token_ids: tuple[int, ...], extra: Extra | None
) -> bytes:
    parent_bytes = parent or b""
    return (
        struct.pack("<BB", len(key), len(parent_bytes))
        + key
        + parent_bytes
        + struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)
        + (b"" if extra is None else msgpack.packb(extra, use_bin_type=True))
    )


def _unpack_header(header: bytes) -> tuple[BlockKey, BlockKey | None, tuple[int, ...], Extra | None]:
    key_len, parent_len = struct.unpack_from("<BB", header, 0)
    at = 2
    key, parent = header[at : at + key_len], header[at + key_len : at + key_len + parent_len]
    at += key_len + parent_len
    (count,) = struct.unpack_from("<I", header, at)
    tokens = struct.unpack_from(f"<{count}q", header, at + 4)
    at += 4 + 8 * count
    if at > len(header) or not key:
        raise ValueError("header length does not match its fields")
    extra = None
    if at < len(header):
        try:
            extra = read_extra(msgpack.unpackb(header[at:], raw=False))
        except (ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"header: extra keys: {e}") from None
    return key, parent or None, tuple(tokens), extra


class DiskTier:
    """Blocks of one geometry in ``directory``, at most ``capacity_bytes`` of files."""

    def __init__(self, directory: Path, geometry: Geometry, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"a disk tier needs a capacity of at least one byte, got {capacity_bytes}")
        self.geometry = geometry
        self.capacity_bytes = capacity_bytes
        g = geometry
        self.directory = directory / f"{g.num_layers}x{g.layer_block_bytes}x{g.block_size}"
        self._index: OrderedDict[BlockKey, DiskBlock] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._spills = self._loads = self._corrupt = self._evictions = 0
        self.removed: list[BlockKey] = []  # evicted or found corrupt since the last ``take_removed``
        self.stored: list[BlockKey] = []  # written since the last ``take_stored``

    @classmethod
    def open(cls, directory: Path, geometry: Geometry, capacity_bytes: int) -> DiskTier:
        """The tier in ``directory`` for ``geometry``, its index rebuilt from the files there."""
        tier = cls(directory, geometry, capacity_bytes)
        private_dir(directory)  # the blocks are prompts' KV: this user's alone, as the files are
        private_dir(tier.directory)
        tier._rebuild()
        return tier

    def _rebuild(self) -> None:
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(".tmp"):  # a write cut short: never renamed, never valid
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                key, block = self._read_header(path)
                found.append((path.stat().st_mtime_ns, key, block))
            except (OSError, ValueError, struct.error) as e:
                log.warning("disk tier: %s is not a block file (%s): removed", path.name, e)
                self._corrupt += 1
                path.unlink(missing_ok=True)
        for _, key, block in sorted(found, key=lambda f: f[0]):
            self._index[key] = block
            self._bytes += block.size
        self._make_room(0)
        self.removed.clear()  # nobody was told of what this start found and then trimmed
        self.stored = chain_order(list(self._index), self._parent)  # to be told, parents first
        log.info("disk tier %s: %d blocks, %d bytes", self.directory, len(self._index), self._bytes)

    # --- reads -------------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[BlockKey]:
        return list(self._index)

    def info(self, key: BlockKey) -> DiskBlock | None:
        return self._index.get(key)

    def _parent(self, key: BlockKey) -> BlockKey | None:
        block = self._index.get(key)
        return None if block is None else block.parent

    def leading(self, keys: list[BlockKey]) -> int:
        """How many of ``keys``, from the first, the tier holds."""
        n = 0
        for key in keys:
            if key not in self._index:
                break
            n += 1
        return n

    def stats(self) -> DiskStats:
        return DiskStats(
            len(self._index),
            self._bytes,
            self.capacity_bytes,
            self._spills,
            self._loads,
            self._corrupt,
            self._evictions,
        )

    def load(self, key: BlockKey, into: memoryview) -> bool:
        """Read the block's payload into ``into`` (its pool slot) if its file is whole; False (and the
        file deleted) if it is missing, torn or corrupt: the engine computes the block."""
        block = self._index.get(key)
        if block is None:
            return False
        path = self._path(key)
        try:
            data = path.read_bytes()
            header_end = self._check(data, key)
        except (OSError, ValueError, struct.error) as e:
            log.warning(
                "disk tier: block %s is unusable (%s): removed, to be computed again", key.hex()[:16], e
            )
            self._corrupt += 1
            self._forget(key)
            path.unlink(missing_ok=True)
            return False
        into[:] = data[header_end : len(data) - _CHECKSUM]
        self._index.move_to_end(key)
        with contextlib.suppress(OSError):  # the order survives a restart: the index is rebuilt by it
            os.utime(path)
        self._loads += 1
        return True

    # --- writes ------------------------------------------------------------------------------------
    def spill(
        self,
        key: BlockKey,
        parent: BlockKey | None,
        token_ids: tuple[int, ...],
        payload: memoryview,
        extra: Extra | None = None,
    ) -> bool:
        """Write a block (its pool slot's bytes) to its file; False if it cannot fit or the write
        failed. A block already on disk is only made the newest."""
        if key in self._index:
            self._index.move_to_end(key)
            with contextlib.suppress(OSError):
                os.utime(self._path(key))
            return True
        if len(payload) != self.geometry.block_bytes or not 0 < len(key) <= _MAX_KEY:
            raise ValueError(
                f"a block of {self.geometry} is {self.geometry.block_bytes} bytes, got {len(payload)}"
            )
        header = _pack_header(key, parent, token_ids, extra)
        head = MAGIC + _LENGTH.pack(len(header)) + header
        digest = hashlib.blake2b(head, digest_size=_CHECKSUM)
        digest.update(payload)
        size = len(head) + len(payload) + _CHECKSUM
        if size > self.capacity_bytes:
            return False
        self._make_room(size)
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as f:
                f.write(head)
                f.write(payload)
                f.write(digest.digest())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("disk tier: writing block %s failed: %s", key.hex()[:16], e)
            tmp.unlink(missing_ok=True)
            return False
        self._index[key] = DiskBlock(parent, tuple(token_ids), size, extra)
        self._bytes += size
        self._spills += 1
        self.stored.append(key)
        return True

    def remove(self, key: BlockKey) -> None:
        if key in self._index:
            self._forget(key)
            self._path(key).unlink(missing_ok=True)

    def take_removed(self) -> list[BlockKey]:
        out, self.removed = self.removed, []
        return out

    def take_stored(self) -> list[BlockKey]:
        out, self.stored = self.stored, []
        return [k for k in out if k in self._index]

    # --- inside ------------------------------------------------------------------------------------
    def _path(self, key: BlockKey) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def _forget(self, key: BlockKey) -> None:
        block = self._index.pop(key)
        self._bytes -= block.size
        self.removed.append(key)

    def _make_room(self, size: int) -> None:
        while self._index and self._bytes + size > self.capacity_bytes:
            key = next(iter(self._index))
            self._evictions += 1
            self.remove(key)

    def _read_header(self, path: Path) -> tuple[BlockKey, DiskBlock]:
        with open(path, "rb") as f:
            start = f.read(len(MAGIC) + _LENGTH.size)
            if len(start) != len(MAGIC) + _LENGTH.size or start[: len(MAGIC)] != MAGIC:
                raise ValueError("no block file magic")
            (length,) = _LENGTH.unpack_from(start, len(MAGIC))
            if length > _MAX_HEADER:
                raise ValueError(f"header of {length} bytes")
            key, parent, tokens, extra = _unpack_header(f.read(length))
        size = path.stat().st_size
        expected = len(start) + length + self.geometry.block_bytes + _CHECKSUM
        if size != expected or path.name != key.hex() + SUFFIX:
            raise ValueError(f"{size} bytes, expected {expected} for its geometry and name")
        return key, DiskBlock(parent, tokens, size, extra)

    def _check(self, data: bytes, key: BlockKey) -> int:
        """Where the payload starts in a whole, unchanged file of ``key``; ``ValueError`` otherwise."""
        if data[: len(MAGIC)] != MAGIC:
            raise ValueError("no block file magic")
        length: int = _LENGTH.unpack_from(data, len(MAGIC))[0]
        header_end = len(MAGIC) + _LENGTH.size + length
        if len(data) != header_end + self.geometry.block_bytes + _CHECKSUM:
            raise ValueError(f"{len(data)} bytes: cut short or padded")
        digest = hashlib.blake2b(data[: len(data) - _CHECKSUM], digest_size=_CHECKSUM).digest()
        if digest != data[len(data) - _CHECKSUM :]:
            raise ValueError("checksum mismatch")
        if _unpack_header(data[len(MAGIC) + _LENGTH.size : header_end])[0] != key:
            raise ValueError("the file holds another block")
        return header_end
