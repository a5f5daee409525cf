#!/usr/bin/env python3
"""Measure the protocol codec against msgspec on the real messages: encode + decode, median µs.

    python scripts/bench_codec.py [--repeat 15] [--seconds 0.2]   (from the checkout's virtualenv)

Three ways to carry each message:

- ``codec``: the project's codec (``vllm_disagg/protocol/codec.py``): msgpack, then every field
  checked against the dataclass's annotation, into the frozen dataclasses.
- ``msgspec``: msgspec's msgpack with a ``msgspec.Struct`` mirror of each message, made here from the
  dataclasses' annotations (nested structs, literals, tagged unions of payloads), with msgspec's own
  validation; what the messages would become if the project moved to msgspec. It writes the same
  ``[tag, {fields}]`` frames (the envelope read as ``(tag, Raw)``, then the fields by the tag's type).
- ``msgpack``: ``msgpack.packb``/``unpackb`` of the frame alone, no validation and no dataclasses: the
  floor under both.

msgspec is not a dependency of the project (vLLM brings it where an engine runs): install it to run
this (``pip install msgspec``). The results and the decision are in docs/protocol.md ("The codec").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

import msgpack
import msgspec

from vllm_disagg.protocol.codec import decode, encode
from vllm_disagg.protocol.commands import KvFetch
from vllm_disagg.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Command,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvEvent,
    KvEvents,
    Message,
    MetricsSnapshot,
)

METRICS = MetricsSnapshot(
    1767225600.25, 3, 1, 0.125, 0.042, 0.011, 0.5, 10.0, 120, 51200, 7680, 0.003, 20480.0, 426.5, 1536, 8192,
    41472, 0.125, 1767225600.375,
)  # fmt: skip
BLOCK = 16
U64 = 0x9E3779B97F4A7C15  # hashes are 64-bit: the widest integers msgpack writes


def stored(first: int, blocks: int) -> KvEvent:
    hashes = [(U64 * (first + i)) % 2**64 for i in range(blocks)]
    return KvEvent("stored", hashes, None, list(range(blocks * BLOCK)), BLOCK)


FETCH = KvFetch("t" * 24, [b"k" * 32] * 512, "tcp://10.0.0.5:11100", "", 2.0)
MESSAGES: list[tuple[str, Message]] = [
    ("Heartbeat (every metric)", Heartbeat(seq=42, engine_state="ready", metrics=METRICS)),
    (
        "Hello",
        Hello(PROTOCOL_VERSION, "prefill-0", InstanceInfo("http://10.0.0.5:8100", "prefill", "m"), "5f0c", 5),
    ),
    ("KvEvents, 1 event of 32 blocks", KvEvents(seq=7, events=[stored(0, 32)])),
    ("KvEvents, 200 events of 16 blocks", KvEvents(seq=8, events=[stored(16 * i, 16) for i in range(200)])),
    ("Command drain", Command(id=7, kind="drain")),
    ("Command kv_fetch, 512 keys (1.5)", Command.of(9, FETCH)),
    ("Command kv_fetch, 512 keys (1.4 args)", Command.of(9, FETCH).for_minor(4)),
]  # fmt: skip


# --- msgspec mirrors of the messages ---------------------------------------------------------------
def mirror(cls: type[Any], made: dict[type[Any], type[msgspec.Struct]]) -> type[msgspec.Struct]:
    """A ``msgspec.Struct`` with the dataclass's fields, types and defaults."""
    if cls in made:
        return made[cls]
    hints = typing.get_type_hints(cls)
    fields: list[Any] = []
    for f in dataclasses.fields(cls):
        tp = _mirror_type(hints[f.name], made)
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, tp, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp))
    kind = getattr(cls, "KIND", None)
    tag: dict[str, Any] = {"tag_field": "kind", "tag": kind} if isinstance(kind, str) else {}
    made[cls] = msgspec.defstruct(cls.__name__, fields, omit_defaults=True, frozen=True, **tag)
    return made[cls]


def _mirror_type(tp: Any, made: dict[type[Any], type[msgspec.Struct]]) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return mirror(tp, made)
    if origin in (Union, types.UnionType):
        return Union[tuple(_mirror_type(a, made) for a in typing.get_args(tp))]  # noqa: UP007
    if origin is list:
        return list[_mirror_type(typing.get_args(tp)[0], made)]  # type: ignore[misc]
    if origin is dict:
        key, value = typing.get_args(tp)
        return dict[key, _mirror_type(value, made)]  # type: ignore[valid-type]
    if origin is Literal or tp in (int, float, str, bool, bytes, type(None)):
        return tp
    raise TypeError(f"no mirror for {tp!r}")


MADE: dict[type[Any], type[msgspec.Struct]] = {}
MIRRORS = {cls.TAG: mirror(cls, MADE) for cls in MESSAGE_TYPES}
DECODERS = {tag: msgspec.msgpack.Decoder(struct) for tag, struct in MIRRORS.items()}
ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
ENCODER = msgspec.msgpack.Encoder()


def to_mirror(value: Any) -> Any:
    """A dataclass message as its mirror (done once per message, outside the timing)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        struct = MADE[type(value)]
        return struct(**{f.name: to_mirror(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, list):
        return [to_mirror(v) for v in value]
    return value


def msgspec_round_trip(tag: str, struct: Any) -> Any:
    tag, raw = ENVELOPE.decode(ENCODER.encode((tag, struct)))
    return DECODERS[tag].decode(raw)


# --- timing -------------------------------------------------------------------------------------
def calibrate(fn: Callable[[], object], seconds: float) -> int:
    """How many calls take about ``seconds``."""
    number = 1
    while True:
        start = time.thread_time()
        for _ in range(number):
            fn()
        elapsed = time.thread_time() - start
        if elapsed > seconds / 4:
            return max(1, round(number * seconds / elapsed))
        number *= 2


def interleaved_us(fns: list[Callable[[], object]], repeat: int, seconds: float) -> list[list[float]]:
    """Each function's CPU time per call (µs) in each of ``repeat`` rounds. CPU time of this thread,
    not wall time: on a shared machine the time others take the core is not counted. The functions
    take turns in every round, so what the machine does to caches it does to each alike."""
    numbers = [calibrate(fn, seconds) for fn in fns]
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, number, out in zip(fns, numbers, runs, strict=True):
            start = time.thread_time_ns()
            for _ in range(number):
                fn()
            out.append((time.thread_time_ns() - start) / number / 1000)
    return runs


def row(name: str, message: Message, repeat: int, seconds: float) -> str:
    """One message's line of the table: median µs of each way, and the median of the rounds' ratios."""
    frame = encode(message)
    assert decode(frame) == message
    tag, struct = message.TAG, to_mirror(message)
    assert msgspec_round_trip(tag, struct) == struct
    tree = msgpack.unpackb(frame)
    ours, theirs, floor = interleaved_us(
        [
            lambda: decode(encode(message)),
            lambda: msgspec_round_trip(tag, struct),
            lambda: msgpack.unpackb(msgpack.packb(tree)),
        ],
        repeat,
        seconds,
    )
    ratio = statistics.median(o / t for o, t in zip(ours, theirs, strict=True))
    cells = [statistics.median(ours), statistics.median(theirs), statistics.median(floor)]
    return f"| {name} | {len(frame)} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {ratio:.1f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per cell (the median is shown)")
    parser.add_argument("--seconds", type=float, default=0.2, help="about how long one run lasts")
    args = parser.parse_args(argv)
    print(f"Python {sys.version.split()[0]}, msgpack {msgpack.version}, msgspec {msgspec.__version__}")
    print()
    print("| message | bytes | codec µs | msgspec µs | msgpack alone µs | codec / msgspec (median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, message in MESSAGES:
        print(row(name, message, args.repeat, args.seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
