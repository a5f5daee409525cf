"""``vllm-disagg bench pd``: real vLLM, one colocated instance vs 1P1D through the gateway.

Starts one plain vLLM (no KV connector) on the model, measures time to first token and time per
output token of sequential streaming requests, stops it; then starts a 1P1D cluster exactly as
``vllm-disagg up`` does and measures the same requests through the gateway. Also reports each
engine's start-up time to ``/health`` and its resident memory (all processes of its group).
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
from vllm_disagg.cli.up import ClusterSpec, LocalCluster, fetch_instances, spawn, stop_processes, with_model
from vllm_disagg.config import AgentConfig
from vllm_disagg.procfs import engine_servers, group_rss_gib
from vllm_disagg.runtime import asyncio_run, child_env
from vllm_disagg.sim_engine.textgen import WORDS

_JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Side:
    """One way of serving, measured."""

    name: str
    requests: int
    ttft_p50_ms: float
    tpot_p50_ms: float
    e2e_p50_ms: float
    startup_s: float
    rss_gib: dict[str, float]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench pd``."""
    parser.add_argument("--model", default="", help="weights (default: the tiny offline model)")
    parser.add_argument("--served-model-name", default="tiny", help="the name requests use")
    parser.add_argument("--requests", type=int, default=20, help="measured requests per side")
    parser.add_argument("--prompt-words", type=int, default=100, help="prompt length in words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=19000, help="gateway port; engines use the next ones")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


async def stream_once(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[float, float, float]:
    """(TTFT, TPOT, end-to-end) seconds of one streaming completion."""
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with session.post(url, data=jsonutil.dumps(body), headers=_JSON) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            choices = jsonutil.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                last = time.perf_counter()
                first = first or last
                tokens += 1
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return first - start, tpot, last - start


async def measure(base: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """Medians of TTFT, TPOT and end-to-end over ``args.requests`` prompts (after one warm-up)."""
    samples = []
    async with aiohttp.ClientSession() as session:
        for i in range(args.requests + 1):
            prompt = f"Request {i}: " + " ".join(
                WORDS[(i * 13 + k * 7) % len(WORDS)] for k in range(args.prompt_words)
            )
            body = {"model": args.served_model_name, "prompt": prompt, "max_tokens": args.max_tokens,
                    "stream": True, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            result = await stream_once(session, f"{base}/v1/completions", body)
            if i:  # the first request warms caches and connections
                samples.append(result)
    return tuple(statistics.median(s[k] for s in samples) for k in range(3))  # type: ignore[return-value]


async def wait_health(url: str, timeout_s: float) -> float:
    """Seconds until ``url/health`` answers 200."""
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() - start < timeout_s:
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not healthy within {timeout_s}s")


async def colocated(spec: ClusterSpec, args: argparse.Namespace) -> Side:
    """One plain vLLM instance, measured directly."""
    from vllm_disagg.agent.vllm_command import VllmEngineCommand

    cfg = AgentConfig(
        agent_id="colocated", role="both", engine="vllm", model=spec.model, model_path=spec.model_path,
        engine_port=spec.engine_base_port, kv_connector="",
    )  # fmt: skip
    command = VllmEngineCommand()
    proc = await spawn(command.argv(cfg), env=child_env(dict(command.env(cfg))))
    try:
        url = f"http://127.0.0.1:{cfg.engine_port}"
        startup = await wait_health(url, 900)
        rss = {"colocated": group_rss_gib(proc.pid)}
        ttft, tpot, e2e = await measure(url, args)
    finally:
        await stop_processes([proc], 20)
    return Side("colocated", args.requests, ttft * 1e3, tpot * 1e3, e2e * 1e3, startup, rss)


async def disaggregated(spec: ClusterSpec, args: argparse.Namespace) -> Side:
    """A 1P1D cluster as ``up`` starts it, measured through the gateway."""
    cluster = LocalCluster(spec)
    started = time.monotonic()
    try:
        await cluster.start()
        if not await cluster.wait_ready(900):
            raise RuntimeError("the 1P1D cluster did not become ready")
        startup = time.monotonic() - started
        async with aiohttp.ClientSession() as session:
            instances = await fetch_instances(session, spec.base_url, spec.admin_token) or []
        rss = {}
        for item in instances:
            pids = engine_servers({int(str(item["url"]).rsplit(":", 1)[1])})
            rss[str(item["agent_id"])] = group_rss_gib(pids[0]) if pids else 0.0
        ttft, tpot, e2e = await measure(spec.base_url, args)
    finally:
        await cluster.stop()
    return Side("1P1D via gateway", args.requests, ttft * 1e3, tpot * 1e3, e2e * 1e3, startup, rss)


def render(sides: list[Side]) -> str:
    """The comparison as a table."""
    lines = [f"{'serving':<18} {'TTFT p50':>10} {'TPOT p50':>10} {'e2e p50':>10} {'start-up':>9}  RSS (GiB)"]
    for s in sides:
        rss = ", ".join(f"{k} {v:.2f}" for k, v in s.rss_gib.items())
        lines.append(
            f"{s.name:<18} {s.ttft_p50_ms:>8.1f}ms {s.tpot_p50_ms:>8.1f}ms {s.e2e_p50_ms:>8.1f}ms "
            f"{s.startup_s:>8.1f}s  {rss}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run both sides and print the comparison."""
    spec = ClusterSpec(
        engine="vllm", model=args.served_model_name, model_path=args.model, port=args.port,
        zmq_port=args.port + 1, engine_base_port=args.port + 2, stop_grace_s=20.0,
    )  # fmt: skip
    spec = with_model(spec)

    async def both() -> list[Side]:
        return [await colocated(spec, args), await disaggregated(spec, args)]

    sides = asyncio_run(both())
    out = jsonutil.dumps({"benchmark": "pd", "sides": [asdict(s) for s in sides]}).decode()
    print(out if args.json else render(sides), file=sys.stdout)
    return 0
