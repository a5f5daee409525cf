"""The replicas' link: what orchestrator replicas tell each other directly (docs/protocol.md#links).

Each replica binds one ROUTER (``--peer-port``) and connects one DEALER to every other member of its
cluster, as etcd lists them. A frame is ``msgpack([tag, {fields}])`` through the project's codec: typed,
checked field by field, never pickle. Where agents have CurveZMQ keys the link has them too: every
replica holds the cluster's orchestrator key pair, and a replica admits only peers that prove they hold
it. Each message says the link's ``version``; a peer of another major version is refused
(``PeerRefuse``), and fields a later minor appends are ignored, as on the agents' link.

- ``PeerLoad``: a replica's requests in flight per instance, sent to every peer when they change (at
  most every ``LOAD_PUSH_S``) and at least every ``LOAD_KEEPALIVE_S``; a peer unheard for
  ``LOAD_STALE_S`` counts for nothing (its requests died with it).
- ``PeerKvMove`` / ``PeerKvMoved``: a follower asks the leader to move KV between two agents' pools
  (only the leader commands agents), and hears how it went.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from vllm_disagg.protocol.codec import Codec

REPLICA_LINK_VERSION = 1  # the major version: peers must agree on it
LOAD_PUSH_S = 0.05  # a change in a replica's in-flight counts reaches its peers this soon, plus transit
LOAD_KEEPALIVE_S = 1.0  # and unchanged counts are said again this often
LOAD_STALE_S = 3.0  # a peer unheard for this long is taken to be gone


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """Replica -> every peer: its requests in flight per instance (its gateway workers' included)."""

    TAG: ClassVar[str] = "peer_load"
    version: int
    cluster: str
    replica_id: str
    seq: int  # grows for the sender process's life: a late, older frame is ignored
    in_flight: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PeerKvMove:
    """Follower -> leader: grant ``keys`` on ``holder``'s agent and fetch them to ``receiver``'s."""

    TAG: ClassVar[str] = "peer_kv_move"
    version: int
    id: int  # the asker's, echoed in the answer
    holder: str
    receiver: str
    keys: list[str] = field(default_factory=list)  # lowercase hex, first block first


@dataclass(frozen=True, slots=True)
class PeerKvMoved:
    """Leader -> the follower that asked: the move's outcome (``control/kv_moves.MoveResult``)."""

    TAG: ClassVar[str] = "peer_kv_moved"
    id: int
    ok: bool
    reason: str = ""
    error: str = ""
    requested: int = 0
    held: int = 0
    already_held: int = 0
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class PeerRefuse:
    """Either side: a frame it will not take, and why (``code``: machine-readable)."""

    TAG: ClassVar[str] = "peer_refuse"
    code: str
    reason: str


PeerMessage = PeerLoad | PeerKvMove | PeerKvMoved | PeerRefuse
PEER_MESSAGE_TYPES: tuple[type[PeerMessage], ...] = (PeerLoad, PeerKvMove, PeerKvMoved, PeerRefuse)
PEER_CODEC = Codec(PEER_MESSAGE_TYPES)
