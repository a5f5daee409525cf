"""``vllm-disagg bench kv``: the agents' KV data plane, two agents in two processes on loopback.

**Transfer.** A holder agent (a child process: its own ``PoolNode`` and ``KvTransfer``) stores
``--blocks`` blocks of a realistic geometry (``--layers`` x ``--layer-block-kib``) filled with random
bytes; this process is the receiving agent. Each round the holder grants the blocks and the
receiver fetches them all into its emptied pool: ``agent_gbps`` is KV bytes landed and committed
per second, from the fetch call to its ``done``. The honest bound, ``loopback_gbps``, moves the same
bytes between the same two arenas over a plain loopback TCP socket (``sendall`` of each block's
memoryview, ``recv_into`` each destination slot): two kernel copies and nothing else. Rounds of the
two alternate, and the table has medians. Every landed block is compared with what the holder wrote.

**Churn** (``--churn-s S``): the same two agents, and the receiver's disk tier, under random
fetches, saves, pins and promotions (``kv_churn.py``).

Real vLLM's TTFT with and without the pool is ``kv_ttft.py``, a handoff between two engines
``kv_handoff.py``; ``kv_main.py`` runs the parts asked for and prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.agent.kv.arena import Capacity, Geometry, SlotArena
from vllm_disagg.agent.kv.node import DiskConfig, PoolNode
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool
from vllm_disagg.agent.kv.transfer import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW, KvTransfer
from vllm_disagg.protocol.curve import Keypair, load_keypair, make_keypair
from vllm_disagg.runtime import asyncio_run

_FETCH_TIMEOUT_S = 60.0
_GRANT_TTL_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The transfer part's flags (and those every part shares)."""
    parser.add_argument("--layers", type=int, default=32, help="layers of the model's KV cache")
    parser.add_argument("--layer-block-kib", type=int, default=64, help="KiB of one layer's block")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per fetch")
    parser.add_argument("--rounds", type=int, default=3, help="fetches (and loopback copies) timed")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="chunks in flight")
    parser.add_argument("--chunk-kib", type=int, default=DEFAULT_CHUNK_BYTES >> 10, help="chunk size")
    parser.add_argument("--curve", action="store_true", help="CurveZMQ between the agents")
    parser.add_argument("--seed", type=int, default=0)


# --- blocks both sides can check -------------------------------------------------------------------
class Blocks:
    """The bytes of a block, a pure function of its key: seeded noise with the key at every layer."""

    def __init__(self, geometry: Geometry, seed: int) -> None:
        self.geometry = geometry
        self._noise = random.Random(seed).randbytes(geometry.block_bytes)

    def write(self, arena: SlotArena, slot: int, key: BlockKey) -> None:
        arena.block_view(slot)[:] = self._noise
        for layer in range(self.geometry.num_layers):
            arena.layer_view(slot, layer)[: len(key)] = key

    def expected(self, key: BlockKey) -> bytes:
        out = bytearray(self._noise)
        for layer in range(self.geometry.num_layers):
            at = layer * self.geometry.layer_block_bytes
            out[at : at + len(key)] = key
        return bytes(out)

    def check(self, arena: SlotArena, slot: int, key: BlockKey) -> bool:
        return arena.block_view(slot) == self.expected(key)


def chain(name: str, n: int, parent: BlockKey | None = None) -> list[BlockKey]:
    """``n`` chained keys (each names its prefix, as vLLM's block hashes do)."""
    keys: list[BlockKey] = []
    for i in range(n):
        parent = hashlib.sha256((parent or b"") + f"{name}/{i}".encode()).digest()
        keys.append(parent)
    return keys


def store(pool: PrefixPool, arena: SlotArena, blocks: Blocks, owner: str, keys: Sequence[BlockKey]) -> int:
    """What an engine's save does: reserve, write, commit, release; blocks written."""
    got = pool.reserve(owner, [(k, keys[i - 1] if i else None, ()) for i, k in enumerate(keys)])
    for key, slot in got.items():
        blocks.write(arena, slot, key)
        arena.set_layers_ready(slot, blocks.geometry.num_layers)
    pool.commit(owner, got)
    pool.release(owner)
    return len(got)


# --- the holder, in its own process ----------------------------------------------------------------
def peer_main() -> None:
    """The holder agent: a config line on stdin, then one command per line, one JSON reply each."""
    asyncio_run(_peer())


async def _peer() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    config = jsonutil.loads(await reader.readline())
    geometry = Geometry.from_wire(config["geometry"])
    node = PoolNode("vllm-disagg-bench-holder", Capacity(config["capacity"], "blocks"))
    arena = node.open(geometry)
    pool = node.pool
    assert pool is not None
    keys = load_keypair(config["key_file"]) if config["key_file"] else None
    transfer = KvTransfer(node, keys=keys, window=config["window"], chunk_bytes=config["chunk_bytes"])
    await transfer.start()
    blocks = Blocks(geometry, config["seed"])
    _reply({"endpoint": transfer.endpoint})
    saves = 0
    try:
        while line := await reader.readline():
            command = jsonutil.loads(line)
            wanted = [bytes.fromhex(k) for k in command.get("keys", ())]
            if command["op"] == "grant":
                # What the holder lacks, its engine computes first (a prefill), its request holding
                # the prefix it found, as a request does while its blocks are saved.
                saves += 1
                pool.pin(f"req:{saves}", wanted)
                store(pool, arena, blocks, f"save:{saves}", wanted)
                peer = command["peer"].encode() if command["peer"] else None
                held = transfer.grant(command["token"], wanted, peer, _GRANT_TTL_S)
                pool.release(f"req:{saves}")
                node.changed()
                _reply({"held": held, "used": pool.stats().used})
            elif command["op"] == "loopback":
                views = [arena.block_view(pool.slot_of(k) or 0) for k in wanted]
                await asyncio.to_thread(_send_blocks, command["port"], views)
                _reply({"sent": len(views)})
            else:
                break
    finally:
        await transfer.close()
        node.close()


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(jsonutil.dumps(obj) + b"\n")
    sys.stdout.buffer.flush()


def _send_blocks(port: int, views: list[memoryview]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for view in views:
            sock.sendall(view)


class Peer:
    """The holder's process, as this one drives it: one command at a time."""

    def __init__(self, proc: asyncio.subprocess.Process, endpoint: str) -> None:
        self._proc = proc
        self.endpoint = endpoint
        self._lock = asyncio.Lock()

    @classmethod
    async def spawn(cls, config: dict[str, Any]) -> Peer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from vllm_disagg.bench.kv import peer_main; peer_main()",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(jsonutil.dumps(config) + b"\n")
        line = await proc.stdout.readline()
        if not line:
            await proc.wait()
            raise RuntimeError(f"the holder process exited ({proc.returncode}) before serving")
        return cls(proc, jsonutil.loads(line)["endpoint"])

    async def call(self, **command: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        async with self._lock:
            self._proc.stdin.write(jsonutil.dumps(command) + b"\n")
            line = await self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the holder process exited")
        reply: dict[str, Any] = jsonutil.loads(line)
        return reply

    async def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), 10)
        except TimeoutError:
            self._proc.kill()
            await self._proc.wait()


@dataclass
class Side:
    """This process's agent, and how the holder reaches and trusts it."""

    node: PoolNode
    transfer: KvTransfer
    peer: Peer
    blocks: Blocks
    my_key: str  # z85 public key the holder grants to ("" without --curve)
    peer_key: bytes | None

    @property
    def pool(self) -> PrefixPool:
        assert self.node.pool is not None
        return self.node.pool

    @property
    def arena(self) -> SlotArena:
        assert self.node.arena is not None
        return self.node.arena

    async def grant(self, token: str, keys: Sequence[BlockKey]) -> int:
        """Have the holder store what it lacks of ``keys`` and grant them to us; its pool's ``used``."""
        reply = await self.peer.call(op="grant", token=token, keys=[k.hex() for k in keys], peer=self.my_key)
        used: int = reply["used"]
        return used

    async def fetch(self, token: str, keys: Sequence[BlockKey]) -> tuple[int, int]:
        """Fetch granted ``keys``; (blocks landed, failures: a broken transfer, blocks whose bytes
        differ from the holder's)."""
        started = await self.transfer.fetch(self.peer.endpoint, self.peer_key, token, keys, _FETCH_TIMEOUT_S)
        landed = await started.done
        ended = next((e for e in reversed(self.transfer.ended) if e.token == token), None)
        bad = int(ended is not None and ended.failed)
        for key in keys[started.already_held :]:
            slot = self.pool.slot_of(key)
            if slot is not None and self.pool.state_of(key) == "ready":
                bad += not self.blocks.check(self.arena, slot, key)
        return landed, bad


async def open_side(
    args: argparse.Namespace, capacity: int, keydir: Path | None, disk: DiskConfig | None = None
) -> Side:
    geometry = Geometry(args.layers, args.layer_block_kib << 10, args.block_size)
    keys: Keypair | None = None
    config: dict[str, Any] = {
        "geometry": geometry.to_wire(),
        "capacity": capacity,
        "window": args.window,
        "chunk_bytes": args.chunk_kib << 10,
        "seed": args.seed,
        "key_file": "",
    }
    if keydir is not None:
        for name in ("holder", "receiver"):
            if not (keydir / f"{name}.key_secret").exists():
                make_keypair(keydir, name)
        keys = load_keypair(str(keydir / "receiver.key_secret"))
        config["key_file"] = str(keydir / "holder.key_secret")
    node = PoolNode("vllm-disagg-bench-receiver", Capacity(capacity, "blocks"), disk=disk)
    arena = node.open(geometry)
    zeros = bytes(geometry.block_bytes)
    for slot in range(arena.capacity):  # every page touched now, so RSS measures the rest
        arena.block_view(slot)[:] = zeros
    transfer = KvTransfer(node, keys=keys, window=args.window, chunk_bytes=args.chunk_kib << 10)
    await transfer.start()
    peer = await Peer.spawn(config)
    holder_key = load_keypair(config["key_file"]).public if keydir is not None else None
    my_key = keys.public.decode() if keys is not None else ""
    return Side(node, transfer, peer, Blocks(geometry, args.seed), my_key, holder_key)


async def close_side(side: Side) -> None:
    await side.peer.close()
    await side.transfer.close()
    side.node.close()


# --- transfer: agent vs loopback -------------------------------------------------------------------
@dataclass
class TransferResult:
    agent_gbps: float  # medians of the rounds
    loopback_gbps: float
    ratio: float  # median of the rounds' agent / loopback
    blocks: int
    block_bytes: int
    agent_rounds: list[float] = field(default_factory=list)
    loopback_rounds: list[float] = field(default_factory=list)
    errors: int = 0  # rounds that landed fewer blocks than asked, or other bytes than sent


async def transfer_part(args: argparse.Namespace, keydir: Path | None) -> TransferResult:
    side = await open_side(args, args.blocks, keydir)
    keys = chain("bench", args.blocks)
    total = args.blocks * side.blocks.geometry.block_bytes
    agent, loop_, errors = [], [], 0
    try:
        for r in range(args.rounds):
            side.pool.clear()
            side.node.changed()
            await side.grant(f"r{r}", keys)
            t0 = time.perf_counter()
            started = await side.transfer.fetch(
                side.peer.endpoint, side.peer_key, f"r{r}", keys, _FETCH_TIMEOUT_S
            )
            landed = await started.done
            agent.append(landed * side.blocks.geometry.block_bytes / (time.perf_counter() - t0) / 1e9)
            slots = [side.pool.slot_of(k) for k in keys]
            errors += landed != args.blocks or not all(
                s is not None and side.blocks.check(side.arena, s, k)
                for s, k in zip(slots, keys, strict=True)
            )
            loop_.append(total / await _loopback(side, keys, [s or 0 for s in slots]) / 1e9)
    finally:
        await close_side(side)
    # Each round's two copies ran back to back, so their ratio is the least disturbed by whatever
    # else the machine did meanwhile: the ratio reported is the median of the rounds' ratios.
    ratio = statistics.median(x / y for x, y in zip(agent, loop_, strict=True))
    return TransferResult(
        round(statistics.median(agent), 3),
        round(statistics.median(loop_), 3),
        round(ratio, 3),
        args.blocks,
        side.blocks.geometry.block_bytes,
        [round(x, 3) for x in agent],
        [round(x, 3) for x in loop_],
        errors,
    )


async def _loopback(side: Side, keys: list[BlockKey], slots: list[int]) -> float:
    """Seconds to copy the holder's blocks into these slots over a plain loopback TCP socket."""
    views = [side.arena.block_view(s) for s in slots]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        t0 = time.perf_counter()
        await asyncio.gather(
            side.peer.call(op="loopback", port=port, keys=[k.hex() for k in keys]),
            asyncio.to_thread(_recv_blocks, listener, views),
        )
        return time.perf_counter() - t0


def _recv_blocks(listener: socket.socket, views: list[memoryview]) -> None:
    conn, _ = listener.accept()
    with conn:
        for view in views:
            got = 0
            while got < len(view):
                n = conn.recv_into(view[got:])
                if not n:
                    raise ConnectionError("the holder closed the loopback socket early")
                got += n
