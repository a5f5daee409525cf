"""This replica's end of the replicas' link (``protocol/replicas.py``): load sharing and KV moves.

One ROUTER that the other replicas connect to, one DEALER to each of them (``connect_to``, fed from
etcd's member list), a reader task per socket and one pusher. The pusher sends this replica's
in-flight counts to every peer at most ``LOAD_PUSH_S`` after they change (and every
``LOAD_KEEPALIVE_S`` regardless); what peers say is summed into the registry
(``set_remote_in_flight(..., "peers")``), so every replica's scheduler balances on the whole cluster's
requests. A follower's KV moves go to the leader as ``PeerKvMove`` and come back as ``PeerKvMoved``.

The reader never dies on bad input: a frame that does not decode, or of another link version or
cluster, is answered with a ``PeerRefuse`` and counted; nothing a peer sends reaches the registry
unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from vllm_disagg.clock import Clock, wait_event
from vllm_disagg.errors import CodecError
from vllm_disagg.orchestrator.control.kv_moves import KvMover, MoveResult, failed
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.curve import (
    AgentAuthenticator,
    ClientCurve,
    ServerCurve,
    setup_client,
    setup_server,
)
from vllm_disagg.protocol.replicas import (
    LOAD_KEEPALIVE_S,
    LOAD_PUSH_S,
    LOAD_STALE_S,
    PEER_CODEC,
    REPLICA_LINK_VERSION,
    PeerKvMove,
    PeerKvMoved,
    PeerLoad,
    PeerMessage,
    PeerRefuse,
)
from vllm_disagg.protocol.transport import send_now

log = logging.getLogger(__name__)
_PEER_USER = "replica"  # what the authenticator calls a peer holding the cluster's key
_MAX_FRAME_BYTES = 4 << 20  # a load map of many thousand instances still fits


@dataclass(slots=True)
class _Heard:
    seq: int
    in_flight: dict[str, int]
    at: float  # monotonic


class PeerLink:
    """The replicas' link, from this replica: what it tells its peers and what it hears from them."""

    def __init__(
        self,
        cluster: str,
        replica_id: str,
        bind_endpoint: str,
        registry: Registry,
        clock: Clock,
        *,
        curve: ServerCurve | None = None,
        kv_mover: KvMover | None = None,
    ) -> None:
        self.cluster = cluster
        self.replica_id = replica_id
        self._registry = registry
        self._clock = clock
        self._curve = curve
        self._kv_mover = kv_mover  # the leader's: it carries out the moves followers ask for
        self._ctx = zmq.asyncio.Context()
        self._auth: AgentAuthenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        if curve is not None:
            # Only a peer holding the cluster's own key pair is admitted.
            self._auth = AgentAuthenticator(self._ctx, {curve.keys.public: _PEER_USER}, lambda: None)
            self._auth.start()
            setup_server(self._router, curve)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
        self._router.bind(bind_endpoint)
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, tuple[str, zmq.asyncio.Socket, asyncio.Task[None]]] = {}
        self._heard: dict[str, _Heard] = {}
        self._seq = 0
        self._changed = asyncio.Event()
        self._unwatch: Callable[[], None] | None = None
        self._ids = itertools.count(1)
        self._asked: dict[int, asyncio.Future[PeerKvMoved]] = {}
        self._moves: set[asyncio.Task[None]] = set()
        self.refused = 0  # frames refused (bad, another version or cluster): a metric and tests read it

    def connect_to(self, endpoints: Mapping[str, str]) -> None:
        """The peers to talk to now (replica id -> its link's endpoint; this replica's own is skipped):
        connect to new ones, drop those gone or moved."""
        wanted = {rid: ep for rid, ep in endpoints.items() if rid != self.replica_id and ep}
        for rid in [rid for rid, (ep, _, _) in self._dealers.items() if wanted.get(rid) != ep]:
            self._drop(rid)
        for rid, endpoint in wanted.items():
            if rid not in self._dealers:
                sock = self._ctx.socket(zmq.DEALER)
                if self._curve is not None:
                    keys = self._curve.keys
                    setup_client(sock, ClientCurve(keys=keys, server_public=keys.public))
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a peer that is not there
                sock.setsockopt(zmq.SNDHWM, 100)
                sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
                sock.setsockopt(zmq.RECONNECT_IVL, 100)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                sock.connect(endpoint)
                task = asyncio.get_running_loop().create_task(self._read_dealer(rid, sock))
                self._dealers[rid] = (endpoint, sock, task)
                log.info("replica link: connected to %s at %s", rid, endpoint)
        self._forget_unheard()
        self._changed.set()  # a new peer hears our counts at once

    def _drop(self, replica_id: str) -> None:
        _, sock, task = self._dealers.pop(replica_id)
        task.cancel()
        sock.close(linger=0)
        self._heard.pop(replica_id, None)
        log.info("replica link: %s left", replica_id)

    @property
    def peers(self) -> list[str]:
        """The replicas this one is connected to."""
        return sorted(self._dealers)

    def heard(self) -> dict[str, dict[str, int]]:
        """What each peer last said it has in flight (peers heard within ``LOAD_STALE_S``)."""
        now = self._clock.monotonic()
        return {rid: dict(h.in_flight) for rid, h in self._heard.items() if now - h.at <= LOAD_STALE_S}

    async def run(self) -> None:
        """Read the ROUTER, push this replica's load, and drop silent peers' counts, until cancelled."""
        self._unwatch = self._registry.watch(self._changed.set, in_flight=True)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._read_router(), name="replica-link-reader")
            tg.create_task(self._push(), name="replica-link-pusher")

    async def _push(self) -> None:
        while True:
            await wait_event(self._clock, self._changed, LOAD_KEEPALIVE_S)
            self._changed.clear()
            self._forget_unheard()
            counts = self._registry.local_in_flight()
            self._seq += 1
            frame = PEER_CODEC.encode(
                PeerLoad(REPLICA_LINK_VERSION, self.cluster, self.replica_id, self._seq, counts)
            )
            for _, sock, _ in self._dealers.values():
                with contextlib.suppress(zmq.ZMQError):  # a peer not connected now hears the next one
                    send_now(sock, [frame])
            # Coalesce: a burst of requests becomes one frame per LOAD_PUSH_S, not one per request.
            await self._clock.sleep(LOAD_PUSH_S)

    def _forget_unheard(self) -> None:
        now = self._clock.monotonic()
        silent = [
            rid for rid, h in self._heard.items() if now - h.at > LOAD_STALE_S or rid not in self._dealers
        ]
        for rid in silent:
            del self._heard[rid]
        self._registry.set_remote_in_flight(self._peer_total(), "peers")

    def _peer_total(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for heard in self._heard.values():
            for agent_id, n in heard.in_flight.items():
                total[agent_id] = total.get(agent_id, 0) + n
        return total

    async def _read_router(self) -> None:
        while True:
            parts = await self._router.recv_multipart(copy=False)
            if len(parts) != 2:
                self._refuse(parts[0].bytes, "malformed_frame", "a frame must be one part")
                continue
            try:
                message: PeerMessage = PEER_CODEC.decode(parts[1].buffer, max_bytes=_MAX_FRAME_BYTES)
            except CodecError as exc:
                self._refuse(parts[0].bytes, exc.code, str(exc))
                continue
            self._on_message(parts[0].bytes, message)

    def _on_message(self, peer: bytes, message: PeerMessage) -> None:
        match message:
            case PeerLoad() if message.version != REPLICA_LINK_VERSION or message.cluster != self.cluster:
                why = f"link v{message.version} of cluster {message.cluster!r}"
                self._refuse(
                    peer,
                    "mismatch",
                    f"{why}: this replica speaks v{REPLICA_LINK_VERSION} of {self.cluster!r}",
                )
            case PeerLoad():
                heard = self._heard.get(message.replica_id)
                # An older frame is ignored; seq 1 is a peer that restarted under the same id.
                stale = heard is not None and message.seq <= heard.seq and message.seq != 1
                if message.replica_id == self.replica_id or stale:
                    return
                if message.replica_id not in self._dealers:
                    return  # not a member (left, or not yet seen in etcd): its counts would never expire
                self._heard[message.replica_id] = _Heard(
                    message.seq, message.in_flight, self._clock.monotonic()
                )
                self._registry.set_remote_in_flight(self._peer_total(), "peers")
            case PeerKvMove():
                task = asyncio.get_running_loop().create_task(self._move(peer, message))
                self._moves.add(task)
                task.add_done_callback(self._moves.discard)
            case _:
                self._refuse(peer, "unexpected", f"a replica does not take {message.TAG} here")

    async def _move(self, peer: bytes, ask: PeerKvMove) -> None:
        if self._kv_mover is None or ask.version != REPLICA_LINK_VERSION:
            result = failed("unavailable", "this replica moves no KV for others")
        else:
            result = await self._kv_mover.move(ask.holder, ask.receiver, ask.keys)
        answer = PeerKvMoved(
            ask.id, result.ok, result.reason, result.error, result.requested, result.held,
            result.already_held, result.reserved,
        )  # fmt: skip
        with contextlib.suppress(zmq.ZMQError):
            send_now(self._router, [peer, PEER_CODEC.encode(answer)])

    def _refuse(self, peer: bytes, code: str, reason: str) -> None:
        self.refused += 1
        log.warning("replica link: refused a frame (%s): %s", code, reason)
        with contextlib.suppress(zmq.ZMQError):
            send_now(self._router, [peer, PEER_CODEC.encode(PeerRefuse(code, reason[:500]))])

    async def _read_dealer(self, replica_id: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv(copy=False)
            try:
                message = PEER_CODEC.decode(frame.buffer, max_bytes=_MAX_FRAME_BYTES)
            except CodecError as exc:
                log.warning("replica link: a bad frame from %s: %s", replica_id, exc)
                continue
            if isinstance(message, PeerKvMoved):
                future = self._asked.pop(message.id, None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, PeerRefuse):
                log.warning(
                    "replica link: %s refused a frame (%s): %s", replica_id, message.code, message.reason
                )

    async def ask_move(
        self, leader: str, holder: str, receiver: str, keys: Sequence[str], timeout_s: float
    ) -> MoveResult:
        """Ask replica ``leader`` to move KV for this one; never raises."""
        entry = self._dealers.get(leader)
        if entry is None:
            return failed("unavailable", f"no link to the leader {leader!r}", len(keys))
        ask_id = next(self._ids)
        future: asyncio.Future[PeerKvMoved] = asyncio.get_running_loop().create_future()
        self._asked[ask_id] = future
        try:
            send_now(
                entry[1],
                [PEER_CODEC.encode(PeerKvMove(REPLICA_LINK_VERSION, ask_id, holder, receiver, list(keys)))],
            )
            async with asyncio.timeout(timeout_s):
                moved = await future
        except (zmq.ZMQError, TimeoutError) as exc:
            return failed(
                "unavailable", f"the leader {leader!r} did not answer: {type(exc).__name__}", len(keys)
            )
        finally:
            self._asked.pop(ask_id, None)
        return MoveResult(
            moved.ok,
            moved.reason,
            moved.error,
            moved.requested,
            moved.held,
            moved.already_held,
            moved.reserved,
        )

    async def close(self) -> None:
        """Stop reading and pushing, close every socket."""
        if self._unwatch is not None:
            self._unwatch()
        for task in list(self._moves):
            task.cancel()
        for rid in list(self._dealers):
            self._drop(rid)
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
