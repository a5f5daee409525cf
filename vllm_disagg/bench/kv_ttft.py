"""``bench kv``'s TTFT part: a repeated long prefix on real vLLM, with and without the pool.

One vLLM engine on the project's connector, its pool served by this process (as its agent would).
Each round uses a fresh prefix of as many full blocks as the engine's context holds beside a tail (3
blocks of the tiny model's 512 tokens; token ids, so its blocks are exact) and times the requests
of ``max_tokens=1`` (their latency is the time to the first token):

- ``computed``: the prefix never seen anywhere: the engine computes all of it;
- ``pool``: the same prefix with another tail, after the engine's own prefix cache was reset: the
  engine loads the prefix's blocks from the pool (checked on its ``external_kv_transfer`` counter);
- ``local``: once more, another tail: the engine's own prefix cache has it (vLLM's best case);
- ``disk``: after the engine's prefix cache was reset again and the pool's blocks went to its disk
  tier (``--kv-disk-dir``) and left memory, the disk tier's index rebuilt from its files as a
  restarted agent's is: the engine loads the blocks the agent read back from disk.

The engine's prefix cache is reset with ``/reset_prefix_cache`` (dev mode).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.agent.kv.agent_pool import KvPool
from vllm_disagg.agent.kv.disk import DiskTier
from vllm_disagg.cli.up import spawn, stop_processes, tiny_model_dir
from vllm_disagg.config import AgentConfig
from vllm_disagg.runtime import child_env

SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"}'
TAIL_TOKENS = 8
START_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class TtftResult:
    ttft_rounds: int
    ttft_prefix_tokens: int
    ttft_computed_ms: float  # medians
    ttft_pool_ms: float
    ttft_local_ms: float
    ttft_pool_loaded_tokens: int  # external_kv_transfer growth over every pool request
    ttft_disk_ms: float = 0.0
    ttft_disk_loaded_tokens: int = 0  # external_kv_transfer growth over every disk request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ttft-rounds", type=int, default=5, help="real-vLLM TTFT rounds with and without the pool (0: skip)"
    )


async def latency(session: aiohttp.ClientSession, url: str, ids: list[int]) -> float:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", data=jsonutil.dumps(body), headers=_JSON) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"the engine answered {resp.status}")
    return time.perf_counter() - start


async def loaded_tokens(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(SOURCE):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def healthy(session: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.returncode is None:
        try:
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"vLLM at {url} did not become healthy (exit code {proc.returncode})")


_JSON = {"Content-Type": "application/json"}


def open_log(path: Path) -> IO[bytes]:
    return path.open("wb")


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def _rounds(
    args: argparse.Namespace, url: str, proc: asyncio.subprocess.Process, block: int, pool: KvPool
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each round's latencies by kind (computed, pool, local, disk), and the tokens the engine loaded
    for the pool's and the disk's requests."""
    rng = random.Random(args.seed)
    times: dict[str, list[float]] = {"computed": [], "pool": [], "local": [], "disk": []}
    loaded = {"pool": 0.0, "disk": 0.0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await healthy(session, url, proc)
        for _ in range(args.ttft_rounds):
            prefix = [rng.randrange(10, 1000) for _ in range(prefix_blocks(block) * block)]
            tails = [[rng.randrange(10, 1000) for _ in range(TAIL_TOKENS)] for _ in range(4)]
            times["computed"].append(await latency(session, url, prefix + tails[0]))
            await reset(session, url)
            before = await loaded_tokens(session, url)
            times["pool"].append(await latency(session, url, prefix + tails[1]))
            loaded["pool"] += await loaded_tokens(session, url) - before
            times["local"].append(await latency(session, url, prefix + tails[2]))
            await reset(session, url)
            _to_disk(pool)
            before = await loaded_tokens(session, url)
            times["disk"].append(await latency(session, url, prefix + tails[3]))
            loaded["disk"] += await loaded_tokens(session, url) - before
    return times, loaded


async def reset(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(f"{url}/reset_prefix_cache", data=b"{}", headers=_JSON) as resp:
        await resp.read()


def _to_disk(kv: KvPool) -> None:
    """Every block of the pool to its disk tier and out of memory, and the tier's index rebuilt from
    its files, as a restarted agent finds them."""
    node = kv.node
    pool, disk = node.pool, node.disk
    if pool is None or disk is None:
        raise RuntimeError("the engine never opened its pool")
    node.spill_all()
    pool.clear()
    node.disk = DiskTier.open(disk.directory.parents[0], disk.geometry, disk.capacity_bytes)
    node.changed()


def prefix_blocks(block: int, max_model_len: int = AgentConfig.max_model_len) -> int:
    """The most full blocks a prompt of the engine's longest context holds beside a tail and the one
    token vLLM always computes."""
    return max(1, (max_model_len - TAIL_TOKENS - 1) // block)


def engine_port(rng: random.Random) -> int:
    """A port free for the engine, its KV events (+2000) and its pool's transfers (+3000)."""
    while True:
        port = rng.randrange(20000, 28000)
        try:
            for offset in (0, 2000, 3000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port


async def ttft_part(args: argparse.Namespace) -> TtftResult:
    """Start the engine and its pool, run the rounds, stop both."""
    from vllm_disagg.agent.vllm_command import VllmEngineCommand, effective_block_size
    from vllm_disagg.model.tiny import build_tiny_model

    model = build_tiny_model(tiny_model_dir())
    disk_tmp = tempfile.TemporaryDirectory(prefix="vllm-disagg-bench-kv-disk-")
    disk_dir = disk_tmp.name
    cfg = AgentConfig(
        agent_id=f"bench-kv-{random.randrange(1 << 30)}", role="both", engine="vllm", model="tiny",
        model_path=str(model.path), engine_port=engine_port(random.Random()), kv_connector="vllm-disagg",
        kv_pool_capacity="256MiB", kv_disk_dir=disk_dir, kv_disk_capacity="1GiB",
    )  # fmt: skip
    command = VllmEngineCommand()
    block = effective_block_size(cfg, command.device(cfg))
    env = child_env({**command.env(cfg), "VLLM_SERVER_DEV_MODE": "1"})  # for /reset_prefix_cache
    pool = await KvPool.start(cfg)
    # The engine's own output would mix with the table (or the JSON): it goes to a log file, whose
    # last lines an error shows.
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-disagg-bench-kv-") as tmp:
            log_path = Path(tmp) / "vllm.log"
            with open_log(log_path) as log:
                proc = await spawn(command.argv(cfg), env=env, output=log)
            try:
                times, loaded = await _rounds(args, f"http://127.0.0.1:{cfg.engine_port}", proc, block, pool)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; the engine's last lines:\n{tail(log_path)}") from None
            finally:
                await stop_processes([proc], 20)
    finally:
        await pool.close()
        disk_tmp.cleanup()
    median = {kind: round(statistics.median(t) * 1e3, 2) for kind, t in times.items()}
    return TtftResult(
        args.ttft_rounds,
        prefix_blocks(block) * block,
        median["computed"],
        median["pool"],
        median["local"],
        int(loaded["pool"]),
        median["disk"],
        int(loaded["disk"]),
    )
