"""``bench kv``'s handoff part: a prompt one engine computed, served by another engine of the same host,
through the host's pool (shared memory) or through two agents' pools (a move over loopback TCP).

Two vLLM engines on the project's connector, their pools served by this process (as their agents
would). Each round takes a fresh prompt of ``--handoff-blocks`` full blocks (token ids, so its blocks
are exact): engine A computes it (``max_tokens=1``: it saves the prompt's blocks), then engine B gets
it with another tail and loads the blocks:

- ``node``: B shares A's pool (``kv_pool_node``): nothing moves, B's engine loads from the memory A's
  engine wrote;
- ``loopback``: B has its own pool: B's agent fetches the blocks from A's (``kv_grant`` then
  ``kv_fetch``, as the gateway has agents do, over TCP on loopback), then B's engine loads them.

Reported: the median handoff (the move: none for ``node``) and B's time to its first token after it,
and the blocks B loaded (its ``external_kv_transfer`` counter), per path. Engine B runs twice (a node
engine, then a loopback one); A is the same throughout.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from vllm_disagg.agent.kv.agent_pool import KvPool
from vllm_disagg.bench.kv_ttft import engine_port, healthy, latency, loaded_tokens, open_log, tail
from vllm_disagg.cli.up import spawn, stop_processes, tiny_model_dir
from vllm_disagg.config import AgentConfig
from vllm_disagg.runtime import child_env
from vllm_disagg.wire.block_hash import prompt_block_hashes

TAIL_TOKENS = 8


@dataclass(frozen=True, slots=True)
class HandoffResult:
    handoff_rounds: int
    handoff_prompt_tokens: int
    handoff_node_move_ms: float  # medians; the node pool moves nothing
    handoff_node_ttft_ms: float
    handoff_node_loaded_tokens: int  # B's external_kv_transfer growth over every round
    handoff_loopback_move_ms: float
    handoff_loopback_ttft_ms: float
    handoff_loopback_loaded_tokens: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--handoff-rounds",
        type=int,
        default=5,
        help="rounds of a prompt computed on one real vLLM and loaded by another, through the host's "
        "pool and through a loopback move (0: skip)",
    )
    parser.add_argument("--handoff-blocks", type=int, default=3, help="full blocks of each handoff prompt")


def _config(name: str, core: int, model: Path, rng: random.Random, **more: Any) -> AgentConfig:
    # A core of its own for each engine, as ``up`` gives them: two engines on the same cores spin
    # their OpenMP threads against each other for as long as a second after each step.
    return AgentConfig(
        agent_id=f"bench-handoff-{name}-{rng.randrange(1 << 30)}", role="both", engine="vllm", model="tiny",
        model_path=str(model), engine_port=engine_port(rng), kv_connector="vllm-disagg",
        kv_pool_capacity="256MiB", omp_threads_bind=str(core % (os.cpu_count() or 1)), **more,
    )  # fmt: skip


@asynccontextmanager
async def _engine(cfg: AgentConfig, logs: Path) -> AsyncIterator[str]:
    """A vLLM engine on the project's connector, healthy; its base URL."""
    from vllm_disagg.agent.vllm_command import VllmEngineCommand

    command = VllmEngineCommand()
    log_path = logs / f"{cfg.agent_id}.log"
    with open_log(log_path) as log:
        proc = await spawn(command.argv(cfg), env=child_env(dict(command.env(cfg))), output=log)
    url = f"http://127.0.0.1:{cfg.engine_port}"
    try:
        async with aiohttp.ClientSession() as session:
            try:
                await healthy(session, url, proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; the engine's last lines:\n{tail(log_path)}") from None
        yield url
    finally:
        await stop_processes([proc], 20)


Move = Callable[[list[bytes]], Awaitable[None]]


async def _rounds(
    args: argparse.Namespace, a: str, b: str, block: int, move: Move | None
) -> tuple[list[float], list[float], float]:
    """Each round's move and B's TTFT (seconds), and the tokens B loaded over all rounds."""
    rng = random.Random(args.seed + (1 if move is None else 2))
    moves: list[float] = []
    ttfts: list[float] = []
    loaded = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(args.handoff_rounds):
            prompt = [rng.randrange(10, 1000) for _ in range(args.handoff_blocks * block)]
            tails = [[rng.randrange(10, 1000) for _ in range(TAIL_TOKENS)] for _ in range(2)]
            await latency(session, a, prompt + tails[0])  # A computes it and saves its blocks
            started = time.perf_counter()
            if move is not None:
                await move(prompt_block_hashes(prompt, block))
            moves.append(time.perf_counter() - started)
            before = await loaded_tokens(session, b)
            ttfts.append(await latency(session, b, prompt + tails[1]))
            loaded += await loaded_tokens(session, b) - before
    return moves, ttfts, loaded


async def handoff_part(args: argparse.Namespace) -> HandoffResult:
    """Start engine A and its pool, then B on A's pool, then B on its own; the rounds of each."""
    from vllm_disagg.agent.vllm_command import VllmEngineCommand, effective_block_size
    from vllm_disagg.model.tiny import build_tiny_model

    model = build_tiny_model(tiny_model_dir()).path
    rng = random.Random()
    a_cfg = _config("a", 0, model, rng)
    block = effective_block_size(a_cfg, VllmEngineCommand().device(a_cfg))
    node_cfg = _config("b-node", 1, model, rng, kv_pool_node=a_cfg.agent_id)
    own_cfg = _config("b-own", 1, model, rng)
    a_pool = await KvPool.start(a_cfg)
    b_pool = await KvPool.start(own_cfg)

    async def move(keys: list[bytes]) -> None:  # what the gateway has the two agents do
        token = secrets.token_urlsafe(12)
        if a_pool.transfer.grant(token, keys, None, 30.0) < len(keys):
            raise RuntimeError("engine A's pool does not hold the prompt it computed")
        started = await b_pool.transfer.fetch(a_pool.transfer.endpoint, None, token, keys, 30.0)
        if await started.done < len(keys) - started.already_held:
            raise RuntimeError("the loopback move landed fewer blocks than asked")

    try:
        with tempfile.TemporaryDirectory(prefix="vllm-disagg-bench-handoff-") as tmp:
            async with _engine(a_cfg, Path(tmp)) as a:
                async with _engine(node_cfg, Path(tmp)) as b:
                    node = await _rounds(args, a, b, block, None)
                async with _engine(own_cfg, Path(tmp)) as b:
                    loop = await _rounds(args, a, b, block, move)
    finally:
        await b_pool.close()
        await a_pool.close()
    return HandoffResult(
        args.handoff_rounds,
        args.handoff_blocks * block,
        _ms(node[0]),
        _ms(node[1]),
        int(node[2]),
        _ms(loop[0]),
        _ms(loop[1]),
        int(loop[2]),
    )


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


def print_handoff(result: dict[str, Any]) -> None:
    """The handoff part's table, when it ran."""
    if "handoff_rounds" not in result:
        return
    print(
        f"A {result['handoff_prompt_tokens']}-token prompt computed on one real vLLM, then loaded by another "
        f"on the same host, median of {result['handoff_rounds']} rounds:"
    )
    print("| path | move ms | TTFT ms after it | tokens loaded |")
    print("|---|---:|---:|---:|")
    for path, name in (
        ("node", "the host's pool (shared memory)"),
        ("loopback", "two pools, a move over TCP"),
    ):
        print(
            f"| {name} | {result[f'handoff_{path}_move_ms']} | {result[f'handoff_{path}_ttft_ms']} | "
            f"{result[f'handoff_{path}_loaded_tokens']} |"
        )
