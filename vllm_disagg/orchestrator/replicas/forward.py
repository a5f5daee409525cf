"""An operator's write sent to a follower is done by the leader: the follower hands it on, unchanged.

The admin API wraps every write (and the reads of what only the leader holds: the planner, rollouts)
with ``LeaderForwarder``: on the leader, or on a single orchestrator, it does nothing and the handler
runs; on a follower it sends the same method, path, query, body and bearer token to the leader's admin
URL (from the leader's card in etcd) and answers with the leader's answer, marked with the
``X-Vllm-Disagg-Leader`` header. The token is checked here first, so a caller without it is refused
by the replica it reached and nothing is forwarded. One hop only: a forwarded request that reaches a
replica that does not lead (the leader changed meanwhile) is a 503 with the reason, for the caller to
try again, never a loop.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from vllm_disagg.errors import NotLeader
from vllm_disagg.orchestrator.replicas.replica import Replication

FORWARDED_BY = "X-Vllm-Disagg-Forwarded-By"  # set on a forwarded request: the replica that forwarded it
LEADER = "X-Vllm-Disagg-Leader"  # set on a forwarded answer: the replica that gave it
_PASSED = ("Authorization", "Content-Type", "Accept", "Last-Event-ID")
_CONNECT_S = 5.0  # a leader that does not accept a connection this soon is not there
# No total: a role change that restarts an engine is answered when the engine is ready, minutes later.
_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=_CONNECT_S, sock_connect=_CONNECT_S)


class LeaderForwarder:
    """Hands a request to the leader when this replica does not lead."""

    def __init__(self, replication: Replication) -> None:
        self._replication = replication
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, request: web.Request) -> web.StreamResponse | None:
        """The leader's answer to ``request``; None when this replica leads (the caller handles it)."""
        replication = self._replication
        if replication.leadership.is_leader:
            return None
        what = f"{request.method} {request.path}"
        why = replication.leadership.view.paused
        if FORWARDED_BY in request.headers:
            raise NotLeader(
                f"{what} was forwarded here by {request.headers[FORWARDED_BY]!r}, but this replica "
                f"({replication.replica_id}) no longer leads{f' ({why})' if why else ''}; try again"
            )
        card = replication.leader_card()
        if card is None or not card.admin:
            raise NotLeader(f"{what}: no replica leads now ({why or 'an election is under way'}); try again")
        headers = {name: request.headers[name] for name in _PASSED if name in request.headers}
        headers[FORWARDED_BY] = replication.replica_id
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        url = card.admin.rstrip("/") + request.path_qs
        try:
            async with self._session.request(
                request.method, url, data=await request.read(), headers=headers
            ) as answer:
                body = await answer.read()
                kept = {
                    k: v for k, v in answer.headers.items() if k in ("Content-Type", "Allow", "Retry-After")
                }
                return web.Response(
                    status=answer.status, body=body, headers={**kept, LEADER: card.replica_id}
                )
        except (aiohttp.ClientError, OSError) as exc:
            # A leader that died holds its lease until it expires; the caller tries again after that.
            raise NotLeader(
                f"{what}: the leader {card.replica_id!r} at {card.admin} did not answer ({exc}); "
                "another replica leads once its lease expires: try again"
            ) from None

    async def close(self) -> None:
        """Close the connections to the leader."""
        if self._session is not None:
            await self._session.close()
            self._session = None
