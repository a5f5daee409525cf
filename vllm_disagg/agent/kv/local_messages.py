"""The local link's messages, typed and versioned: what an engine's connector asks its agent's pool
(``local.py`` sends, ``service.py`` answers) and what it answers.

On the wire a request is a msgpack map ``{"op": OP, "v": LOCAL_VERSION, field: value, ...}`` and an
answer ``{"ok": true, field: value, ...}`` or ``{"ok": false, "error": reason[, "code": code]}``:
the maps of the connectors and agents before versions existed, plus ``v``, which they ignore (they
read fields by name). A request without ``v`` is of version 1, which is that layout.

**Versions.** The connector runs inside vLLM, loaded from whatever vllm-disagg the engine's
environment has, and the agent from its own, so the two can differ after an upgrade (an agent
restarted with an engine it attached to, say). The agent answers a request in the request's version,
so an answer needs no version of its own; one of a later version than it reads is refused,
``{"ok": false, "code": "unsupported_version"}`` with a reason that names both. A later version keeps
version 1's fields as they are and adds new ones (which version 1 readers ignore) or new ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from vllm_disagg.agent.kv.arena import Geometry
from vllm_disagg.errors import UnsupportedVersion
from vllm_disagg.wire.block_hash import Extra, read_extra

LOCAL_VERSION = 1  # the newest version of the local link this side reads and speaks
_MAX_VERSION = 1 << 16


class BadRequest(ValueError):
    """A request the agent cannot read; the answer says why."""


# --- connector -> agent ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Open:
    """The worker's KV geometry; the answer names the arena to map. A new ``pid`` for an ``engine``
    is a restart: the references its old process held go."""

    OP: ClassVar[str] = "open"
    geometry: Geometry
    engine: str  # engines sharing a node's pool name their requests and saves ``ENGINE:...``
    pid: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """Pin the leading held ``keys`` for request ``req`` (again: replaces its pins)."""

    OP: ClassVar[str] = "lookup"
    req: str
    keys: list[bytes]


@dataclass(frozen=True, slots=True)
class Release:
    """These requests loaded or finished: their pins go."""

    OP: ClassVar[str] = "release"
    reqs: list[str]


@dataclass(frozen=True, slots=True)
class SaveBlock:
    """A prompt block to save: its key, its parent's (None for the first), its token ids, and the extra
    keys vLLM hashed into its key (a LoRA adapter's, multimodal inputs', a cache salt's; added within
    version 1: a block without them has none)."""

    key: bytes
    parent: bytes | None
    tokens: list[int]
    extra: Extra | None = None


@dataclass(frozen=True, slots=True)
class Reserve:
    """Slots for ``owner`` to save these blocks into (the pool skips, and keeps, those it holds)."""

    OP: ClassVar[str] = "reserve"
    owner: str
    blocks: list[SaveBlock]


@dataclass(frozen=True, slots=True)
class Commit:
    """``owner`` wrote these blocks: they are ready, and its other reservations go."""

    OP: ClassVar[str] = "commit"
    owner: str
    keys: list[bytes]


LocalRequest = Open | Lookup | Release | Reserve | Commit
REQUEST_TYPES: tuple[type[LocalRequest], ...] = (Open, Lookup, Release, Reserve, Commit)


# --- agent -> connector ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Opened:
    """``Open``'s answer: the arena's shared-memory file and its slots."""

    path: str
    capacity: int


@dataclass(frozen=True, slots=True)
class Pinned:
    """``Lookup``'s answer: the slots of the leading held keys; ``ready`` is False while landing."""

    slots: list[int]
    ready: list[bool]


@dataclass(frozen=True, slots=True)
class Released:
    """``Release``'s answer."""


@dataclass(frozen=True, slots=True)
class Reserved:
    """``Reserve``'s answer: the slot of each block to write, by key; and the blocks not reserved
    because the pool no longer holds their parent (``PrefixPool.reserve_chain``), which the engine
    sends again with their whole chain. (Added after version 1's layout: an answer without it has
    none.)"""

    slots: list[tuple[bytes, int]]
    orphans: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Committed:
    """``Commit``'s answer: how many blocks became ready."""

    committed: int


LocalAnswer = Opened | Pinned | Released | Reserved | Committed
A = TypeVar("A", Opened, Pinned, Released, Reserved, Committed)


# --- the wire -------------------------------------------------------------------------------------
def request_to_wire(request: LocalRequest) -> dict[str, Any]:
    """A request as the map the agent reads."""
    out: dict[str, Any] = {"op": request.OP, "v": LOCAL_VERSION}
    for f in fields(request):
        out[f.name] = _to_wire(getattr(request, f.name))
    return out


def answer_to_wire(answer: LocalAnswer) -> dict[str, Any]:
    """An answer as the map the connector reads."""
    out: dict[str, Any] = {"ok": True}
    for f in fields(answer):
        out[f.name] = _to_wire(getattr(answer, f.name))
    return out


def refusal(error: str, code: str = "") -> dict[str, Any]:
    """A refused request's answer (``code`` only where the connector may act on it)."""
    return {"ok": False, "error": error, **({"code": code} if code else {})}


def _to_wire(value: Any) -> Any:
    if isinstance(value, Geometry):
        return value.to_wire()
    if isinstance(value, SaveBlock):
        plain = [value.key, value.parent, value.tokens]
        return plain if value.extra is None else [*plain, value.extra]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def read_request(raw: object) -> LocalRequest:
    """The request a map holds; ``BadRequest`` saying what is wrong with it, ``UnsupportedVersion``
    for a version this agent cannot read."""
    if not isinstance(raw, dict):
        raise BadRequest("a request is a map with an op")
    version = raw.get("v", 1)
    if type(version) is not int or not 1 <= version <= _MAX_VERSION:
        raise BadRequest("v must be an integer >= 1")
    if version > LOCAL_VERSION:
        raise UnsupportedVersion(
            f"local link v{version}: this agent reads v1 to v{LOCAL_VERSION} (the engine's vllm-disagg "
            "is newer than its agent's: upgrade the agent)"
        )
    op = raw.get("op")
    reader = _READERS.get(op) if isinstance(op, str) else None
    if reader is None:
        raise BadRequest(f"unknown op {op!r}")
    return reader(raw)


def _open(raw: dict[str, Any]) -> Open:
    try:
        geometry = Geometry.from_wire(raw.get("geometry"))
    except ValueError as e:
        raise BadRequest(str(e)) from None
    engine, pid = _str(raw.get("engine"), "engine"), raw.get("pid")
    if type(pid) is not int:
        raise BadRequest("pid must be an integer")
    return Open(geometry, engine, pid)


def _release(raw: dict[str, Any]) -> Release:
    reqs = raw.get("reqs")
    if not isinstance(reqs, list):
        raise BadRequest("reqs must be a list")
    return Release([_str(req, "req") for req in reqs])


def _reserve(raw: dict[str, Any]) -> Reserve:
    owner, blocks = _str(raw.get("owner"), "owner"), raw.get("blocks")
    if not isinstance(blocks, list):
        raise BadRequest("blocks must be a list of [key, parent, token_ids]")
    return Reserve(owner, [_block(b) for b in blocks])


_READERS: dict[str, Callable[[dict[str, Any]], LocalRequest]] = {
    "open": _open,
    "lookup": lambda raw: Lookup(_str(raw.get("req"), "req"), _keys(raw.get("keys"))),
    "release": _release,
    "reserve": _reserve,
    "commit": lambda raw: Commit(_str(raw.get("owner"), "owner"), _keys(raw.get("keys"))),
}


def _keys(raw: object) -> list[bytes]:
    if not isinstance(raw, list) or not all(isinstance(k, bytes) for k in raw):
        raise BadRequest("keys must be a list of byte strings")
    return raw


def _str(raw: object, what: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise BadRequest(f"{what} must be a non-empty string")
    return raw


def _block(raw: object) -> SaveBlock:
    if not isinstance(raw, list | tuple) or len(raw) not in (3, 4):
        raise BadRequest("a block is [key, parent, token_ids] or [key, parent, token_ids, extra_keys]")
    key, parent, tokens = raw[:3]
    try:
        extra = read_extra(raw[3]) if len(raw) == 4 else None
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if not isinstance(key, bytes) or not (parent is None or isinstance(parent, bytes)):
        raise BadRequest("a block's key and parent are byte strings (parent may be nil)")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise BadRequest("a block's token_ids are a list of integers")
    return SaveBlock(key, parent, tokens, extra)


def read_answer(raw: dict[str, Any], kind: type[A]) -> A:
    """An ``ok`` answer as the ``kind`` its request expects; ``ValueError`` for anything else."""
    answer = _ANSWER_READERS[kind](raw)
    assert isinstance(answer, kind)
    return answer


def _opened(raw: dict[str, Any]) -> Opened:
    path, capacity = raw.get("path"), raw.get("capacity")
    if not isinstance(path, str) or type(capacity) is not int:
        raise ValueError("open: expected a path and a capacity")
    return Opened(path, capacity)


def _pinned(raw: dict[str, Any]) -> Pinned:
    slots, ready = raw.get("slots"), raw.get("ready")
    if not isinstance(slots, list) or not isinstance(ready, list) or len(slots) != len(ready):
        raise ValueError("lookup: expected as many slots as ready flags")
    if not all(type(s) is int for s in slots) or not all(type(r) is bool for r in ready):
        raise ValueError("lookup: expected integer slots and boolean ready flags")
    return Pinned(slots, ready)


def _reserved(raw: dict[str, Any]) -> Reserved:
    pairs = raw.get("slots")
    if not isinstance(pairs, list):
        raise ValueError("reserve: expected [key, slot] pairs")
    out = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError("reserve: expected [key, slot] pairs")
        key, slot = pair
        if not isinstance(key, bytes) or type(slot) is not int:
            raise ValueError("reserve: expected [key, slot] pairs")
        out.append((key, slot))
    orphans = raw.get("orphans", [])
    if not isinstance(orphans, list) or not all(isinstance(k, bytes) for k in orphans):
        raise ValueError("reserve: expected orphans as a list of keys")
    return Reserved(out, orphans)


def _committed(raw: dict[str, Any]) -> Committed:
    committed = raw.get("committed")
    if type(committed) is not int:
        raise ValueError("commit: expected a count")
    return Committed(committed)


_ANSWER_READERS: dict[type[LocalAnswer], Callable[[dict[str, Any]], LocalAnswer]] = {
    Opened: _opened,
    Pinned: _pinned,
    Released: lambda raw: Released(),
    Reserved: _reserved,
    Committed: _committed,
}
