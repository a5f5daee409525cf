"""``bench kv``'s churn part (``--churn-s S``): the three tiers a block can be in, under random load, with
every bound checked and every block's bytes compared.

The receiving agent has ``--churn-capacity`` slots of memory and a disk tier of ``--churn-disk-blocks``
blocks beneath it (a temporary directory); the holder agent (another process) has as many slots. The
``--churn-prompts`` prompts (which share prefixes) hold more blocks than the memory pool. For S
seconds, ``--churn-workers`` tasks pick random prompts and fetch them from the holder (which stores
what it lacks, evicting, and grants), store them (reserve, write, commit, release), read back from
the disk tier what a lookup would (``promote``), or pin them for a while as a running request would.
Blocks evicted from memory go to disk, and the disk tier evicts its own least recently used.

Every second this process's RSS, its arena file's size, its pool's ``used`` and its disk tier's bytes
are sampled. After every promotion, the prompt's blocks in memory are compared with the bytes they
must hold, and at the end every block on disk is read back and compared too. The run fails (exit 1)
if a pool ever held more than its capacity or the disk tier more than its bytes, a landed or
read-back block differed from what was written, a fetch or pin left a reference behind, or the RSS
grew by more than ``--churn-rss-bound-mib`` from the end of the first minute (the first third of a
shorter run) to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_disagg.agent.kv.disk import DiskTier
from vllm_disagg.agent.kv.node import DiskConfig
from vllm_disagg.agent.kv.pool import BlockKey
from vllm_disagg.bench.kv import Side, chain, close_side, open_side, store

PIN_HELD = 8  # requests a churn worker keeps pinned at once


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--churn-s", type=float, default=0.0, help="seconds of churn (0: none)")
    parser.add_argument("--churn-capacity", type=int, default=64, help="blocks each pool holds")
    parser.add_argument("--churn-disk-blocks", type=int, default=128, help="blocks the disk tier holds")
    parser.add_argument("--churn-prompts", type=int, default=64, help="prompts in the working set")
    parser.add_argument("--churn-prompt-blocks", type=int, default=8, help="most blocks of a prompt")
    parser.add_argument("--churn-workers", type=int, default=4, help="concurrent churn tasks")
    parser.add_argument("--churn-rss-bound-mib", type=float, default=32.0, help="RSS growth allowed")


@dataclass
class ChurnResult:
    churn_s: float
    churn_ops: int
    churn_fetches: int
    churn_landed: int
    churn_errors: int  # broken transfers, blocks whose bytes differ, references left behind
    churn_capacity: int
    churn_max_used: int
    churn_holder_max_used: int
    churn_arena_bytes: int
    churn_rss_first_mib: float
    churn_rss_end_mib: float
    churn_rss_growth_mib: float
    churn_rss_bound_mib: float
    churn_ok: bool
    churn_disk_capacity_bytes: int = 0
    churn_disk_max_bytes: int = 0
    churn_spilled: int = 0  # blocks written to disk (evicted from memory)
    churn_promoted: int = 0  # blocks read back from disk into memory
    churn_disk_checked: int = 0  # blocks on disk read back and compared at the end


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
    disk_max_bytes: int = 0
    promoted: int = 0
    disk_checked: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, RSS)

    def saw_used(self, side: Side) -> None:
        """Keep the most slots the receiving pool has held, and the most bytes its disk tier has."""
        self.max_used = max(self.max_used, side.pool.stats().used)
        disk = side.node.disk
        if disk is not None:
            self.disk_max_bytes = max(self.disk_max_bytes, disk.stats().bytes)


async def churn_part(args: argparse.Namespace, keydir: Path | None) -> ChurnResult:
    """Fetch, store, promote and pin random prompts for ``--churn-s`` seconds; check bounds and bytes."""
    block_bytes = args.layers * (args.layer_block_kib << 10)
    with tempfile.TemporaryDirectory(prefix="vllm-disagg-bench-churn-disk-") as tmp:
        disk = DiskConfig(Path(tmp), args.churn_disk_blocks * (block_bytes + 4096))  # + each file's header
        side = await open_side(args, args.churn_capacity, keydir, disk)
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
            _check_disk(side, tally)
            spilled = side.node.disk.stats().spills if side.node.disk is not None else 0
        finally:
            await close_side(side)
    return _churn_result(args, tally, disk.capacity_bytes, spilled)


async def _churn_worker(
    side: Side, tally: _ChurnTally, w: int, work: list[list[BlockKey]], rng: random.Random, end: float
) -> None:
    """One task of the churn: a random operation on a random prompt until ``end``, then unpin."""
    pins: deque[str] = deque()
    n = 0
    while time.monotonic() < end:
        n += 1
        prompt, op = rng.choice(work), rng.random()
        if op < 0.4:
            await _churn_fetch(side, tally, f"w{w}-{n}", prompt)
        elif op < 0.6:
            store(side.pool, side.arena, side.blocks, f"save:w{w}-{n}", prompt)
            side.node.changed()
        elif op < 0.75:
            _churn_promote(side, tally, prompt)
        else:
            owner = f"req:w{w}-{n}"
            side.pool.pin(owner, prompt)
            pins.append(owner)
            if len(pins) > PIN_HELD or op > 0.92:
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


def _churn_promote(side: Side, tally: _ChurnTally, prompt: list[BlockKey]) -> None:
    """What a lookup does: read back from disk what follows memory's run of the prompt; then every
    ready block of the prompt in memory must hold its bytes, wherever it came from."""
    tally.promoted += side.node.promote(prompt)
    side.node.changed()
    pool = side.pool
    for key in prompt[: pool.lookup(prompt, pending_ok=False)]:
        slot = pool.slot_of(key)
        if slot is not None and not side.blocks.check(side.arena, slot, key):
            tally.errors += 1


def _check_disk(side: Side, tally: _ChurnTally) -> None:
    """Read back every block on disk and compare it with what it must hold."""
    disk: DiskTier | None = side.node.disk
    if disk is None:
        return
    into = memoryview(bytearray(disk.geometry.block_bytes))
    held = disk.keys()
    for key in held:
        tally.disk_checked += 1
        if not disk.load(key, into) or bytes(into) != side.blocks.expected(key):
            tally.errors += 1


async def _churn_sampler(side: Side, tally: _ChurnTally, t0: float, end: float) -> None:
    """Every second until ``end``: this process's RSS, the arena file's size and the pool's use."""
    while time.monotonic() < end:
        tally.samples.append((time.monotonic() - t0, rss_bytes()))
        tally.arena_bytes = max(tally.arena_bytes, os.stat(side.arena.path).st_size)
        tally.saw_used(side)
        await asyncio.sleep(1.0)


def _churn_result(
    args: argparse.Namespace, tally: _ChurnTally, disk_capacity: int, spilled: int
) -> ChurnResult:
    """The tally as a result: RSS growth from the end of the warm-up, and whether every bound held."""
    warm = min(60.0, args.churn_s / 3)
    first = [rss for at, rss in tally.samples if at <= warm][-1]
    last = tally.samples[-1][1]
    growth = (last - first) / 2**20
    ok = (
        tally.max_used <= args.churn_capacity
        and tally.holder_max_used <= args.churn_capacity
        and tally.disk_max_bytes <= disk_capacity
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
        disk_capacity,
        tally.disk_max_bytes,
        spilled,
        tally.promoted,
        tally.disk_checked,
    )


def print_churn(result: dict[str, Any]) -> None:
    """The churn part's line, when it ran."""
    if "churn_ok" not in result:
        return
    print(
        f"churn {result['churn_s']:g}s: {result['churn_ops']} ops, {result['churn_fetches']} fetches "
        f"({result['churn_landed']} blocks landed), {result['churn_errors']} errors; max used "
        f"{result['churn_max_used']} here / {result['churn_holder_max_used']} holder of "
        f"{result['churn_capacity']}; disk tier {result['churn_spilled']} blocks spilled, "
        f"{result['churn_promoted']} promoted, {result['churn_disk_checked']} read back at the end, "
        f"at most {result['churn_disk_max_bytes'] / 2**20:.0f} of "
        f"{result['churn_disk_capacity_bytes'] / 2**20:.0f} MiB; "
        f"arena {result['churn_arena_bytes'] / 2**20:.0f} MiB; "
        f"RSS {result['churn_rss_first_mib']} -> {result['churn_rss_end_mib']} MiB "
        f"({result['churn_rss_growth_mib']:+} MiB, bound {result['churn_rss_bound_mib']:g}): "
        + ("ok" if result["churn_ok"] else "FAILED")
    )
