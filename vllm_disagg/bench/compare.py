"""``vllm-disagg bench gateway --compare NAME=CMD ...``: our gateway and other routers, side by side.

One fleet of zero-delay simulated engines (``--prefill`` + ``--decode`` processes) serves every router,
so each sees the same engines and the same load. Ours is the orchestrator with one attach agent per
engine (``vllm-disagg connect``), scheduling, metrics, KV events and explanations on. Each compared
router is the user's command with placeholders filled in (``ROUTER_PLACEHOLDERS``); vllm-router, for
instance, installed in a throwaway venv (never a dependency of this project)::

    vllm-router=/tmp/vr/bin/vllm-router --vllm-pd-disaggregation {prefill_flags} {decode_flags} \
        --port {port} --prometheus-port {metrics_port}

For every round, every scenario (concurrency x stream) runs on each router in turn, so a machine that
slows down mid-run slows all of them alike. Per router and scenario the report keeps each round's p50,
p99, throughput and CPU per request (the router's whole process group from /proc; our agents apart),
and the table shows the median over rounds with the spread, and each ratio ours / theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.cli.up import ClusterSpec, fetch_instances, spawn, stop_processes
from vllm_disagg.errors import ConfigError
from vllm_disagg.procfs import cpu_seconds, group_members
from vllm_disagg.runtime import SELF_ARGV

Proc = asyncio.subprocess.Process
OURS = "vllm-disagg"
MODEL = "sim-model"
_JSON = {"Content-Type": "application/json"}
ROUTER_PLACEHOLDERS = {
    "port": "the port the router must listen on (127.0.0.1)",
    "metrics_port": "a second free port, for a router that serves its metrics apart",
    "prefill_flags": "--prefill URL once per prefill engine (vllm-router's form)",
    "decode_flags": "--decode URL once per decode engine",
    "prefill_urls": "the prefill engines' URLs, space-separated",
    "decode_urls": "the decode engines' URLs, space-separated",
}
# Zero-delay engines: every millisecond measured is the routers' and the client's.
_ZERO_DELAY = (
    "--prefill-s-per-token", "0", "--decode-step-s", "0", "--decode-step-s-per-seq", "0",
    "--kv-transfer-s-per-token", "0", "--max-num-seqs", "1024",
)  # fmt: skip


@dataclass(frozen=True)
class RouterSpec:
    """A router to measure: a name and its command line (placeholders filled in)."""

    name: str
    argv: tuple[str, ...]
    port: int


@dataclass(frozen=True)
class Round:
    """One scenario on one router in one round."""

    router: str
    round: int
    concurrency: int
    stream: bool
    requests: int
    p50_ms: float
    p99_ms: float
    rps: float
    cpu_ms_per_req: float
    agents_cpu_ms_per_req: float | None  # ours only: the attach agents, apart from the gateway


def parse_compare(item: str) -> tuple[str, str]:
    """``NAME=CMD`` as (name, command template); ``ConfigError`` for a malformed one."""
    name, sep, cmd = item.partition("=")
    name = name.strip()
    if not sep or not name or not cmd.strip():
        raise ConfigError(f"--compare wants NAME=CMD, got {item!r}")
    if name == OURS:
        raise ConfigError(f"--compare: {OURS!r} is this project's own gateway; name the other router")
    return name, cmd


def router_argv(template: str, port: int, prefill: list[str], decode: list[str]) -> tuple[str, ...]:
    """The command line of a compared router: ``template`` with its placeholders filled in
    (``metrics_port`` is ``port + 1``)."""
    values = {
        "port": str(port),
        "metrics_port": str(port + 1),
        "prefill_flags": " ".join(f"--prefill {url}" for url in prefill),
        "decode_flags": " ".join(f"--decode {url}" for url in decode),
        "prefill_urls": " ".join(prefill),
        "decode_urls": " ".join(decode),
    }
    try:
        return tuple(shlex.split(template.format(**values)))
    except (KeyError, IndexError, ValueError) as exc:
        known = ", ".join("{" + k + "}" for k in ROUTER_PLACEHOLDERS)
        raise ConfigError(f"--compare command {template!r}: {exc!r} (placeholders: {known})") from None


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes of group ``pgid``."""
    total = 0.0
    for pid in group_members({pgid}):
        try:
            total += cpu_seconds(pid)
        except OSError:  # it exited meanwhile
            continue
    return total


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def measure(
    send: Callable[[], Awaitable[object]], concurrency: int, requests: int
) -> tuple[list[float], float]:
    """Latencies (s) of ``requests`` sends by ``concurrency`` workers, and the wall time they took."""
    latencies: list[float] = []
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            await send()
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


class Fleet:
    """The engines, our orchestrator and agents, and every compared router, as process groups."""

    def __init__(self, args: argparse.Namespace, compared: list[tuple[str, str]]) -> None:
        base = args.port
        n_p, n_d = args.prefill, args.decode
        self.engine_ports = list(range(base + 100, base + 100 + n_p + n_d))  # routers: base + 2, 4, ...
        self.prefill = [f"http://127.0.0.1:{p}" for p in self.engine_ports[:n_p]]
        self.decode = [f"http://127.0.0.1:{p}" for p in self.engine_ports[n_p:]]
        workers = getattr(args, "gateway_workers", 1)
        self.spec = ClusterSpec(
            engine="sim",
            model=MODEL,
            port=base,
            zmq_port=base + 1,
            stop_grace_s=5.0,
            extra_orchestrator_args=("--gateway-workers", str(workers)) if workers > 1 else (),
        )
        self.routers = [RouterSpec(OURS, (), base)] + [
            RouterSpec(name, router_argv(cmd, base + 2 + 2 * i, self.prefill, self.decode), base + 2 + 2 * i)
            for i, (name, cmd) in enumerate(compared)
        ]
        self.engines: list[asyncio.subprocess.Process] = []
        self.agents: list[asyncio.subprocess.Process] = []
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        # Every process's output goes to a file here: the table stays readable, and a failure says where.
        self.logs = Path(tempfile.mkdtemp(prefix="vllm-disagg-bench-"))
        self._files: list[IO[bytes]] = []

    async def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        out = (self.logs / f"{name}.log").open("ab")
        self._files.append(out)
        return await spawn(argv, env=env, output=out)

    async def start(self) -> None:
        """Engines, then our orchestrator and agents, then the other routers; each once it answers."""
        for port in self.engine_ports:
            argv = [*SELF_ARGV, "sim-engine", "--model", MODEL, "--port", str(port)]
            argv += ["--kv-events-port", str(port + 2000), *_ZERO_DELAY]
            self.engines.append(await self._spawn(f"engine-{port}", argv))
        await self._engines_up(60.0)  # connect looks at its engine once, at start
        env = self.spec.orchestrator_env()
        self.processes[OURS] = await self._spawn(OURS, self.spec.orchestrator_argv(), env)
        endpoint = f"tcp://127.0.0.1:{self.spec.zmq_port}"
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            for i, url in enumerate(urls):
                argv = [*SELF_ARGV, "connect", "--orchestrator", endpoint, "--url", url, "--role", role]
                argv += ["--agent-id", f"{role}-{i}"]
                self.agents.append(await self._spawn(f"agent-{role}-{i}", argv))
        await self._ours_ready(120.0)
        for router in self.routers[1:]:
            self.processes[router.name] = await self._spawn(router.name, list(router.argv))
            await self._answers(router, 120.0)

    async def _engines_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.prefill + self.decode)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while waiting and time.monotonic() < deadline:
                for url in list(waiting):
                    try:
                        async with session.get(f"{url}/health") as resp:
                            if resp.status == 200:
                                waiting.discard(url)
                    except (aiohttp.ClientError, TimeoutError):
                        pass
                await asyncio.sleep(0.1)
        if waiting:
            raise RuntimeError(f"engines not up after {timeout_s:.0f} s: {sorted(waiting)}")

    async def _ours_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = len(self.prefill) + len(self.decode)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                items = await fetch_instances(session, self.spec.base_url, self.spec.admin_token) or []
                if sum(1 for i in items if i.get("state") == "ready") == want:
                    return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{OURS}: {want} instances not ready in {timeout_s:.0f} s; logs: {self.logs}")

    async def _answers(self, router: RouterSpec, timeout_s: float) -> None:
        """Wait until the router answers a completion with 200 (its process must stay up)."""
        deadline = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{router.port}/v1/completions"
        body = jsonutil.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline:
                if self.processes[router.name].returncode is not None:
                    log = self.logs / f"{router.name}.log"
                    raise RuntimeError(f"{router.name} exited (its output: {log}): {shlex.join(router.argv)}")
                try:
                    async with session.post(url, data=body, headers=_JSON) as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)
        command = shlex.join(router.argv)
        raise RuntimeError(f"{router.name} silent for {timeout_s:.0f} s (logs: {self.logs}): {command}")

    async def stop(self) -> None:
        """Routers, then agents, then engines: nothing is left running."""
        await stop_processes(list(self.processes.values())[1:], 5.0)
        await stop_processes(self.agents, 5.0)
        await stop_processes([self.processes[OURS]] if OURS in self.processes else [], 5.0)
        await stop_processes(self.engines, 5.0)
        for out in self._files:
            out.close()


async def run_comparison(args: argparse.Namespace, compared: list[tuple[str, str]]) -> dict[str, object]:
    """Start the fleet, run every round, stop the fleet; the figures as one object."""
    fleet = Fleet(args, compared)
    rounds: list[Round] = []
    try:
        await fleet.start()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            for n in range(args.rounds):
                for concurrency in args.concurrency:
                    for stream in (mode == "stream" for mode in args.modes):
                        for router in fleet.routers:
                            rounds.append(await _one(session, fleet, router, n, concurrency, stream, args))
    finally:
        await fleet.stop()
    return {
        "benchmark": "gateway-compare",
        "engines": f"{args.prefill}P{args.decode}D zero-delay sim",
        "gateway_workers": getattr(args, "gateway_workers", 1),
        "rounds": args.rounds,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "prompt_chars": args.prompt_chars,
        "commands": {r.name: shlex.join(r.argv) for r in fleet.routers[1:]},
        "results": [asdict(r) for r in rounds],
    }


async def _one(
    session: aiohttp.ClientSession,
    fleet: Fleet,
    router: RouterSpec,
    n: int,
    concurrency: int,
    stream: bool,
    args: argparse.Namespace,
) -> Round:
    url = f"http://127.0.0.1:{router.port}/v1/completions"
    prompt = ("bench " * args.prompt_chars)[: args.prompt_chars]
    body = jsonutil.dumps({"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "stream": stream})

    async def send() -> None:
        async with session.post(url, data=body, headers=_JSON) as resp:
            raw = await resp.read()
            if resp.status != 200 or (stream and not raw.endswith(b"data: [DONE]\n\n")):
                raise RuntimeError(f"{router.name}: HTTP {resp.status}: {raw[-300:]!r}")

    await measure(send, concurrency, args.warmup)
    pgid = fleet.processes[router.name].pid
    agents = [a.pid for a in fleet.agents] if router.name == OURS else []
    cpu0, agents0 = group_cpu_seconds(pgid), sum(map(group_cpu_seconds, agents))
    latencies, wall = await measure(send, concurrency, args.requests)
    cpu, agents_cpu = group_cpu_seconds(pgid) - cpu0, sum(map(group_cpu_seconds, agents)) - agents0
    count = len(latencies)
    return Round(
        router=router.name,
        round=n,
        concurrency=concurrency,
        stream=stream,
        requests=count,
        p50_ms=statistics.median(latencies) * 1e3,
        p99_ms=percentile(latencies, 0.99) * 1e3,
        rps=count / wall,
        cpu_ms_per_req=cpu * 1e3 / count,
        agents_cpu_ms_per_req=agents_cpu * 1e3 / count if agents else None,
    )


def render_comparison(report: dict[str, object]) -> str:
    """Medians over rounds per router and scenario, the spread, and the ratios ours / theirs."""
    raw = report["results"]
    assert isinstance(raw, list)
    rows = [Round(**r) for r in raw]
    lines = [
        f"gateway comparison: {report['engines']}, {report.get('gateway_workers', 1)} gateway process(es), "
        f"{report['rounds']} rounds x {report['requests']} "
        f"requests per scenario, {report['max_tokens']} output tokens; medians over rounds [min-max]",
        f"{'router':<14} {'conc':>4} {'stream':>6} {'p50 ms':>8} {'p99 ms [min-max]':>22} {'req/s':>7} "
        f"{'cpu/req ms [min-max]':>23} {'agents':>7} {'ours/this cpu':>13} {'ours/this p99':>13}",
    ]
    scenarios = sorted({(r.concurrency, r.stream) for r in rows})
    names = list(dict.fromkeys(r.router for r in rows))
    for concurrency, stream in scenarios:

        def of(name: str, c: int = concurrency, s: bool = stream) -> list[Round]:
            return [r for r in rows if (r.router, r.concurrency, r.stream) == (name, c, s)]

        ours = _medians(of(OURS))
        for name in names:
            mine = of(name)
            m = _medians(mine)
            p99s, cpus = [r.p99_ms for r in mine], [r.cpu_ms_per_req for r in mine]
            agents = statistics.median(
                [r.agents_cpu_ms_per_req for r in mine if r.agents_cpu_ms_per_req is not None] or [0.0]
            )
            ratio_cpu = f"{ours['cpu'] / m['cpu']:.2f}x" if name != OURS and m["cpu"] else ""
            ratio_p99 = f"{ours['p99'] / m['p99']:.2f}x" if name != OURS and m["p99"] else ""
            lines.append(
                f"{name:<14} {concurrency:>4} {'yes' if stream else 'no':>6} {m['p50']:>8.2f} "
                f"{m['p99']:>8.2f} [{min(p99s):>5.1f}-{max(p99s):>5.1f}] {m['rps']:>7.0f} "
                f"{m['cpu']:>8.3f} [{min(cpus):.3f}-{max(cpus):.3f}] "
                f"{agents if name == OURS else 0.0:>7.3f} {ratio_cpu:>13} {ratio_p99:>13}"
            )
    return "\n".join(lines)


def _medians(rows: list[Round]) -> dict[str, float]:
    if not rows:
        return {"p50": 0.0, "p99": 0.0, "rps": 0.0, "cpu": 0.0}
    return {
        "p50": statistics.median(r.p50_ms for r in rows),
        "p99": statistics.median(r.p99_ms for r in rows),
        "rps": statistics.median(r.rps for r in rows),
        "cpu": statistics.median(r.cpu_ms_per_req for r in rows),
    }
