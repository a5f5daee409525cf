"""The one msgpack codec for protocol messages.

A frame is ``msgpack([tag, {field: value, ...}])``. Decoding checks the size first, then the
envelope, the tag, and every field against the dataclass's annotations; any failure is a typed
``CodecError`` with a reason, never a crash. Unknown fields are ignored: a peer of a newer minor
protocol version may append fields this one does not know (missing fields with defaults take them;
a wrongly typed known field is still refused).

A union of dataclasses that each name a ``KIND`` (a command's payload, an Ack's result) is a
*tagged union*: the map of the member's fields plus ``"kind": KIND``, decoded by that tag.

A reason quotes the peer's values only in a bounded form (``_quote``, ``_clip``): the frame comes
from a peer that may be hostile, and the reason goes back to it in a ``Refuse`` and into the log.
"""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union

import msgpack

from vllm_disagg.errors import FieldTypeError, FrameTooLarge, MalformedFrame, UnknownMessageType
from vllm_disagg.protocol.messages import MESSAGE_TYPES, Ack, Command, Message

DEFAULT_MAX_FRAME_BYTES = 1 << 20
M = TypeVar("M")

Check = Callable[[Any, str], Any]  # (value, path) -> converted value, or raises FieldTypeError

# msgpack nests up to 1,024 levels, deeper than Python's recursion limit, so the builtin repr of a
# decoded value can raise RecursionError (and of a long string, echo a megabyte): quote shallowly.
_QUOTER = reprlib.Repr()
_QUOTER.maxlevel = 2
_QUOTER.maxstring = _QUOTER.maxother = 60
_QUOTER.maxlong = 40
_QUOTER.maxlist = _QUOTER.maxdict = 4
_MAX_TEXT = 120  # longest field path or name quoted in a reason
_MAX_NAMES = 5  # unknown or missing field names listed in a reason


def _quote(value: object) -> str:
    """A peer's value as a short repr, whatever its size or depth."""
    return _clip(_QUOTER.repr(value))


def _clip(text: str) -> str:
    """A peer-chosen name (a field path, a map key) cut to a length fit for a reason."""
    return text if len(text) <= _MAX_TEXT else f"{text[:_MAX_TEXT]}...({len(text)} chars)"


def _names(names: typing.Iterable[object]) -> str:
    shown = sorted(_clip(str(n)) for n in names)
    more = len(shown) - _MAX_NAMES
    return repr(shown[:_MAX_NAMES]) + (f" and {more} more" if more > 0 else "")


def _fail(path: str, expected: str, value: object) -> typing.NoReturn:
    raise FieldTypeError(f"field {_clip(path)!r}: expected {expected}, got {type(value).__name__}")


def _checker(tp: Any) -> Check:
    """Compile a validator for one annotation (done once per message class)."""
    scalar = _SCALAR_CHECKS.get(tp) if isinstance(tp, type) else None
    if scalar is not None:
        return scalar
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _literal_checker(typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return _union_checker(tp)
    if origin is list:
        return _list_checker(*typing.get_args(tp))
    if origin is dict:
        return _dict_checker(*typing.get_args(tp))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _StructCodec(tp).decode_fields
    raise TypeError(f"the codec cannot carry annotation {tp!r}")


def _check_float(v: Any, p: str) -> float:
    """A float, or an int (not a bool) taken as one."""
    if isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool)):
        return float(v)
    _fail(p, "float", v)


# By the annotation's type; the int check refuses a bool, which Python counts as an int.
_SCALAR_CHECKS: dict[Any, Check] = {
    bool: lambda v, p: v if isinstance(v, bool) else _fail(p, "bool", v),
    int: lambda v, p: v if isinstance(v, int) and not isinstance(v, bool) else _fail(p, "int", v),
    float: _check_float,
    str: lambda v, p: v if isinstance(v, str) else _fail(p, "str", v),
    bytes: lambda v, p: v if isinstance(v, bytes) else _fail(p, "bytes", v),
}


def _literal_checker(allowed: tuple[Any, ...]) -> Check:
    """Accept one of a Literal's values, of the same type (so True is not taken for 1)."""

    def check_literal(v: Any, p: str) -> Any:
        if v in allowed and type(v) in {type(a) for a in allowed}:
            return v
        raise FieldTypeError(f"field {_clip(p)!r}: expected one of {list(allowed)}, got {_quote(v)}")

    return check_literal


def _union_checker(tp: Any) -> Check:
    """A tagged union by its ``kind``; any other union by trying each member in turn."""
    args = typing.get_args(tp)
    nullable = type(None) in args
    tagged = _tagged(tp)
    if tagged is not None:
        return _tagged_checker(tagged, nullable)
    inner = [_checker(a) for a in args if a is not type(None)]

    def check_union(v: Any, p: str) -> Any:
        if v is None and nullable:
            return None
        for c in inner:
            try:
                return c(v, p)
            except FieldTypeError:
                continue
        _fail(p, " | ".join(getattr(a, "__name__", str(a)) for a in args), v)

    return check_union


def _list_checker(item_tp: Any) -> Check:
    """Check a list item by item, or in one pass for lists of exact ints, bytes or strs."""
    item = _checker(item_tp)
    exact = item_tp if item_tp in (int, bytes, str) else None

    def check_list(v: Any, p: str) -> list[Any]:
        if not isinstance(v, list):
            _fail(p, "list", v)
        # Token ids, block hashes and keys come by the ten thousand: one pass in C for the common
        # case (by exact type: a bool is no int).
        if exact is not None and set(map(type, v)) <= {exact}:
            return v
        return [item(x, f"{p}[{i}]") for i, x in enumerate(v)]

    return check_list


def _dict_checker(key_tp: Any, val_tp: Any) -> Check:
    """Check every key and value of a map."""
    key, val = _checker(key_tp), _checker(val_tp)

    def check_dict(v: Any, p: str) -> dict[Any, Any]:
        if not isinstance(v, dict):
            _fail(p, "map", v)
        return {key(k, f"{p}.<key>"): val(x, f"{p}.{k}") for k, x in v.items()}

    return check_dict


def _tagged(tp: Any) -> dict[str, type[Any]] | None:
    """A union's members by ``KIND`` when every member but None is a dataclass with one, else None."""
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    if not all(dataclasses.is_dataclass(m) and isinstance(getattr(m, "KIND", None), str) for m in members):
        if any(dataclasses.is_dataclass(m) for m in members):
            raise TypeError(f"the codec cannot carry annotation {tp!r}: a union of structs needs KINDs")
        return None
    by_kind = {m.KIND: m for m in members}
    if len(by_kind) != len(members):
        raise TypeError(f"the members of {tp!r} must have KINDs of their own")
    return by_kind


def _tagged_checker(by_kind: dict[str, type[Any]], nullable: bool) -> Check:
    codecs = {kind: _StructCodec(cls) for kind, cls in by_kind.items()}
    kinds = sorted(codecs)

    def check_tagged(v: Any, p: str) -> Any:
        if v is None and nullable:
            return None
        if not isinstance(v, dict):
            _fail(p, "map of fields", v)
        kind = v.get("kind")
        codec = codecs.get(kind) if isinstance(kind, str) else None
        if codec is None:
            raise FieldTypeError(f"field {_clip(p + '.kind')!r}: expected one of {kinds}, got {_quote(kind)}")
        return codec.decode_fields(v, p)

    return check_tagged


class _StructCodec:
    """Field validators for one dataclass, compiled once."""

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.fields = [f for f in dataclasses.fields(cls) if f.init]
        self.names = frozenset(f.name for f in self.fields)
        self.required = frozenset(
            f.name
            for f in self.fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.checks = {f.name: _checker(hints[f.name]) for f in self.fields}
        self.encoders = {f.name: enc for f in self.fields if (enc := _encoder(hints[f.name])) is not None}
        # Fields added after 1.0: left out while they hold their default (a 1.0 peer refuses them).
        self.omitted = {f.name: _default(f) for f in self.fields if f.metadata.get("since_minor")}

    def decode_fields(self, raw: Any, path: str = "") -> Any:
        if not isinstance(raw, dict):
            _fail(path or self.cls.__name__, "map of fields", raw)
        missing = self.required - raw.keys()
        if missing:
            raise FieldTypeError(f"{self.cls.__name__}: missing field(s) {_names(missing)}")
        prefix = f"{path}." if path else ""
        checks = self.checks
        kwargs = {
            name: check(value, prefix + name) for name, value in raw.items() if (check := checks.get(name))
        }
        return self.cls(**kwargs)

    def encode_fields(self, obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        omitted = self.omitted
        for f in self.fields:
            value = getattr(obj, f.name)
            if f.name in omitted and value == omitted[f.name]:
                continue
            encoder = self.encoders.get(f.name)
            out[f.name] = value if encoder is None else encoder(value)
        return out


def _default(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (a factory's product: an empty dict or list)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def for_minor(message: M, minor: int) -> M:
    """``message`` as a peer of protocol 1.``minor`` may receive it: every field a later minor added
    (nested structs included) back at its default, so the codec leaves it out of the frame; a
    command's payload and an Ack's result first in the string maps of 1.4 (``Command.for_minor``,
    ``Ack.for_minor``), not dropped."""
    if isinstance(message, Command | Ack):
        message = typing.cast(M, message.for_minor(minor))
    return typing.cast(M, _downgrade(message, minor))


def _downgrade(obj: Any, minor: int) -> Any:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("since_minor", 0) > minor:
            default = _default(f)
            if value != default:
                changes[f.name] = default
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            lowered = _downgrade(value, minor)
            if lowered is not value:
                changes[f.name] = lowered
    return dataclasses.replace(obj, **changes) if changes else obj


def _encoder(tp: Any) -> Callable[[Any], Any] | None:
    """How to write one annotation's value as msgpack data; None when it is written as it is."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _StructCodec(tp).encode_fields
    if typing.get_origin(tp) in (Union, types.UnionType) and (tagged := _tagged(tp)) is not None:
        codecs = {cls: _StructCodec(cls) for cls in tagged.values()}

        def encode_tagged(v: Any) -> Any:
            return None if v is None else {"kind": v.KIND, **codecs[type(v)].encode_fields(v)}

        return encode_tagged
    if typing.get_origin(tp) is list:
        (item_tp,) = typing.get_args(tp)
        item = _encoder(item_tp)
        if item is not None:
            return lambda v: [item(x) for x in v]
    return None


class Codec:
    """The codec of one link's messages: frozen dataclasses, each with a ``TAG`` (the agents' link
    below; the replicas' link, ``protocol/replicas.py``)."""

    def __init__(self, types: typing.Iterable[type[Any]]) -> None:
        self._by_tag = {cls.TAG: _StructCodec(cls) for cls in types}

    def encode(self, message: Any) -> bytes:
        """One message as a frame."""
        codec = self._by_tag.get(getattr(message, "TAG", ""))
        if codec is None or codec.cls is not type(message):
            raise UnknownMessageType(f"not a message of this link: {type(message).__name__}")
        frame: bytes = msgpack.packb([message.TAG, codec.encode_fields(message)], use_bin_type=True)
        return frame

    def decode(self, frame: bytes | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
        """One frame (bytes, or a view of a received buffer) as a message, or a ``CodecError`` saying
        why not."""
        size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
        if size > max_bytes:
            raise FrameTooLarge(f"frame of {size} bytes is over the limit of {max_bytes}")
        try:
            envelope = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
            # Some msgpack errors carry no message; the class name alone is still a reason.
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise MalformedFrame(f"not a msgpack frame ({_clip(detail)})") from None
        if not (isinstance(envelope, list) and len(envelope) == 2 and isinstance(envelope[0], str)):
            raise MalformedFrame("a frame must be [tag, fields]")
        tag, raw = envelope
        codec = self._by_tag.get(tag)
        if codec is None:
            raise UnknownMessageType(f"unknown message type {_quote(tag)}")
        return codec.decode_fields(raw)


_AGENTS = Codec(MESSAGE_TYPES)


def encode(message: Message) -> bytes:
    """One message of the agents' link as a frame."""
    return _AGENTS.encode(message)


def decode(frame: bytes | memoryview, *, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """One frame of the agents' link as a message, or a ``CodecError`` saying why not."""
    return typing.cast(Message, _AGENTS.decode(frame, max_bytes=max_bytes))
