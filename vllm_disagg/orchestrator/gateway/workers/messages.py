"""What the orchestrator and its gateway workers say to each other (pickled; see the package doc).

Pickles, not the protocol's codec: the link never leaves the host (an ``ipc://`` socket in a 0700
directory; a worker refuses any other), both ends are processes of one orchestrator started from
one installation, and the messages are the registry's own views and the KV index, which would each
need a schema of their own. docs/protocol.md lists it with the links that do leave the host.
"""

from __future__ import annotations

import copyreg
import pickle
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.control.kv_moves import MoveResult
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.link_table import LinkTable
from vllm_disagg.orchestrator.state.registry import InstanceView
from vllm_disagg.protocol.messages import InstanceInfo, KvEvent


# Snapshots, views and explanations hold read-only mappings: they travel as their contents.
def _read_only(contents: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(contents)


copyreg.pickle(MappingProxyType, lambda m: (_read_only, (dict(m),)))

# ("apply", agent id, events) or ("drop", agent id, ()): the KV index's writes, in order.
KvChange = tuple[str, str, tuple[KvEvent, ...]]


# --- orchestrator -> worker ---
@dataclass(frozen=True, slots=True)
class Setup:
    """The answer to a worker's ``Hello``: how to serve, and where the orchestrator's own listener is."""

    config: OrchestratorConfig
    primary_url: str  # the orchestrator's loopback listener: non-gateway paths are proxied there


@dataclass(frozen=True, slots=True)
class State:
    """The scheduler's state since the last one (``full``: all of it, to a worker that just joined)."""

    full: bool
    seq: int  # the hub's flush count: a worker that sees a gap asks for the whole state (``Resync``)
    views: dict[str, InstanceView]  # changed views (all of them when full), in join order
    removed: tuple[str, ...]
    version: int
    membership: int
    blocked: frozenset[tuple[str, str]]
    audited: frozenset[str]  # decode instances whose legs the KV audit judges
    in_flight: dict[int, dict[str, int]]  # each gateway process's outstanding requests (0: the orchestrator)
    kv: tuple[KvChange, ...] = ()
    kv_index: KvIndex | None = None  # when full
    weights: dict[str, dict[str, float]] | None = None  # the scheduler's weights, when they changed
    tenant_weights: dict[str, float] | None = None  # admission's tenants' weights, when they changed
    links: LinkTable | None = None  # the learned P->D links (``link_rates``), when they changed


@dataclass(frozen=True, slots=True)
class Lost:
    """An instance is lost: fail its legs now (``Gateway.instance_lost``)."""

    agent_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Joined:
    """An instance said Hello (``Gateway.instance_joined``: load its tokenizer before traffic)."""

    info: InstanceInfo


@dataclass(frozen=True, slots=True)
class Ask:
    """A question for every worker: ``metrics`` (its metric families), ``live`` (requests in flight),
    ``record`` (the record of request ``arg``, or None), ``recent`` (its newest ``arg`` records) or
    ``admission`` (its admission queue: ``Admission.snapshot``, None with admission off)."""

    query: int
    what: str
    arg: Any = None


@dataclass(frozen=True, slots=True)
class KvMoved:
    """The outcome of a worker's ``KvMove``."""

    query: int
    result: MoveResult


@dataclass(frozen=True, slots=True)
class Note:
    """The KV audit's finding about a request: for the record of whichever process served it."""

    request_id: str
    note: str


# --- worker -> orchestrator ---
@dataclass(frozen=True, slots=True)
class Hello:
    index: int
    pid: int


@dataclass(frozen=True, slots=True)
class Resync:
    """The worker missed a ``State``: it wants the whole state again."""

    index: int


@dataclass(frozen=True, slots=True)
class Serving:
    """The worker listens on the shared port."""

    index: int


@dataclass(frozen=True, slots=True)
class Counts:
    """The worker's outstanding requests per instance, and how many it sent since the last ``Counts``."""

    index: int
    in_flight: dict[str, int]
    sent: dict[str, int]


@dataclass(frozen=True, slots=True)
class Call:
    """A registry call that changes state (a breaker, the KV audit, a probe), made in the orchestrator."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KvMove:
    """Move KV blocks between agents' pools (``kv_moves``) with the orchestrator's control plane; sent at
    once, not with the next push (a decode leg waits for it), and answered by a ``KvMoved``."""

    query: int
    holder: str
    receiver: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Batch:
    """What a worker has to say since its last push, in order (calls, events, then its counts)."""

    messages: tuple[object, ...]


@dataclass(frozen=True, slots=True)
class Answer:
    query: int
    index: int
    payload: Any


def dump(message: object) -> bytes:
    """One frame."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def load(frame: bytes) -> object:
    """A frame from the other side of the link (a 0700 ipc socket: only our own user's processes)."""
    return pickle.loads(frame)
