"""The holder's grants: which blocks one fetch may read, pinned until it has read them.

``kv_grant`` says "the holder of this token (and, with agent keys, of this public key) may fetch
these blocks within ``ttl_s``". A grant pins the leading blocks its pool holds, ready ones only (a
block still being written is not served), under the owner ``xfer:grant:<token>``, so no eviction
frees them before the fetch reads them. One fetch per grant: it ends when its fetch ends (the
receiver's ``Done``, its connection gone, its deadline) or, never used, once its TTL has passed.
A grant in use outlives its TTL on purpose: its pins are what keep the slots from being reused
while zero-copy frames of their bytes are still queued for the receiver. But not for ever: every
grant has a hard deadline, ``MAX_STREAM_S`` after its TTL, by which it ends in use or not, so a
stalled (or hostile) receiver cannot pin a holder's blocks beyond it. A receiver gives up by its
own capped timeout (``MAX_FETCH_TIMEOUT_S``), before that deadline, so no receiver that keeps to the
protocol can still be reading the slots when they are let go.

``refusal`` and ``servable`` are the decisions (pure: a grant, a request, who asks, now); ``Grants``
is the table, which owns the pins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool
from vllm_disagg.protocol.kv_pool import MAX_STREAM_S

OWNER_PREFIX = "xfer:grant:"


@dataclass(slots=True)
class Grant:
    """One fetch's permission: what was named, what is pinned, for whom, until when."""

    token: str = field(repr=False)
    named: frozenset[BlockKey]  # what the orchestrator granted: a fetch may ask for any of these
    pinned: frozenset[BlockKey]  # the leading named keys the pool held: what can be served
    peer_public_key: bytes | None  # z85; with agent keys, only this client may use the token
    expires_at: float  # clock seconds; a grant in use ignores it
    pool: PrefixPool  # the pool the pins are in (a reopened pool holds none of them)
    in_use: bool = False
    ends_by: float = float("inf")  # the hard deadline: ended then, in use or not (``Grants.add``)

    @property
    def owner(self) -> str:
        return OWNER_PREFIX + self.token


def refusal(
    grant: Grant | None, keys: Sequence[BlockKey], client_key: bytes | None, now: float, curve: bool
) -> str | None:
    """Why a fetch of ``keys`` with this grant is not served, or None if it is.

    ``client_key`` is the z85 CURVE public key of the connection asking (None without agent keys);
    ``curve`` says whether this holder has agent keys, in which case the grant's key must match.
    """
    if grant is None:
        return "unknown token (never granted, already used, or expired)"
    if grant.in_use:
        return "token already in use by another fetch"
    if now >= grant.expires_at:
        return "grant expired"
    if curve:
        if grant.peer_public_key is None:
            return "the grant names no public key, and this holder serves only CurveZMQ clients"
        if client_key != grant.peer_public_key:
            return "the connection's public key is not the one granted"
    if not keys:
        return "no keys requested"
    extra = sum(1 for key in keys if key not in grant.named)
    if extra:
        return f"{extra} of {len(keys)} keys requested were not granted"
    return None


def servable(grant: Grant, keys: Sequence[BlockKey]) -> int:
    """How many of ``keys``, from the first, the grant has pinned (a prefix past a gap is no use)."""
    n = 0
    for key in keys:
        if key not in grant.pinned:
            break
        n += 1
    return n


class Grants:
    """Live grants by token; each holds its pins in ``node``'s pool until ``end``."""

    def __init__(self, node: PoolNode) -> None:
        self._node = node
        self._by_token: dict[str, Grant] = {}

    def __len__(self) -> int:
        return len(self._by_token)

    def get(self, token: str) -> Grant | None:
        return self._by_token.get(token)

    def add(
        self,
        token: str,
        keys: Sequence[BlockKey],
        peer_public_key: bytes | None,
        expires_at: float,
    ) -> Grant | None:
        """Pin the leading ready ``keys`` for ``token`` (replacing its earlier grant); None: no pool."""
        self.end(token)
        pool = self._node.pool
        if pool is None:
            return None
        owner = OWNER_PREFIX + token
        self._node.promote(keys)  # what its disk tier holds is served from memory like the rest
        pinned = pool.pin(owner, keys, pending_ok=False)
        grant = Grant(token, frozenset(keys), frozenset(pinned.keys), peer_public_key, expires_at, pool)
        grant.ends_by = expires_at + MAX_STREAM_S
        self._by_token[token] = grant
        return grant

    def end(self, token: str) -> bool:
        """Drop the grant and its pins; False if there was none."""
        grant = self._by_token.pop(token, None)
        if grant is None:
            return False
        if grant.pool is self._node.pool:
            grant.pool.release(grant.owner)
            self._node.changed()  # unpinned blocks may be evicted from now on
        return True

    def expire(self, now: float) -> list[str]:
        """End the unused grants whose TTL has passed, and those in use past their hard deadline;
        their tokens."""
        gone = [t for t, g in self._by_token.items() if now >= _deadline(g)]
        for token in gone:
            self.end(token)
        return gone

    def next_expiry(self) -> float | None:
        """When the next grant ends unless fetched or done first (None: no grant)."""
        return min((_deadline(g) for g in self._by_token.values()), default=None)

    def admits(self, public_key: bytes, now: float) -> bool:
        """Whether an unexpired grant names this z85 public key (the CurveZMQ handshake's check)."""
        return any(g.peer_public_key == public_key and now < _deadline(g) for g in self._by_token.values())

    def close(self) -> None:
        """End every grant."""
        for token in list(self._by_token):
            self.end(token)


def _deadline(grant: Grant) -> float:
    """When a grant ends if nothing ends it first: its TTL unused, its hard deadline in use."""
    return grant.ends_by if grant.in_use else grant.expires_at
