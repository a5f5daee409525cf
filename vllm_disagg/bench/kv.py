"""``vllm-disagg bench kv``: the agents' KV data plane, two agents in two processes on loopback.

**Transfer.** A holder agent (a child process: its own ``PoolNode`` and ``KvTransfer``) stores
``--blocks`` blocks of a realistic geometry (``--layers`` x ``--layer-block-kib``) filled with random
bytes; this process is the receiving agent. Each round the holder grants the blocks and the
receiver fetches them all into its emptied pool: ``agent_gbps`` is KV bytes landed and committed
per second, from the fetch call to its ``done``. The honest bound, ``loopback_gbps``, moves the same
bytes between the same two arenas over a plain loopback TCP socket (``sendall`` of each block's
memoryview, ``recv_into`` each destination slot): two kernel copies and nothing else. Rounds of the
two alternate, and the table has medians. Every landed block is compared with what the holder wrote.

**Churn** (``--churn-s S``). Both agents get ``--churn-capacity`` slots, fewer than the blocks of the
``--churn-prompts`` prompts (which share prefixes). For S seconds, ``--churn-workers`` tasks pick
random prompts and fetch them from the holder (which stores what it lacks, evicting, and grants),
store them locally (reserve, write, commit, release), or pin them for a while as a running request
would. Every second this process's RSS, its arena file's size and its pool's ``used`` are sampled.
The run fails (exit 1) if a pool ever held more than its capacity, a landed block differed from the
holder's, a fetch left a reference behind, or the RSS grew by more than ``--churn-rss-bound-mib``
from the end of the first minute (the first third of a shorter run) to the end.

A ``ttft`` part (a real vLLM's TTFT with and without the pool) belongs here too, as another part
of ``run``; it is not written yet.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.agent.kv.arena import Capacity, Geometry, SlotArena
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import BlockKey, PrefixPool
from vllm_disagg.agent.kv.transfer import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW, KvTransfer
from vllm_disagg.bench.kv_handoff import add_arguments as add_handoff_arguments
from vllm_disagg.bench.kv_handoff import handoff_part, print_handoff
from vllm_disagg.bench.kv_ttft import add_arguments as add_ttft_arguments
from vllm_disagg.bench.kv_ttft import ttft_part
from vllm_disagg.protocol.curve import Keypair, load_keypair, make_keypair
from vllm_disagg.runtime import asyncio_run

_FETCH_TIMEOUT_S = 60.0
_GRANT_TTL_S = 60.0
_PIN_HELD = 8  # requests a churn worker keeps pinned at once


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench kv``."""
    parser.add_argument("--layers", type=int, default=32, help="layers of the model's KV cache")
    parser.add_argument("--layer-block-kib", type=int, default=64, help="KiB of one layer's block")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per fetch")
    parser.add_argument("--rounds", type=int, default=3, help="fetches (and loopback copies) timed")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="chunks in flight")
    parser.add_argument("--chunk-kib", type=int, default=DEFAULT_CHUNK_BYTES >> 10, help="chunk size")
    parser.add_argument("--curve", action="store_true", help="CurveZMQ between the agents")
    parser.add_argument("--churn-s", type=float, default=0.0, help="seconds of churn (0: none)")
    parser.add_argument("--churn-capacity", type=int, default=64, help="blocks each pool holds")
    parser.add_argument("--churn-prompts", type=int, default=64, help="prompts in the working set")
    parser.add_argument("--churn-prompt-blocks", type=int, default=8, help="most blocks of a prompt")
    parser.add_argument("--churn-workers", type=int, default=4, help="concurrent churn tasks")
    parser.add_argument("--churn-rss-bound-mib", type=float, default=32.0, help="RSS growth allowed")
    parser.add_argument("--seed", type=int, default=0)
    add_ttft_arguments(parser)
    add_handoff_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


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

    def check(self, arena: SlotArena, slot: int, key: BlockKey) -> bool:
        expected = bytearray(self._noise)
        for layer in range(self.geometry.num_layers):
            at = layer * self.geometry.layer_block_bytes
            expected[at : at + len(key)] = key
        return arena.block_view(slot) == expected


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


async def _side(args: argparse.Namespace, capacity: int, keydir: Path | None) -> Side:
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
    node = PoolNode("vllm-disagg-bench-receiver", Capacity(capacity, "blocks"))
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


async def _close(side: Side) -> None:
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
    side = await _side(args, args.blocks, keydir)
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
        await _close(side)
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


# --- churn -----------------------------------------------------------------------------------------
@dataclass
class ChurnResult:
    churn_s: float
    churn_ops: int
    churn_fetches: int
    churn_landed: int
    churn_errors: int  # broken transfers, landed bytes that differ, references left behind
    churn_capacity: int
    churn_max_used: int
    churn_holder_max_used: int
    churn_arena_bytes: int
    churn_rss_first_mib: float
    churn_rss_end_mib: float
    churn_rss_growth_mib: float
    churn_rss_bound_mib: float
    churn_ok: bool


def prompts(n: int, most_blocks: int, rng: random.Random) -> list[list[BlockKey]]:
    """``n`` prompts; a third of them extend an earlier prompt's prefix (a shared document)."""
    out: list[list[BlockKey]] = []
    for i in range(n):
        if out and rng.random() < 1 / 3:
            base = rng.choice(out)
            keep = rng.randint(1, len(base))
            out.append(base[:keep] + chain(f"p{i}", rng.randint(0, most_blocks - keep), base[keep - 1]))
        else:
            out.append(chain(f"p{i}", rng.randint(1, most_blocks)))
    return out


def rss_bytes() -> int:
    """This process's VmRSS."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


@dataclass
class _ChurnTally:
    """What the churn's workers and sampler count, shared between them."""

    ops: int = 0
    fetches: int = 0
    landed: int = 0
    errors: int = 0
    max_used: int = 0
    holder_max_used: int = 0
    arena_bytes: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, RSS)

    def saw_used(self, side: Side) -> None:
        """Keep the most slots the receiving pool has held."""
        self.max_used = max(self.max_used, side.pool.stats().used)


async def churn_part(args: argparse.Namespace, keydir: Path | None) -> ChurnResult:
    """Fetch, store and pin random prompts for ``--churn-s`` seconds; check bounds, bytes and RSS."""
    side = await _side(args, args.churn_capacity, keydir)
    rng = random.Random(args.seed)
    work = prompts(args.churn_prompts, args.churn_prompt_blocks, rng)
    tally = _ChurnTally()
    t0 = time.monotonic()
    end = t0 + args.churn_s
    try:
        await asyncio.gather(
            _churn_sampler(side, tally, t0, end),
            *(_churn_worker(side, tally, w, work, rng, end) for w in range(args.churn_workers)),
        )
        tally.samples.append((time.monotonic() - t0, rss_bytes()))
        stats = side.pool.stats()
        tally.errors += stats.referenced + stats.pending  # every fetch and pin is over: none held
    finally:
        await _close(side)
    return _churn_result(args, tally)


async def _churn_worker(
    side: Side, tally: _ChurnTally, w: int, work: list[list[BlockKey]], rng: random.Random, end: float
) -> None:
    """One task of the churn: a random operation on a random prompt until ``end``, then unpin."""
    pins: deque[str] = deque()
    n = 0
    while time.monotonic() < end:
        n += 1
        prompt, op = rng.choice(work), rng.random()
        if op < 0.5:
            await _churn_fetch(side, tally, f"w{w}-{n}", prompt)
        elif op < 0.7:
            store(side.pool, side.arena, side.blocks, f"save:w{w}-{n}", prompt)
            side.node.changed()
        else:
            owner = f"req:w{w}-{n}"
            side.pool.pin(owner, prompt)
            pins.append(owner)
            if len(pins) > _PIN_HELD or op > 0.9:
                side.pool.release(pins.popleft())
                side.node.changed()
        tally.ops += 1
        tally.saw_used(side)
        await asyncio.sleep(0)  # let the other workers and the transfers in
    while pins:
        side.pool.release(pins.popleft())


async def _churn_fetch(side: Side, tally: _ChurnTally, token: str, prompt: list[BlockKey]) -> None:
    """Have the holder grant a prompt's blocks, fetch them, and count what landed and what broke."""
    holder_used = await side.grant(token, prompt)
    tally.holder_max_used = max(tally.holder_max_used, holder_used)
    landed, bad = await side.fetch(token, prompt)
    tally.fetches += 1
    tally.landed += landed
    tally.errors += bad


async def _churn_sampler(side: Side, tally: _ChurnTally, t0: float, end: float) -> None:
    """Every second until ``end``: this process's RSS, the arena file's size and the pool's use."""
    while time.monotonic() < end:
        tally.samples.append((time.monotonic() - t0, rss_bytes()))
        tally.arena_bytes = max(tally.arena_bytes, os.stat(side.arena.path).st_size)
        tally.saw_used(side)
        await asyncio.sleep(1.0)


def _churn_result(args: argparse.Namespace, tally: _ChurnTally) -> ChurnResult:
    """The tally as a result: RSS growth from the end of the warm-up, and whether every bound held."""
    warm = min(60.0, args.churn_s / 3)
    first = [rss for at, rss in tally.samples if at <= warm][-1]
    last = tally.samples[-1][1]
    growth = (last - first) / 2**20
    ok = (
        tally.max_used <= args.churn_capacity
        and tally.holder_max_used <= args.churn_capacity
        and tally.errors == 0
        and growth <= args.churn_rss_bound_mib
    )
    return ChurnResult(
        args.churn_s,
        tally.ops,
        tally.fetches,
        tally.landed,
        tally.errors,
        args.churn_capacity,
        tally.max_used,
        tally.holder_max_used,
        tally.arena_bytes,
        round(first / 2**20, 1),
        round(last / 2**20, 1),
        round(growth, 1),
        args.churn_rss_bound_mib,
        ok,
    )


# --- the command -----------------------------------------------------------------------------------
async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Each part's keys in one object (a part not asked for is absent)."""
    with tempfile.TemporaryDirectory(prefix="vllm-disagg-bench-kv-") as tmp:
        keydir = Path(tmp) if args.curve else None
        result: dict[str, Any] = dict(vars(await transfer_part(args, keydir)))
        if args.churn_s > 0:
            result.update(vars(await churn_part(args, keydir)))
    if args.ttft_rounds > 0:
        result.update(asdict(await ttft_part(args)))
    if args.handoff_rounds > 0:
        result.update(asdict(await handoff_part(args)))
    return result


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON); 1 if a transfer went wrong or the churn broke a bound."""
    result = asyncio_run(run_bench(args))
    failed = result["errors"] > 0 or not result.get("churn_ok", True)
    if args.json:
        print(jsonutil.dumps(result).decode())
        return int(failed)
    mib = result["block_bytes"] / 2**20
    print(
        f"{result['blocks']} blocks of {mib:g} MiB ({args.layers} layers x {args.layer_block_kib} KiB), "
        f"{args.rounds} rounds; window {args.window} x {args.chunk_kib} KiB chunks"
        + (", CurveZMQ" if args.curve else "")
    )
    print("| path | GB/s (median) | rounds |")
    print("|---|---:|---|")
    print(f"| agents (KvTransfer, ZeroMQ) | {result['agent_gbps']} | {result['agent_rounds']} |")
    print(f"| loopback TCP (sendall / recv_into) | {result['loopback_gbps']} | {result['loopback_rounds']} |")
    errors = f" ({result['errors']} ROUNDS WENT WRONG)" if result["errors"] else ""
    print(f"agent / loopback (median of the rounds' ratios): {result['ratio']}{errors}")
    if "churn_ok" in result:
        print(
            f"churn {result['churn_s']:g}s: {result['churn_ops']} ops, {result['churn_fetches']} fetches "
            f"({result['churn_landed']} blocks landed), {result['churn_errors']} errors; max used "
            f"{result['churn_max_used']} here / {result['churn_holder_max_used']} holder of "
            f"{result['churn_capacity']}; arena {result['churn_arena_bytes'] / 2**20:.0f} MiB; RSS "
            f"{result['churn_rss_first_mib']} -> {result['churn_rss_end_mib']} MiB "
            f"({result['churn_rss_growth_mib']:+} MiB, bound {result['churn_rss_bound_mib']:g}): "
            + ("ok" if result["churn_ok"] else "FAILED")
        )
    if "ttft_rounds" in result:
        print(
            f"TTFT of a repeated {result['ttft_prefix_tokens']}-token (2-block) prefix on real vLLM, "
            f"median of {result['ttft_rounds']} rounds (max_tokens=1 latency):"
        )
        print("| prefix | TTFT ms |")
        print("|---|---:|")
        print(f"| computed (never seen) | {result['ttft_computed_ms']} |")
        print(f"| loaded from the pool (engine cache reset) | {result['ttft_pool_ms']} |")
        print(f"| engine's own prefix cache | {result['ttft_local_ms']} |")
        print(f"| read back from the disk tier (memory emptied, index rebuilt) | {result['ttft_disk_ms']} |")
        print(
            f"tokens the engine loaded from the pool: {result['ttft_pool_loaded_tokens']}, "
            f"from the disk tier: {result['ttft_disk_loaded_tokens']}"
        )
    print_handoff(result)
    return int(failed)
