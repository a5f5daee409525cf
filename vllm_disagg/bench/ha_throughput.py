"""``bench ha``'s throughput and agent-traffic measurements: one configuration of the control plane.

Each configuration is a 1P1D cluster of zero-delay simulated engines with its own control plane: one
orchestrator (the default deployment), one with ``--gateway-workers 2``, or 1, 2 or 3 replicas on an
etcd. The load is ``bench gateway``'s (one aiohttp client in this process, ``--concurrency``
keep-alive workers, a ``--prompt-chars`` prompt, ``--max-tokens`` output tokens), spread over the
replicas' ports (worker ``k`` on replica ``k mod N``), three scenarios a round: plain
and streamed with one prompt for every request (``bench gateway``'s load: after the first, its KV
blocks are cached everywhere and no KV event flows), and plain with a prompt of its own for every
request (every block new: the engines' KV events, and evictions once their caches are full, go
through the agents to every orchestrator). Each round starts every configuration afresh, one after
the other, so that a machine slower for a while (other work) slows every configuration alike over
``--runs`` rounds. CPU per request is each process group's user + system
time from ``/proc`` over the measured requests, as ``bench gateway`` counts it. Agent traffic: the
kernel's byte counters of each agent's connections to the orchestrators (``ss -i``), idle
(heartbeats) over ``--idle-s``, and per request under the load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.compare import percentile
from vllm_disagg.bench.ha_cluster import MODEL, HaCluster, Shape

_JSON = {"Content-Type": "application/json"}
_ZERO_DELAY = (("max_num_seqs", "1024"),)
SCENARIOS = (
    (False, False),
    (True, False),
    (False, True),
)  # (stream, a prompt of its own per request)  # the timing model's defaults are zero: answers at once
# name -> (what the table calls it, the control plane)
CONFIGS: dict[str, tuple[str, Shape]] = {
    "single": ("1 process", Shape(0, sim_timing=_ZERO_DELAY)),
    "workers2": ("1 process, --gateway-workers 2", Shape(0, gateway_workers=2, sim_timing=_ZERO_DELAY)),
    "replicas1": ("1 replica (etcd)", Shape(1, sim_timing=_ZERO_DELAY)),
    "replicas2": ("2 replicas", Shape(2, sim_timing=_ZERO_DELAY)),
    "replicas3": ("3 replicas", Shape(3, sim_timing=_ZERO_DELAY)),
}


@dataclass(frozen=True)
class ThroughputRound:
    """One measured scenario of one configuration in one round."""

    config: str
    round: int
    stream: bool
    unique: bool  # a prompt of its own for every request (KV events flow), else one for all
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    orchestrators_cpu_ms_per_req: float  # every orchestrator process (and gateway worker) together
    agents_cpu_ms_per_req: float  # both agents together
    etcd_cpu_ms_per_req: float
    agent_sent_bytes_per_req: float  # per agent, to every orchestrator together
    agent_received_bytes_per_req: float


@dataclass(frozen=True)
class Traffic:
    """An idle agent's traffic with the orchestrators: heartbeats (and their answers)."""

    config: str
    orchestrators: int
    idle_s: float
    agent_sent_bytes_per_s: float  # per agent, to every orchestrator together
    agent_received_bytes_per_s: float


async def measure_config(
    name: str, n: int, args: argparse.Namespace, logs: Path
) -> tuple[list[ThroughputRound], Traffic]:
    """Start configuration ``name`` afresh, measure its idle traffic and round ``n``, stop it."""
    cluster = HaCluster(CONFIGS[name][1], logs, f"{name}-{n}")
    rounds: list[ThroughputRound] = []
    try:
        await cluster.start(args.ready_timeout_s)
        traffic = await idle_traffic(cluster, name, args.idle_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for stream, unique in SCENARIOS:
                rounds.append(await _round(session, cluster, name, n, stream, unique, args))
    finally:
        await cluster.stop()
    return rounds, traffic


async def idle_traffic(cluster: HaCluster, name: str, idle_s: float) -> Traffic:
    """Bytes per second per agent over ``idle_s`` of no requests."""
    before = await cluster.agent_bytes()
    t0 = time.monotonic()
    await asyncio.sleep(idle_s)
    after = await cluster.agent_bytes()
    span = time.monotonic() - t0
    sent, received = _per_agent(before, after)
    return Traffic(name, len(cluster.urls), span, sent / span, received / span)


def _per_agent(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> tuple[float, float]:
    """The mean bytes (sent, received) one agent moved between two readings."""
    n = max(1, len(after))
    sent = sum(after[a][0] - before.get(a, (0, 0))[0] for a in after)
    received = sum(after[a][1] - before.get(a, (0, 0))[1] for a in after)
    return sent / n, received / n


async def _round(
    session: aiohttp.ClientSession,
    cluster: HaCluster,
    name: str,
    n: int,
    stream: bool,
    unique: bool,
    args: argparse.Namespace,
) -> ThroughputRound:
    bodies = _bodies(f"{name}-{n}", stream, unique, args)
    await spread(session, cluster.urls, bodies, stream, args.concurrency, args.warmup)
    cpu0 = (cluster.orchestrators_cpu_s(), cluster.agents_cpu_s(), cluster.etcd_cpu_s())
    bytes0 = await cluster.agent_bytes()
    latencies, wall = await spread(session, cluster.urls, bodies, stream, args.concurrency, args.requests)
    bytes1 = await cluster.agent_bytes()
    cpu1 = (cluster.orchestrators_cpu_s(), cluster.agents_cpu_s(), cluster.etcd_cpu_s())
    count = len(latencies)
    sent, received = _per_agent(bytes0, bytes1)
    orch, agents, etcd = (1e3 * (b - a) / count for a, b in zip(cpu0, cpu1, strict=True))
    return ThroughputRound(
        config=name,
        round=n,
        stream=stream,
        unique=unique,
        requests=count,
        rps=count / wall,
        p50_ms=statistics.median(latencies) * 1e3,
        p99_ms=percentile(latencies, 0.99) * 1e3,
        orchestrators_cpu_ms_per_req=orch,
        agents_cpu_ms_per_req=agents,
        etcd_cpu_ms_per_req=etcd,
        agent_sent_bytes_per_req=sent / count,
        agent_received_bytes_per_req=received / count,
    )


def _bodies(tag: str, stream: bool, unique: bool, args: argparse.Namespace) -> Callable[[], bytes]:
    """Each request's body: the same one, or one whose prompt starts with a number of its own (so
    that every KV block of it is new)."""
    filler = "bench " * args.prompt_chars
    numbers = itertools.count()

    def body() -> bytes:
        head = f"{tag} {next(numbers)} " if unique else ""
        prompt = (head + filler)[: args.prompt_chars]
        return jsonutil.dumps(
            {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "stream": stream}
        )

    if not unique:
        same = body()
        return lambda: same
    return body


async def spread(
    session: aiohttp.ClientSession,
    urls: list[str],
    bodies: Callable[[], bytes],
    stream: bool,
    concurrency: int,
    requests: int,
) -> tuple[list[float], float]:
    """Latencies (s) of ``requests`` completions by ``concurrency`` workers, worker ``k`` on
    ``urls[k mod N]``, and the wall time they took; ``RuntimeError`` on any answer but a whole one."""
    latencies: list[float] = []
    remaining = requests

    async def worker(url: str) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            async with session.post(url, data=bodies(), headers=_JSON) as resp:
                raw = await resp.read()
                if resp.status != 200 or (stream and not raw.endswith(b"data: [DONE]\n\n")):
                    raise RuntimeError(f"bench ha: {url}: HTTP {resp.status}: {raw[-300:]!r}")
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker(f"{urls[k % len(urls)]}/v1/completions") for k in range(concurrency)))
    return latencies, time.perf_counter() - start
