"""etcd's gRPC JSON gateway on the wire: the errors, the values it answers, and their JSON.

The gateway maps each v3 RPC to ``POST /v3/<service>/<method>`` with the request message as a JSON body
(protobuf's JSON mapping, field names as in ``rpc.proto``): ``bytes`` fields (keys, values, range ends)
are base64, ``int64`` fields are JSON strings, and a field at its default (0, false, empty, an enum's
first value) is left out of an answer altogether: a range that finds nothing has no ``kvs``, a PUT event
has no ``type``, a keepalive for a lease that is gone has no ``TTL``. Streaming RPCs (keepalive, watch)
answer one ``{"result": ...}`` object per line. An error is ``{"error", "message", "code"}`` on a
non-200 status (etcd 3.4), or ``{"error": {"grpc_code", "message", ...}}`` inside a stream (3.5).

Everything here is pure: requests in, answers out, so the decoding is tested without a server.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vllm_disagg import jsonutil
from vllm_disagg.errors import DisaggError

GRPC_NOT_FOUND = 5  # gRPC's status code for "no such lease"


class EtcdError(DisaggError):
    """etcd answered with an error (its message; ``code`` is the gRPC status code, 0 when none)."""

    def __init__(self, message: str, *, code: int = 0, endpoint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.endpoint = endpoint


class EtcdUnavailable(EtcdError):
    """No endpoint answered: refused, reset or timed out; the message names the endpoints and causes."""


class WatchCanceled(EtcdError):
    """etcd canceled a watch: its start revision was compacted away (``compact_revision`` > 0, the oldest
    revision still kept), or for the ``cancel_reason`` it gave. Re-read, then watch from the read's
    revision + 1."""

    def __init__(self, message: str, *, compact_revision: int = 0, endpoint: str = "") -> None:
        super().__init__(message, endpoint=endpoint)
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd keeps it: revisions of its creation and last change, its version, its lease."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change a watch saw; for a delete, ``kv`` has the key and ``mod_revision`` only (value ``b""``)."""

    kind: Literal["put", "delete"]
    kv: KeyValue


def key_bytes(key: str) -> bytes:
    """A key as etcd stores it: UTF-8 (a key that was not UTF-8 comes back through surrogate escapes)."""
    return key.encode("utf-8", "surrogateescape")


def b64(data: bytes) -> str:
    """Bytes as a JSON ``bytes`` field."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: Any) -> bytes:
    """A JSON ``bytes`` field; malformed base64 is an error of etcd's answer."""
    if not isinstance(text, str):
        raise EtcdError(f"etcd answered a non-string bytes field: {text!r}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EtcdError(f"etcd answered malformed base64: {text[:40]!r}") from exc


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``: the prefix with its
    last byte below 0xff incremented (bytes after it dropped); ``b"\\0"`` (to the end) if there is none."""
    for i in range(len(prefix) - 1, -1, -1):
        if prefix[i] < 0xFF:
            return prefix[:i] + bytes([prefix[i] + 1])
    return b"\0"


def key_range(key: str, *, prefix: bool) -> dict[str, str]:
    """``key`` (and ``range_end`` for a prefix) of a range, delete or watch request."""
    raw = key_bytes(key)
    fields = {"key": b64(raw)}
    if prefix:
        fields["range_end"] = b64(prefix_end(raw))
    return fields


def number(message: Mapping[str, Any], field: str) -> int:
    """An int64 field (a JSON string, absent when 0)."""
    value = message.get(field, 0)
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise EtcdError(f"etcd answered a non-integer {field}: {value!r}") from exc


def revision(answer: Mapping[str, Any]) -> int:
    """The store revision an answer's header reports."""
    return number(answer.get("header") or {}, "revision")


def objects(message: Mapping[str, Any], field: str) -> list[Mapping[str, Any]]:
    """A repeated message field (absent when empty); anything but a list of objects is an EtcdError."""
    items = message.get(field) or []
    if not isinstance(items, list) or not all(isinstance(item, Mapping) for item in items):
        raise EtcdError(f"etcd answered a malformed {field}: {str(items)[:80]}")
    return items


def key_value(message: Mapping[str, Any]) -> KeyValue:
    """A ``mvccpb.KeyValue``."""
    if not isinstance(message, Mapping):
        raise EtcdError(f"etcd answered a malformed key-value: {str(message)[:80]}")
    return KeyValue(
        key=unb64(message.get("key", "")).decode("utf-8", "surrogateescape"),
        value=unb64(message.get("value", "")),
        create_revision=number(message, "create_revision"),
        mod_revision=number(message, "mod_revision"),
        version=number(message, "version"),
        lease=number(message, "lease"),
    )


def key_values(answer: Mapping[str, Any]) -> list[KeyValue]:
    """The ``kvs`` of a range answer, sorted by key."""
    kvs = [key_value(kv) for kv in objects(answer, "kvs")]
    kvs.sort(key=lambda kv: key_bytes(kv.key))
    return kvs


def watch_event(message: Mapping[str, Any]) -> WatchEvent:
    """A ``mvccpb.Event``: ``type`` absent means PUT (the enum's first value)."""
    kind: Literal["put", "delete"] = "delete" if message.get("type") == "DELETE" else "put"
    return WatchEvent(kind=kind, kv=key_value(message.get("kv") or {}))


def error_of(answer: Mapping[str, Any]) -> tuple[str, int] | None:
    """(message, gRPC code) of an error answer in either shape, None for an answer that is not one."""
    error = answer.get("error")
    if isinstance(error, Mapping):  # 3.5 streams: {"error": {"grpc_code", "http_code", "message", ...}}
        return str(error.get("message", error)), int(error.get("grpc_code", error.get("code", 0)) or 0)
    if isinstance(error, str) and error:  # 3.4: {"error", "message", "code"}; LeaseGrant's own "error"
        return str(answer.get("message") or error), int(answer.get("code", 0) or 0)
    return None


def parse_answer(status: int, raw: bytes, *, endpoint: str, path: str) -> dict[str, Any]:
    """A unary answer's JSON object; an error answer (or anything not a JSON object) raises EtcdError."""
    try:
        answer = jsonutil.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        text = raw[:200].decode("utf-8", "replace").strip()
        raise EtcdError(f"etcd at {endpoint} answered {path} with HTTP {status}: {text!r}", endpoint=endpoint)
    error = error_of(answer)
    if error is not None:
        message, code = error
        raise EtcdError(f"etcd at {endpoint}: {path}: {message}", code=code, endpoint=endpoint)
    if status != 200:
        raise EtcdError(f"etcd at {endpoint} answered {path} with HTTP {status}", endpoint=endpoint)
    return answer


def stream_result(line: bytes, *, endpoint: str, path: str) -> dict[str, Any]:
    """One message of a streaming answer: the object inside ``{"result": ...}``; an error raises."""
    answer = parse_answer(200, line, endpoint=endpoint, path=path)
    result = answer.get("result")
    if not isinstance(result, dict):
        raise EtcdError(f"etcd at {endpoint}: {path}: a stream message without a result", endpoint=endpoint)
    return result


def watch_events(result: Mapping[str, Any], *, endpoint: str) -> list[WatchEvent]:
    """The events of one watch message (none for its ``created`` message or a progress notice); a
    canceled watch raises WatchCanceled."""
    if result.get("canceled"):
        compacted = number(result, "compact_revision")
        reason = result.get("cancel_reason") or (
            f"revision {compacted} and older were compacted" if compacted else "no reason given"
        )
        raise WatchCanceled(
            f"etcd at {endpoint} canceled the watch: {reason}", compact_revision=compacted, endpoint=endpoint
        )
    if result.get("compact_revision"):  # 3.4 sends it with ``canceled``; be explicit either way
        compacted = number(result, "compact_revision")
        raise WatchCanceled(
            f"etcd at {endpoint}: watch start revision compacted (oldest kept {compacted})",
            compact_revision=compacted,
            endpoint=endpoint,
        )
    return [watch_event(event) for event in objects(result, "events")]


def split_lines(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete non-blank lines of a stream buffer, and the unfinished rest."""
    *lines, rest = buffer.split(b"\n")
    return [line for line in lines if line.strip()], rest
