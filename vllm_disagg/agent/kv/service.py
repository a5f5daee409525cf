"""The agent's side of the local link: its engine's connector asks, the pool answers (``local.py``).

``PoolService.handle`` is the whole protocol as a plain function of one request (tested without
sockets); ``serve`` runs it behind a ROUTER socket on the agent's event loop, which is the pool's one
owner, so the pool needs no locks. A malformed request gets ``ok: false`` and a reason; the service
stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from vllm_disagg.agent.kv.arena import Geometry
from vllm_disagg.agent.kv.local import make_local_dir
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    pass


def _keys(raw: object) -> list[BlockKey]:
    if not isinstance(raw, list) or not all(isinstance(k, bytes) for k in raw):
        raise BadRequest("keys must be a list of byte strings")
    return list(raw)


def _str(raw: object, what: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise BadRequest(f"{what} must be a non-empty string")
    return raw


class PoolService:
    """Answers the connector's ops on the agent's ``PoolNode``."""

    def __init__(self, node: PoolNode) -> None:
        self.node = node
        self._engine_pids: dict[str, int] = {}  # engine name -> the process that opened for it
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # --- the protocol ------------------------------------------------------------------------------
    def handle(self, request: object) -> dict[str, Any]:
        if not isinstance(request, dict):
            return {"ok": False, "error": "a request is a map with an op"}
        op = request.get("op")
        try:
            if op == "open":
                return self._open(request)
            pool = self.node.pool
            if pool is None:
                return {"ok": False, "error": "the pool is not open (no engine said its geometry)"}
            if op == "lookup":
                req = "req:" + _str(request.get("req"), "req")
                pool.release(req)
                pinned = pool.pin(req, _keys(request.get("keys")))
                answer = {"ok": True, "slots": list(pinned.slots), "ready": list(pinned.ready)}
            elif op == "release":
                reqs = request.get("reqs")
                if not isinstance(reqs, list):
                    raise BadRequest("reqs must be a list")
                for req in reqs:
                    pool.release("req:" + _str(req, "req"))
                answer = {"ok": True}
            elif op == "reserve":
                owner = "save:" + _str(request.get("owner"), "owner")
                blocks = request.get("blocks")
                if not isinstance(blocks, list):
                    raise BadRequest("blocks must be a list of [key, parent, token_ids]")
                parsed = [_block(b) for b in blocks]
                got = pool.reserve(owner, parsed)
                answer = {"ok": True, "slots": [[k, s] for k, s in got.items()]}
            elif op == "commit":
                owner = "save:" + _str(request.get("owner"), "owner")
                done = pool.commit(owner, _keys(request.get("keys")))
                pool.release(owner)
                answer = {"ok": True, "committed": len(done)}
            else:
                return {"ok": False, "error": f"unknown op {op!r}"}
        except BadRequest as e:
            return {"ok": False, "error": str(e)}
        self.node.changed()
        return answer

    def _open(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            geometry = Geometry.from_wire(request.get("geometry"))
        except ValueError as e:
            raise BadRequest(str(e)) from None
        engine = _str(request.get("engine"), "engine")
        pid = request.get("pid")
        if not isinstance(pid, int):
            raise BadRequest("pid must be an integer")
        arena = self.node.open(geometry)
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
        return {"ok": True, "path": str(arena.path), "capacity": arena.capacity}

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
                answer: dict[str, Any] = {"ok": False, "error": f"not msgpack: {e}"}
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


def _block(raw: object) -> tuple[BlockKey, BlockKey | None, list[int]]:
    if not isinstance(raw, list | tuple) or len(raw) != 3:
        raise BadRequest("a block is [key, parent, token_ids]")
    key, parent, tokens = raw
    if not isinstance(key, bytes) or not (parent is None or isinstance(parent, bytes)):
        raise BadRequest("a block's key and parent are byte strings (parent may be nil)")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise BadRequest("a block's token_ids are a list of integers")
    return key, parent, tokens
