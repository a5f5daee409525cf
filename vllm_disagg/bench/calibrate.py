"""``vllm-disagg bench calibrate``: measure a real vLLM engine on this machine and fit the cluster
simulator's ``EngineProfile`` to it (docs/sim.md, "Profiles").

One plain vLLM (no KV connector, as ``bench pd`` starts it) on the model (default: the tiny offline
one). Two experiments, each after a warm-up, each point the median of ``--repeats``:

1. **Prefill**: one request at a time, prompts of ``--prompt-lengths`` token ids, ``max_tokens=1``;
   the latency of a step that prefills L tokens is fitted as ``a + b L + c L^2 / 1000``:
   ``prefill_s_per_token = b``, ``prefill_s_per_token_sq = c``;
2. **Decode**: B concurrent streams (``--batches``) of short prompts and ``--decode-tokens`` tokens;
   the median time per output token is fitted as ``d + e B``: ``decode_step_s = d``,
   ``decode_step_s_per_seq = e``.

Prints the points, the fit and its largest relative residual, and the profile as JSON (``--json``).
Each request's prefix is unique, so no prefix-cache hit shortens a prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.pd import wait_health
from vllm_disagg.cli.up import ClusterSpec, spawn, stop_processes, with_model
from vllm_disagg.cluster_sim.profile import EngineProfile
from vllm_disagg.config import AgentConfig
from vllm_disagg.runtime import asyncio_run, child_env

_JSON = {"Content-Type": "application/json"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench calibrate``."""
    parser.add_argument("--model", default="", help="weights (default: the tiny offline model)")
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--port", type=int, default=19300, help="the engine's port")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[32, 64, 128, 256, 384])
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 2, 4, 8], help="at most the engine's batch (8 here)"
    )
    parser.add_argument("--decode-tokens", type=int, default=48, help="output tokens of a decode stream")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per point (median)")
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's block size here (CPU: 128)")
    parser.add_argument("--num-blocks", type=int, default=0, help="KV capacity to put in the profile")
    parser.add_argument(
        "--max-num-seqs", type=int, default=8, help="the engine's batch, as the agent launches it"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


@dataclass(frozen=True)
class Fit:
    """Measured points and the fitted profile."""

    prefill_points: list[tuple[int, float]]  # (prompt tokens, seconds)
    decode_points: list[tuple[int, float]]  # (batch, seconds per output token)
    profile: EngineProfile
    prefill_residual: float  # largest |fit - measured| / measured over the points
    decode_residual: float


def _ids(i: int, n: int) -> list[int]:
    """``n`` token ids, unique to request ``i`` from the first one (no prefix-cache hit)."""
    return [10 + (i * 7919 + k * 31) % 2000 for k in range(n)]  # the tiny model has 2,048 ids


async def _complete(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], n: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", data=jsonutil.dumps(body), headers=_JSON) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:300]!r}")
    return time.perf_counter() - start


async def _stream_tpot(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], n: int
) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    first = last = 0.0
    tokens = 0
    async with session.post(f"{url}/v1/completions", data=jsonutil.dumps(body), headers=_JSON) as resp:
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                last = time.perf_counter()
                first = first or last
                tokens += 1
    return (last - first) / (tokens - 1) if tokens > 1 else 0.0


async def measure(
    url: str, args: argparse.Namespace
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The prefill and decode points."""
    model = args.served_model_name
    counter = iter(range(1, 1 << 30))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await _complete(session, url, model, _ids(0, 16), 8)  # warm-up: graphs, caches, connections
        prefill = []
        for n in args.prompt_lengths:
            times = [
                await _complete(session, url, model, _ids(next(counter), n), 1) for _ in range(args.repeats)
            ]
            prefill.append((n, statistics.median(times)))
        decode = []
        for b in args.batches:
            per_round = []
            for _ in range(args.repeats):
                prompts = [_ids(next(counter), 16) for _ in range(b)]
                tpots = await asyncio.gather(
                    *(_stream_tpot(session, url, model, p, args.decode_tokens) for p in prompts)
                )
                per_round.append(statistics.median(tpots))
            decode.append((b, statistics.median(per_round)))
    return prefill, decode


def least_squares(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Coefficients minimising the squared error of ``ys ~ xs @ coef`` (normal equations, no numpy)."""
    k = len(xs[0])
    a = [[sum(r[i] * r[j] for r in xs) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(xs, ys, strict=True)) for i in range(k)]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(k):
            if r != col and a[col][col]:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] if a[i][i] else 0.0 for i in range(k)]


def fit(prefill: list[tuple[int, float]], decode: list[tuple[int, float]], args: argparse.Namespace) -> Fit:
    """The profile whose step costs best match the points (negative terms clipped to 0)."""
    _, b, c = least_squares([[1.0, n, n * n / 1000.0] for n, _ in prefill], [t for _, t in prefill])
    b, c = max(b, 0.0), max(c, 0.0)
    d, e = least_squares([[1.0, float(bs)] for bs, _ in decode], [t for _, t in decode])
    d, e = max(d, 0.0), max(e, 0.0)
    a = statistics.median(t - b * n - c * n * n / 1000.0 for n, t in prefill)  # the step's fixed cost
    profile = EngineProfile(
        name="calibrated",
        block_size=args.block_size,
        num_blocks=args.num_blocks or 4096,
        max_num_seqs=args.max_num_seqs,
        prefill_s_per_token=b,
        prefill_s_per_token_sq=c,
        decode_step_s=d,
        decode_step_s_per_seq=e,
    )
    prefill_res = max(abs(a + b * n + c * n * n / 1000.0 - t) / t for n, t in prefill)
    decode_res = max(abs(d + e * bs - t) / t for bs, t in decode)
    return Fit(prefill, decode, profile, prefill_res, decode_res)


def render(result: Fit) -> str:
    """The points and the fit as a table."""
    p = result.profile
    lines = ["prefill (one request, max_tokens 1)", f"{'prompt tokens':>14} {'median s':>10}"]
    lines += [f"{n:>14} {t:>10.4f}" for n, t in result.prefill_points]
    lines += ["decode (B concurrent streams)", f"{'batch':>14} {'TPOT s':>10}"]
    lines += [f"{b:>14} {t:>10.4f}" for b, t in result.decode_points]
    lines += [
        f"prefill_s_per_token {p.prefill_s_per_token:.3e}  "
        f"prefill_s_per_token_sq {p.prefill_s_per_token_sq:.3e}  "
        f"(largest residual {result.prefill_residual:.0%})",
        f"decode_step_s {p.decode_step_s:.3e}  decode_step_s_per_seq {p.decode_step_s_per_seq:.3e}"
        f"  (largest residual {result.decode_residual:.0%})",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Start the engine, measure, fit, print."""
    spec = with_model(ClusterSpec(engine="vllm", model=args.served_model_name, model_path=args.model))
    from vllm_disagg.agent.vllm_command import VllmEngineCommand  # the engine's launcher

    cfg = AgentConfig(
        agent_id="calibrate", role="both", engine="vllm", model=spec.model, model_path=spec.model_path,
        engine_port=args.port, kv_connector="",
    )  # fmt: skip
    command = VllmEngineCommand()

    async def go() -> Fit:
        proc = await spawn(command.argv(cfg), env=child_env(dict(command.env(cfg))))
        try:
            url = f"http://127.0.0.1:{args.port}"
            await wait_health(url, 900)
            prefill, decode = await measure(url, args)
        finally:
            await stop_processes([proc], 20)
        return fit(prefill, decode, args)

    result = asyncio_run(go())
    if args.json:
        print(jsonutil.dumps({"benchmark": "calibrate", **asdict(result)}).decode())
    else:
        print(render(result), file=sys.stdout)
    return 0
