"""The agent's side of the local link: its engine's connector asks, the pool answers (``local.py``).

``PoolService.handle`` is the whole protocol as a plain function of one request (tested without
sockets): it reads the request into its typed message (``local_messages.py``), answers it, and
writes the answer back as a map. ``serve`` runs it behind a ROUTER socket on the agent's event loop,
which is the pool's one owner, so the pool needs no locks. A malformed request, or one of a later
version of the link, gets ``ok: false`` and a reason; the service stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from vllm_disagg.agent.kv.arena import Geometry, SlotArena
from vllm_disagg.agent.kv.local import make_local_dir
from vllm_disagg.agent.kv.local_messages import (
    BadRequest,
    Commit,
    Committed,
    LocalAnswer,
    Lookup,
    Open,
    Opened,
    Pinned,
    Release,
    Released,
    Reserve,
    Reserved,
    answer_to_wire,
    read_request,
    refusal,
)
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import PrefixPool
from vllm_disagg.errors import UnsupportedVersion

log = logging.getLogger(__name__)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


class PoolService:
    """Answers the connector's requests on the agent's ``PoolNode``."""

    def __init__(self, node: PoolNode) -> None:
        self.node = node
        self._engine_pids: dict[str, int] = {}  # engine name -> the process that opened for it
        # Engines whose worker mapped the arena open now: another's requests would name slots of a
        # mapping it does not have (an arena this pool replaced), so they are refused.
        self._mapped: set[str] = set()
        self._arena: SlotArena | None = None  # what ``_mapped`` is about (kept: an id may be reused)
        # Lifetime prompt blocks the engines asked the pool for, and those it held (memory or disk).
        self.asked = 0
        self.found = 0
        self.offered = 0  # lifetime blocks engines sent to be saved (a prompt's chain once, then new ones)
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # --- the protocol ------------------------------------------------------------------------------
    def handle(self, raw: object) -> dict[str, Any]:
        """One request, as its map came off the socket, answered as a map."""
        try:
            request = read_request(raw)
        except UnsupportedVersion as e:
            return refusal(str(e), e.code)
        except BadRequest as e:
            return refusal(str(e))
        if isinstance(request, Open):
            opened = self._open(request)
            return answer_to_wire(opened) if isinstance(opened, Opened) else opened
        if self.node.pool is None:
            return refusal("the pool is not open (no engine said its geometry)", "not_open")
        if not self._from_mapped(request):
            return refusal(
                "this engine has not mapped the pool open now (it was replaced): it computes", "not_open"
            )
        answer = self.answer(self.node.pool, request)
        self.node.changed()
        return answer_to_wire(answer)

    def answer(self, pool: PrefixPool, request: Lookup | Release | Reserve | Commit) -> LocalAnswer:
        """What the pool says to one request once an engine opened it."""
        match request:
            case Lookup():
                req = "req:" + request.req
                pool.release(req)
                self.node.promote(request.keys)  # what the disk tier holds past the pool's prefix
                pinned = pool.pin(req, request.keys)
                self.asked += len(request.keys)
                self.found += len(pinned.slots)
                return Pinned(list(pinned.slots), list(pinned.ready))
            case Release():
                for req in request.reqs:
                    pool.release("req:" + req)
                return Released()
            case Reserve():
                owner = "save:" + request.owner
                self.offered += len(request.blocks)
                blocks = [(b.key, b.parent, b.tokens) for b in request.blocks]
                extras = {b.key: b.extra for b in request.blocks if b.extra is not None}
                got, orphans = pool.reserve_chain(owner, blocks, extras)
                return Reserved(list(got.items()), orphans)
            case Commit():
                owner = "save:" + request.owner
                done = pool.commit(owner, request.keys)
                pool.release(owner)
                return Committed(len(done))

    def _open(self, request: Open) -> Opened | dict[str, Any]:
        engine, pid = request.engine, request.pid
        other = self._other_geometry(engine, request.geometry)
        if other is not None:
            return refusal(
                f"this host's pool holds KV blocks of {self.node.geometry}, engine {other}'s; "
                f"this engine's are {request.geometry}: it computes its prompts",
                "geometry",
            )
        arena = self.node.open(request.geometry)
        if arena is not self._arena:  # a new arena: no engine has it mapped yet
            self._arena, self._mapped = arena, set()
        self._mapped.add(engine)
        pool = self.node.pool
        assert pool is not None
        if self._engine_pids.get(engine) != pid:
            # A new process for this engine: what the old one pinned or was writing, it never will.
            mine = (f"req:{engine}:", f"save:{engine}:")
            for owner in pool.owners():
                if owner.startswith(mine):
                    pool.release(owner)
            self._engine_pids[engine] = pid
            self.node.changed()
        return Opened(str(arena.path), arena.capacity)

    def _other_geometry(self, engine: str, geometry: Geometry) -> str | None:
        """Another engine, alive, that opened the pool with another KV geometry; None if none did."""
        if self.node.geometry is None or self.node.geometry == geometry:
            return None
        for other in self._mapped - {engine}:
            pid = self._engine_pids.get(other)
            if pid is not None and _alive(pid):
                return other
        return None

    def _from_mapped(self, request: Lookup | Release | Reserve | Commit) -> bool:
        """Does ``request`` come from an engine that mapped the open arena (its names start ENGINE:)?"""
        match request:
            case Lookup():
                name = request.req
            case Reserve() | Commit():
                name = request.owner
            case Release():
                return True  # letting go of pins is always safe
        return any(name.startswith(engine + ":") for engine in self._mapped)

    # --- the socket --------------------------------------------------------------------------------
    async def start(self, endpoint: str, ctx: zmq.asyncio.Context | None = None) -> None:
        if endpoint.startswith("ipc://"):
            make_local_dir(endpoint)
        sock = (ctx or zmq.asyncio.Context.instance()).socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        self._sock = sock
        self._task = asyncio.create_task(self._serve(sock), name="kv-pool-service")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[1]:
                continue  # not a REQ envelope: nothing to answer
            try:
                request = msgpack.unpackb(frames[2], raw=False)
            except (ValueError, msgpack.UnpackException) as e:
                answer = refusal(f"not msgpack: {e}")
            else:
                answer = self.handle(request)
            await sock.send_multipart([frames[0], b"", msgpack.packb(answer, use_bin_type=True)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close()
        self.node.close()
