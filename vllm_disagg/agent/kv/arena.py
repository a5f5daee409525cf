"""The pool's bytes: one shared-memory file of fixed-size slots that the agent and its engine both map.

The agent creates it (``SlotArena.create``) once the engine's worker says its KV geometry, and the
worker maps the same file (``SlotArena.attach``) to copy blocks in and out of its KV cache without
the agent touching the bytes: a save or a load is a memcpy in the engine's process. A slot is one block
of every layer, layer-major (``layer_view``), so a transfer can move and land layer by layer.

Each slot has a header word, ``layers_ready``: how many of its layers are written. A transfer that
lands a block's layers one by one raises it as each lands, and an engine loading that block waits on
it per layer (``connector.py``), which is what lets the first layers load while later ones travel.
``FAILED`` says the block will never be complete (the transfer died): the load reports it and the
engine recomputes. The word is written by one side and read by the other; an aligned 4-byte store is
atomic on every platform vLLM runs on.

The file starts with what it holds (geometry and slot count), which ``attach`` checks: a worker with
another geometry whose file would have the same size is refused, not handed the wrong bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.errors import ConfigError

HEADER_BYTES_PER_SLOT = 8  # int32 layers_ready, uint32 spare
_DESCRIPTOR = struct.Struct("<8s4Q")  # magic, num_layers, layer_block_bytes, block_size, capacity
_MAGIC = b"vdkvpool"
_HEADERS_AT = 64  # the slots' header words follow the descriptor
FAILED = -1
SHM_DIR = Path("/dev/shm")
_ALIGN = 4096  # slots start on page boundaries: copies in and out stay aligned


@dataclass(frozen=True, slots=True)
class Geometry:
    """One block's shape in the engine's KV cache: how many layers and the bytes of one layer's block."""

    num_layers: int
    layer_block_bytes: int
    block_size: int  # tokens per block

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    def to_wire(self) -> dict[str, int]:
        return {
            "num_layers": self.num_layers,
            "layer_block_bytes": self.layer_block_bytes,
            "block_size": self.block_size,
        }

    @classmethod
    def from_wire(cls, raw: object) -> Geometry:
        if not isinstance(raw, dict):
            raise ValueError("geometry must be a map")
        try:
            geometry = cls(int(raw["num_layers"]), int(raw["layer_block_bytes"]), int(raw["block_size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad geometry {raw!r}: {e}") from None
        if min(geometry.num_layers, geometry.layer_block_bytes, geometry.block_size) < 1:
            raise ValueError(f"bad geometry {raw!r}: every field must be positive")
        return geometry


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B|B|blocks?)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@dataclass(frozen=True, slots=True)
class Capacity:
    """The pool's size as configured: a number of blocks, of bytes, or a share of the host's memory."""

    amount: float
    unit: str  # "blocks" | "bytes" | "share"

    @classmethod
    def parse(cls, text: str) -> Capacity:
        """``4096`` or ``4096 blocks``; ``512MiB``, ``2GiB``, ``1GB``; ``10%`` of the host's memory."""
        m = _SIZE.match(text)
        if not m:
            raise ConfigError(
                f"kv pool capacity {text!r}: give blocks (4096), bytes (512MiB, 2GiB) or a share (10%)"
            )
        amount, unit = float(m.group(1)), (m.group(2) or "blocks").lower()
        if unit.startswith("block"):
            return cls(amount, "blocks")
        if unit == "%":
            if not 0 < amount <= 90:
                raise ConfigError(f"kv pool capacity {text!r}: a share must be above 0% and at most 90%")
            return cls(amount / 100, "share")
        return cls(amount * _UNITS[unit], "bytes")

    def blocks(self, geometry: Geometry, memory_bytes: int | None = None) -> int:
        """How many blocks of ``geometry`` that is (at least one)."""
        if self.unit == "blocks":
            n = int(self.amount)
        elif self.unit == "bytes":
            n = int(self.amount // _slot_bytes(geometry))
        else:
            total = memory_bytes if memory_bytes is not None else host_memory_bytes()
            n = int(total * self.amount // _slot_bytes(geometry))
        if n < 1:
            raise ConfigError(f"kv pool capacity {self} holds no block of {geometry.block_bytes} bytes")
        return n

    def __str__(self) -> str:
        if self.unit == "share":
            return f"{self.amount * 100:g}%"
        if self.unit == "bytes":
            for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
                if self.amount >= size and self.amount % size == 0:
                    return f"{self.amount / size:g}{name}"
        return f"{self.amount:g} {self.unit}"


def host_memory_bytes() -> int:
    """MemTotal of this host."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def _slot_bytes(geometry: Geometry) -> int:
    return -(-geometry.block_bytes // _ALIGN) * _ALIGN


class SlotArena:
    """``capacity`` slots of one block each in a shared-memory file, plus a header word per slot."""

    def __init__(self, path: Path, geometry: Geometry, capacity: int, *, owner: bool) -> None:
        self.path = path
        self.geometry = geometry
        self.capacity = capacity
        self.slot_bytes = _slot_bytes(geometry)
        self._data_offset = -(-(_HEADERS_AT + capacity * HEADER_BYTES_PER_SLOT) // _ALIGN) * _ALIGN
        self.size = self._data_offset + capacity * self.slot_bytes
        self._owner = owner
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0)
        fd = os.open(path, flags, 0o600)  # only this user: the bytes are prompts' KV
        try:
            if owner:
                os.ftruncate(fd, self.size)
            elif os.fstat(fd).st_size != self.size:
                raise ValueError(
                    f"{path} is {os.fstat(fd).st_size} bytes, expected {self.size} for "
                    f"{capacity} slots of {geometry}"
                )
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        descriptor = _DESCRIPTOR.pack(
            _MAGIC, geometry.num_layers, geometry.layer_block_bytes, geometry.block_size, capacity
        )
        if owner:
            self._map[: _DESCRIPTOR.size] = descriptor
        elif self._map[: _DESCRIPTOR.size] != descriptor:
            self._map.close()
            raise ValueError(f"{path} does not hold {capacity} slots of {geometry}")
        self.buffer = memoryview(self._map)

    @classmethod
    def create(cls, name: str, geometry: Geometry, capacity: int) -> SlotArena:
        path = SHM_DIR / name if SHM_DIR.is_dir() else Path("/tmp") / name
        path.unlink(missing_ok=True)  # a previous agent of this name that died without cleaning up
        return cls(path, geometry, capacity, owner=True)

    @classmethod
    def attach(cls, path: str | Path, geometry: Geometry, capacity: int) -> SlotArena:
        return cls(Path(path), geometry, capacity, owner=False)

    def offset(self, slot: int, layer: int = 0) -> int:
        """Where a slot's layer starts in the file."""
        if not 0 <= slot < self.capacity or not 0 <= layer < self.geometry.num_layers:
            raise IndexError(f"slot {slot} layer {layer} outside {self.capacity}x{self.geometry}")
        return self._data_offset + slot * self.slot_bytes + layer * self.geometry.layer_block_bytes

    def layer_view(self, slot: int, layer: int) -> memoryview:
        start = self.offset(slot, layer)
        return self.buffer[start : start + self.geometry.layer_block_bytes]

    def block_view(self, slot: int) -> memoryview:
        start = self.offset(slot)
        return self.buffer[start : start + self.geometry.block_bytes]

    def layers_ready(self, slot: int) -> int:
        value: int = struct.unpack_from("<i", self.buffer, self._header(slot))[0]
        return value

    def set_layers_ready(self, slot: int, n: int) -> None:
        struct.pack_into("<i", self.buffer, self._header(slot), n)

    def _header(self, slot: int) -> int:
        # A bad slot must not land in another slot's word or (negative) in the data at the end.
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} outside {self.capacity} slots")
        return _HEADERS_AT + slot * HEADER_BYTES_PER_SLOT

    def close(self) -> None:
        self.buffer.release()
        with contextlib.suppress(BufferError):  # a view someone still holds: the map goes when it does
            self._map.close()
        if self._owner:
            self.path.unlink(missing_ok=True)
