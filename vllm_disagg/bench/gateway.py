"""``vllm-disagg bench gateway``: what the gateway adds over a client doing the P→D handoff itself.

A local 1P1D cluster of zero-delay simulated engines (real processes: orchestrator, agents, engines)
is measured two ways with the same client: *direct* (the client sends the prefill leg to P and the
decode leg to D itself, exactly as the gateway does) and *gateway* (one request to the orchestrator).
For each concurrency and stream mode it reports p50/p99 latency, requests per second, and the
orchestrator's CPU time per request (from /proc), with scheduling and metrics switched on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.compare import (
    ROUTER_PLACEHOLDERS,
    measure,
    parse_compare,
    percentile,
    render_comparison,
    run_comparison,
)
from vllm_disagg.bench.otlp_sink import OtlpSink
from vllm_disagg.cli.up import ClusterSpec, LocalCluster, fetch_instances
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.gateway.handoff import decode_body, prefill_body
from vllm_disagg.procfs import cpu_seconds
from vllm_disagg.runtime import asyncio_run

_JSON = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Scenario:
    """One measured configuration."""

    path: str  # "direct" or "gateway"
    concurrency: int
    stream: bool


@dataclass(frozen=True)
class Result:
    """Latency and throughput of one scenario."""

    path: str
    concurrency: int
    stream: bool
    requests: int
    p50_ms: float
    p99_ms: float
    rps: float
    gateway_cpu_ms_per_req: float | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench gateway``."""
    parser.add_argument("--requests", type=int, default=1000, help="measured requests per scenario")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured requests per scenario")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--prompt-chars", type=int, default=256, help="prompt length (sim: 1 token/byte)")
    parser.add_argument("--port", type=int, default=18000, help="gateway port (engines use the next ones)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="the orchestrator traces every request, exporting over OTLP/HTTP to a sink in this process",
    )
    side = parser.add_argument_group("side by side with other routers (docs/benchmarks.md)")
    side.add_argument(
        "--compare",
        nargs="*",
        metavar="NAME=CMD",
        help="measure our gateway and each router command on the same engines, rounds interleaved; "
        "placeholders: " + ", ".join("{" + k + "}" for k in ROUTER_PLACEHOLDERS),
    )
    side.add_argument("--rounds", type=int, default=3, help="rounds of every scenario on every router")
    side.add_argument(
        "--modes", nargs="+", choices=("plain", "stream"), default=["plain", "stream"], help="response kinds"
    )
    side.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="our gateway's processes (--gateway-workers of the orchestrator); CPU counts them all",
    )
    side.add_argument("--prefill", type=int, default=2, help="prefill engines")
    side.add_argument("--decode", type=int, default=2, help="decode engines")


class Client:
    """The benchmark's client: one request either through the gateway or P→D by hand."""

    def __init__(self, session: aiohttp.ClientSession, gateway: str, prefill: str, decode: str) -> None:
        self.session = session
        self.gateway = gateway
        self.prefill_url = f"{prefill}/v1/completions"
        self.decode_url = f"{decode}/v1/completions"

    async def _drain(self, resp: aiohttp.ClientResponse) -> bytes:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        return await resp.read()

    async def via_gateway(self, body: dict[str, object]) -> bytes:
        """One request through the orchestrator."""
        async with self.session.post(
            f"{self.gateway}/v1/completions", data=jsonutil.dumps(body), headers=_JSON
        ) as resp:
            return await self._drain(resp)

    async def direct(self, body: dict[str, object]) -> bytes:
        """The same request with the client doing the handoff itself, with the gateway's own bodies."""
        async with self.session.post(self.prefill_url, data=prefill_body(body), headers=_JSON) as resp:
            params = jsonutil.loads(await self._drain(resp))["kv_transfer_params"]
        async with self.session.post(
            self.decode_url, data=decode_body(dict(body), params), headers=_JSON
        ) as resp:
            return await self._drain(resp)


async def run_benchmark(args: argparse.Namespace) -> dict[str, object]:
    """Start the cluster, measure every scenario, stop the cluster; the figures as one object."""
    sink = await OtlpSink().start() if getattr(args, "tracing", False) else None
    traced = ("--otlp-traces-endpoint", sink.url, "--otel-traces-sampler", "always_on") if sink else ()
    spec = ClusterSpec(
        engine="sim",
        model="sim-model",
        port=args.port,
        zmq_port=args.port + 1,
        engine_base_port=args.port + 2,
        stop_grace_s=5.0,
        extra_orchestrator_args=traced,
    )
    cluster = LocalCluster(spec)
    try:
        await cluster.start()
        if not await cluster.wait_ready(120.0):
            raise RuntimeError("the benchmark cluster did not become ready")
        assert cluster.orchestrator is not None
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            instances = await fetch_instances(session, spec.base_url, spec.admin_token) or []
            urls = {str(i["role"]): str(i["url"]) for i in instances}
            client = Client(session, spec.base_url, urls["prefill"], urls["decode"])
            results = [
                await _scenario(client, cluster.orchestrator.pid, Scenario(path, c, stream), args)
                for c in args.concurrency
                for stream in (False, True)
                for path in ("direct", "gateway")
            ]
    finally:
        await cluster.stop()
        if sink is not None:
            await sink.close()
    report = summarise(results, args)
    if sink is not None:
        report["tracing"] = {"exports": sink.exports, "bytes": sink.bytes}
    return report


async def _scenario(client: Client, gateway_pid: int, scenario: Scenario, args: argparse.Namespace) -> Result:
    body: dict[str, object] = {
        "model": "sim-model",
        "prompt": ("bench " * args.prompt_chars)[: args.prompt_chars],
        "max_tokens": args.max_tokens,
        "stream": scenario.stream,
    }
    send = client.via_gateway if scenario.path == "gateway" else client.direct
    await measure(lambda: send(body), scenario.concurrency, args.warmup)
    cpu0 = cpu_seconds(gateway_pid)
    latencies, wall = await measure(lambda: send(body), scenario.concurrency, args.requests)
    cpu = cpu_seconds(gateway_pid) - cpu0
    return Result(
        path=scenario.path,
        concurrency=scenario.concurrency,
        stream=scenario.stream,
        requests=len(latencies),
        p50_ms=statistics.median(latencies) * 1e3,
        p99_ms=percentile(latencies, 0.99) * 1e3,
        rps=len(latencies) / wall,
        gateway_cpu_ms_per_req=cpu * 1e3 / len(latencies) if scenario.path == "gateway" else None,
    )


def summarise(results: list[Result], args: argparse.Namespace) -> dict[str, object]:
    """Pair each gateway scenario with its direct twin: added latency and throughput ratio."""
    by_key = {(r.path, r.concurrency, r.stream): r for r in results}
    added = []
    for (path, c, stream), gw in by_key.items():
        if path != "gateway":
            continue
        direct = by_key[("direct", c, stream)]
        added.append(
            {
                "concurrency": c,
                "stream": stream,
                "added_p50_ms": gw.p50_ms - direct.p50_ms,
                "added_p99_ms": gw.p99_ms - direct.p99_ms,
                "rps_gateway": gw.rps,
                "rps_direct": direct.rps,
                "gateway_cpu_ms_per_req": gw.gateway_cpu_ms_per_req,
            }
        )
    return {
        "benchmark": "gateway",
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "prompt_chars": args.prompt_chars,
        "results": [asdict(r) for r in results],
        "added": added,
    }


def render_table(report: dict[str, object]) -> str:
    """The report as a fixed-width table."""
    results = {(r.path, r.concurrency, r.stream): r for r in _results_of(report)}
    lines = [
        f"gateway benchmark: 1P1D zero-delay sim, {report['requests']} requests/scenario, "
        f"{report['max_tokens']} output tokens",
        f"{'conc':>5} {'stream':>6} {'direct p50':>11} {'gw p50':>9} {'added p50':>10} {'added p99':>10} "
        f"{'direct rps':>11} {'gw rps':>8} {'gw cpu/req':>11}",
    ]
    for (path, c, stream), gw in results.items():
        if path != "gateway":
            continue
        direct = results[("direct", c, stream)]
        cpu = gw.gateway_cpu_ms_per_req or 0.0
        lines.append(
            f"{c:>5} {'yes' if stream else 'no':>6} {direct.p50_ms:>9.3f}ms {gw.p50_ms:>7.3f}ms "
            f"{gw.p50_ms - direct.p50_ms:>8.3f}ms {gw.p99_ms - direct.p99_ms:>8.3f}ms "
            f"{direct.rps:>11.0f} {gw.rps:>8.0f} {cpu:>9.3f}ms"
        )
    tracing = report.get("tracing")
    if isinstance(tracing, dict):
        lines.append(
            f"tracing on: every request traced, {tracing['exports']} OTLP exports, {tracing['bytes']:,} bytes"
        )
    return "\n".join(lines)


def _results_of(report: dict[str, object]) -> list[Result]:
    raw = report["results"]
    assert isinstance(raw, list)
    return [Result(**r) for r in raw]


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (``--compare``: side by side) and print a table, or JSON with ``--json``."""
    if args.compare is not None:
        try:
            compared = [parse_compare(item) for item in args.compare]
        except ConfigError as exc:
            print(f"vllm-disagg bench gateway: {exc}", file=sys.stderr)
            return 2
        report = asyncio_run(run_comparison(args, compared))
        print(jsonutil.dumps(report).decode() if args.json else render_comparison(report), file=sys.stdout)
        return 0
    report = asyncio_run(run_benchmark(args))
    print(jsonutil.dumps(report).decode() if args.json else render_table(report), file=sys.stdout)
    return 0
