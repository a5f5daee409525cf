"""What each command asks and what its Ack answers, typed (protocol 1.5), and the string maps that
peers of 1.0 to 1.4 speak instead.

Up to 1.4 a ``Command`` carried ``args``, a map of strings (block keys as comma-joined hex, numbers
as decimal text), and an ``Ack`` its counts in ``detail``, the same way. From 1.5 a command carries
one of the payloads below (``Command.payload``) and its Ack one of the results (``Ack.result``): a
frozen dataclass per kind, written as the map of its fields plus its ``kind`` (the codec's tagged
unions). Each side still speaks the string maps to a peer of 1.4 or older (``to_args`` /
``from_args``, ``to_detail`` / ``from_detail``), so agents and the orchestrator upgrade one at a
time, in either order.

``check`` holds the rules a payload's values must follow, whichever way it came: the agent answers
one that breaks a rule with ``ok: false`` and the reason (a frame the codec refuses gets no Ack at
all, so the types stay loose where a reason is worth more: ``SetRole.role`` is a string).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from vllm_disagg.protocol.kv_pool import ENDPOINT, MAX_COMMAND_KEYS, MAX_KEY_BYTES, Z85_KEY, split_keys

CommandKind = Literal["drain", "undrain", "shutdown", "set_role", "kv_grant", "kv_fetch"]
COMMAND_KINDS: tuple[CommandKind, ...] = ("drain", "undrain", "shutdown", "set_role", "kv_grant", "kv_fetch")
POOL_MINOR = 3  # the protocol minor of the KV pool commands and ``Ack.detail``
TYPED_MINOR = 5  # the protocol minor that reads ``Command.payload`` and ``Ack.result``


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop giving this instance new requests; its heartbeats say ``draining`` until ``Undrain``."""

    KIND: ClassVar[CommandKind] = "drain"


@dataclass(frozen=True, slots=True)
class Undrain:
    """Give this instance requests again."""

    KIND: ClassVar[CommandKind] = "undrain"


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Ack, stop the engine, say Goodbye and exit 0."""

    KIND: ClassVar[CommandKind] = "shutdown"


@dataclass(frozen=True, slots=True)
class SetRole:
    """Serve as ``role`` from now on; ``restart``: restart the engine for it (asked after an Ack said
    ``restart_required`` and the instance was drained)."""

    KIND: ClassVar[CommandKind] = "set_role"
    role: str  # not a literal: a role the agent does not know is answered with a reason
    restart: bool = False


@dataclass(frozen=True, slots=True)
class KvGrant:
    """To the holder: the agent whose public key is ``peer_key`` may fetch ``keys`` with ``token``
    for ``ttl_s`` seconds."""

    KIND: ClassVar[CommandKind] = "kv_grant"
    # Random per move: whoever holds it may fetch these blocks, so it never reaches a log (not in repr).
    token: str = field(repr=False)
    keys: list[bytes]  # vLLM block hashes (wire/block_hash.py), first block first
    peer_key: str  # the receiver agent's CurveZMQ public key (z85); "" without agent keys
    ttl_s: float


@dataclass(frozen=True, slots=True)
class KvFetch:
    """To the receiver: fetch ``keys`` with ``token`` from the holder's pool at ``endpoint``."""

    KIND: ClassVar[CommandKind] = "kv_fetch"
    token: str = field(repr=False)
    keys: list[bytes]
    endpoint: str  # the holder's ``InstanceInfo.kv_pool_endpoint``
    peer_key: str  # the holder agent's CurveZMQ public key (z85); "" without agent keys
    timeout_s: float  # the transfer must start by then (the Ack comes when it has)


@dataclass(frozen=True, slots=True)
class GrantResult:
    """A ``kv_grant``'s Ack: of ``requested`` blocks, the leading ``held`` are pinned for the fetch."""

    KIND: ClassVar[CommandKind] = "kv_grant"
    requested: int
    held: int


@dataclass(frozen=True, slots=True)
class FetchResult:
    """A ``kv_fetch``'s Ack, once the transfer started: of ``requested`` blocks the pool held the
    leading ``already_held``, and ``reserved`` are landing."""

    KIND: ClassVar[CommandKind] = "kv_fetch"
    requested: int
    already_held: int
    reserved: int


CommandPayload = Drain | Undrain | Shutdown | SetRole | KvGrant | KvFetch
AckResult = GrantResult | FetchResult
PAYLOAD_TYPES: tuple[type[CommandPayload], ...] = (Drain, Undrain, Shutdown, SetRole, KvGrant, KvFetch)
RESULT_TYPES: tuple[type[AckResult], ...] = (GrantResult, FetchResult)
# The kinds without values, by name (the admin API and rollouts name them so).
SIMPLE: Mapping[str, CommandPayload] = {"drain": Drain(), "undrain": Undrain(), "shutdown": Shutdown()}


def peer_public_key(peer_key: str) -> bytes | None:
    """A payload's ``peer_key`` as the transports take it (None: no agent keys)."""
    return peer_key.encode("ascii") if peer_key else None


def z85(key: bytes | None) -> str:
    """A public key as a payload carries it ("" for none)."""
    return key.decode("ascii") if key else ""


# --- the rules ------------------------------------------------------------------------------------


def check(payload: CommandPayload) -> None:
    """``ValueError`` naming the first value that breaks a rule of its kind."""
    match payload:
        case KvGrant():
            _check_keys(payload.keys)
            _check_token(payload.token)
            _check_peer_key(payload.peer_key)
            _check_seconds("ttl_s", payload.ttl_s)
        case KvFetch():
            if not ENDPOINT.fullmatch(payload.endpoint):
                raise ValueError(
                    f"'endpoint' must be a ZeroMQ endpoint (tcp://host:port), got {payload.endpoint[:80]!r}"
                )
            _check_token(payload.token)
            _check_keys(payload.keys)
            _check_peer_key(payload.peer_key)
            _check_seconds("timeout_s", payload.timeout_s)
        case _:
            pass  # a role is checked by the agent, against the roles it knows


def _check_keys(keys: Sequence[bytes]) -> None:
    if not keys:
        raise ValueError("'keys' names no block")
    if len(keys) > MAX_COMMAND_KEYS:
        raise ValueError(f"'keys' names {len(keys)} blocks, more than {MAX_COMMAND_KEYS}")
    for i, key in enumerate(keys):
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"'keys'[{i}] is not a block key of 1 to {MAX_KEY_BYTES} bytes")


def _check_token(token: str) -> None:
    if not token:
        raise ValueError("'token' must not be empty")


def _check_peer_key(peer_key: str) -> None:
    if peer_key and not Z85_KEY.fullmatch(peer_key):
        raise ValueError("'peer_key' must be a CurveZMQ public key (40 z85 characters) or empty")


def _check_seconds(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"'{name}' must be > 0 seconds, got {value!r}")


# --- the string maps of 1.0 to 1.4 ----------------------------------------------------------------


def to_args(payload: CommandPayload) -> dict[str, str]:
    """A payload as the ``args`` of a peer before 1.5."""
    match payload:
        case SetRole():
            return {"role": payload.role, **({"restart": "yes"} if payload.restart else {})}
        case KvGrant():
            return {
                "token": payload.token,
                "keys": _join(payload.keys),
                "peer_key": payload.peer_key,
                "ttl_s": repr(payload.ttl_s),
            }
        case KvFetch():
            return {
                "token": payload.token,
                "keys": _join(payload.keys),
                "endpoint": payload.endpoint,
                "peer_key": payload.peer_key,
                "timeout_s": repr(payload.timeout_s),
            }
        case _:
            return {}


def from_args(kind: CommandKind, args: Mapping[str, str]) -> CommandPayload:
    """The payload a peer before 1.5 meant with ``args``; ``ValueError`` for text that is no value
    (the rules are ``check``'s). Args a kind does not use are ignored, as they always were."""
    match kind:
        case "set_role":
            return SetRole(args.get("role", ""), args.get("restart") == "yes")
        case "kv_grant":
            return KvGrant(
                args.get("token", ""),
                split_keys(args.get("keys", "")),
                args.get("peer_key", ""),
                _seconds(args, "ttl_s"),
            )
        case "kv_fetch":
            return KvFetch(
                args.get("token", ""),
                split_keys(args.get("keys", "")),
                args.get("endpoint", ""),
                args.get("peer_key", ""),
                _seconds(args, "timeout_s"),
            )
        case _:
            return SIMPLE[kind]


def to_detail(result: AckResult) -> dict[str, str]:
    """A result as the ``detail`` of an orchestrator of 1.3 or 1.4 (decimal strings)."""
    match result:
        case GrantResult():
            return {"requested": str(result.requested), "held": str(result.held)}
        case FetchResult():
            return {
                "requested": str(result.requested),
                "already_held": str(result.already_held),
                "reserved": str(result.reserved),
            }


def from_detail(kind: CommandKind, detail: Mapping[str, str]) -> AckResult | None:
    """The result an agent of 1.3 or 1.4 meant with ``detail``; None where it says none whole."""
    try:
        if kind == "kv_grant":
            return GrantResult(int(detail["requested"]), int(detail["held"]))
        if kind == "kv_fetch":
            return FetchResult(int(detail["requested"]), int(detail["already_held"]), int(detail["reserved"]))
    except (KeyError, ValueError):
        return None
    return None


def _join(keys: Sequence[bytes]) -> str:
    return ",".join(k.hex() for k in keys)


def _seconds(args: Mapping[str, str], name: str) -> float:
    text = args.get(name, "")
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"'{name}' must be a number of seconds, got {text[:40]!r}") from None
