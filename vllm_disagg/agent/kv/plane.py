"""What the agent's session asks of its KV data plane (``transfer.py`` implements it).

The orchestrator moves a prefix from one agent's pool to another's in two commands, in this order:

1. ``kv_grant`` to the holder: "the agent with this public key may fetch these blocks with this token,
   for ``ttl_s``". The holder serves only granted keys to the holder of the token (and, where agent keys
   are configured, only over a CurveZMQ connection from that public key).
2. ``kv_fetch`` to the receiver: "fetch these blocks from the holder at this endpoint, whose public key
   is this, presenting this token". The receiver reserves pool slots for the blocks it lacks (pending,
   so its engine can already pin them and wait per layer) and answers once the transfer has *started*;
   the bytes land layer by layer after that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class FetchStarted:
    """A fetch under way: how many blocks it will land, and a future of how many it did."""

    requested: int
    already_held: int  # leading blocks the receiver's pool had already: not fetched again
    reserved: int  # blocks it is fetching (pending in the pool until they land)
    done: asyncio.Future[int]  # blocks landed; fewer than ``reserved`` when the transfer failed


class KvPlane(Protocol):
    """The agent's pool and its agent-to-agent link, as the session's commands use them."""

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` where this agent serves granted blocks to other agents."""
        ...

    def grant(self, token: str, keys: Sequence[bytes], peer_public_key: bytes | None, ttl_s: float) -> int:
        """Let the holder of ``token`` fetch ``keys`` (pinned until fetched or ``ttl_s``); how many held."""
        ...

    async def fetch(
        self,
        endpoint: str,
        peer_public_key: bytes | None,
        token: str,
        keys: Sequence[bytes],
        timeout_s: float,
    ) -> FetchStarted:
        """Start fetching ``keys`` from another agent's pool into this one."""
        ...
