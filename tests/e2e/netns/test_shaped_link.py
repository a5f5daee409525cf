"""A slow P→D link on real links (issue 28): learned from measured transfers, then routed around.

Four hosts (``hosts.py``: a network namespace each on one bridge): the orchestrator on one, two prefill
agents with their simulated engines (P0, P1) on two more, a decode agent and engine (D) on the fourth.
The engines run with ``--kv-bytes-per-token``: D's KV pull from a P is an HTTP request whose answer
carries that many real bytes per prompt token, and D exports vLLM's NIXL histograms with the bytes
and seconds it measured; D's agent reports their sums in its heartbeats.

One link is made slow, P0→D, on P0's side (``shaping.py``): the pull's body flows from P0 to D, so it
is what P0 sends to D's address that is shaped (P0's other traffic, and P1→D, are not). This
machine's kernel has no netem: ``tc qdisc add dev <veth> root netem delay 10ms`` answers ``Error:
Specified qdisc kind is unknown.``. The bandwidth is therefore limited by htb (a class at
``RATE_MBIT`` and a u32 filter on D's address) and no delay is added; the test prints the error it
got.

The test is the client, in the root namespace, and sends distinct prompts of a few hundred tokens one
after another at a modest pace, streamed (TTFT: the time to the first streamed token), in three
phases:

1. P1 cordoned: every request crosses the slow link, and the orchestrator measures it. These are the
   requests the slow link hurts (a link that degraded, or a P alone, would do the same).
2. P0 cordoned: P1→D is measured too.
3. Nothing cordoned: the scheduler chooses. Asserted: the learned P0→D rate (``GET
   /admin/v1/links``) is several times below P1→D's and no faster than the shaping allows; most
   requests now pair P1 with D; their median TTFT is well below that of the requests of phase 1.

Between phases the test waits until D's heartbeats have told the orchestrator every byte D's engine
counted, so one phase's transfers never share a sample with the next's.

Only ratios are asserted, with wide margins, so a slow or loaded machine does not fail it. The shaping
rules go with P0's namespace when ``hosts`` deletes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.netns.hosts import Network, hosts, stop_groups
from tests.e2e.netns.shaping import Shaped, shape
from tests.helpers import ADMIN, cli_argv, eventually, http_json
from vllm_disagg.runtime import die_with_parent
from vllm_disagg.sim_engine.textgen import expected_text

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")

MODEL = "sim-model"
HOSTS = ("orch", "p0", "p1", "decode")
AGENTS = {"p0": ("prefill", "prefill-0"), "p1": ("prefill", "prefill-1"), "decode": ("decode", "decode-0")}
P0, P1, D = "prefill-0", "prefill-1", "decode-0"
HTTP_PORT, AGENTS_PORT, ENGINE_PORT = 8000, 5555, 8100
KV_BYTES_PER_TOKEN = 16384  # a 320-token prompt's KV: 5 MB, about 0.5 s at RATE_MBIT
PROMPT_TOKENS = 320  # the simulated tokenizer: one token per byte
MAX_TOKENS = 2
RATE_MBIT = 80
DELAY_MS = 20.0  # asked for; netem is missing here, so none is added (``Shaped.netem_error``)
PACE_S = 0.2  # a request starts at least this long after the one before
SEEDING = 4  # requests per phase while the other P is cordoned
FREE = 20  # requests the scheduler places freely
READY_S = 120.0  # seven processes on four hosts starting on a loaded 2-core machine
LEARN_S = 60.0
NIXL_BYTES_SUM = "vllm:nixl_bytes_transferred_sum"
# The bounds asserted: wide, as ratios, so a loaded machine does not fail them.
MIN_RATE_RATIO = 3.0  # P1→D learned at least this many times faster than P0→D
SHAPED_SLACK = 1.25  # P0→D learned at no more than this times the shaped rate
MIN_AROUND = 0.8  # share of the free requests paired P1→D
MAX_TTFT_RATIO = 0.5  # their median TTFT over that of the requests that crossed the slow link


@dataclass(frozen=True)
class Deployment:
    """The hosts and the file every process writes its output to."""

    net: Network
    log: Path

    def addr(self, host: str) -> str:
        return self.net[host].addr

    @property
    def base(self) -> str:
        return f"http://{self.addr('orch')}:{HTTP_PORT}"


@dataclass(frozen=True)
class Sent:
    """One request: where it went and its TTFT."""

    prefill: str
    decode: str
    ttft_s: float


def _spawn(d: Deployment, host: str, argv: list[str]) -> subprocess.Popen[bytes]:
    with d.log.open("ab") as out:
        return subprocess.Popen(
            d.net[host].exec_argv(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _orchestrator_argv() -> list[str]:
    return cli_argv(
        "orchestrator", "--host", "0.0.0.0", "--port", str(HTTP_PORT),
        "--zmq-endpoint", f"tcp://0.0.0.0:{AGENTS_PORT}", "--insecure-agents",
        "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "3.0",
        "--no-preload-tokenizer-libs",
    )  # fmt: skip


def _agent_argv(d: Deployment, host: str) -> list[str]:
    role, agent_id = AGENTS[host]
    return cli_argv(
        "agent", "--engine", "sim", "--role", role, "--agent-id", agent_id,
        "--orchestrator", f"tcp://{d.addr('orch')}:{AGENTS_PORT}", "--model", MODEL,
        "--engine-host", d.addr(host), "--engine-port", str(ENGINE_PORT),
        "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN), "--scrape-interval-s", "0.1",
    )  # fmt: skip


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    with hosts(HOSTS, loopback=HOSTS) as net:
        d = Deployment(net, tmp_path / "hosts.log")
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs.append(_spawn(d, "orch", _orchestrator_argv()))
            procs += [_spawn(d, host, _agent_argv(d, host)) for host in AGENTS]
            yield d
        finally:
            stop_groups(procs[1:])  # the agents first: they say Goodbye
            stop_groups(procs[:1])


def ready(d: Deployment) -> bool:
    status, body = http_json(f"{d.base}/admin/v1/instances", headers=ADMIN, timeout=2.0)
    states = {i["agent_id"]: i["state"] for i in body["instances"]} if status == 200 else {}
    return states == {P0: "ready", P1: "ready", D: "ready"}


def links(d: Deployment) -> dict[str, Any]:
    status, body = http_json(f"{d.base}/admin/v1/links", headers=ADMIN, timeout=2.0)
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def rates(d: Deployment) -> dict[str, float]:
    """The learned rate (Gbit/s) of each P→D link, by P."""
    return {i["prefill"]: float(i["gbps"]) for i in links(d)["links"] if i["decode"] == D}


def engine_kv_bytes(d: Deployment) -> float:
    """The KV bytes D's engine has pulled in so far (vLLM's NIXL histogram's sum), read from D itself."""
    status, text = http_json(f"http://{d.addr('decode')}:{ENGINE_PORT}/metrics", timeout=2.0)
    assert status == 200 and isinstance(text, str), text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(NIXL_BYTES_SUM))


def reported_kv_bytes(d: Deployment) -> float:
    """The same, as D's last heartbeat told the orchestrator."""
    status, body = http_json(f"{d.base}/admin/v1/instances", headers=ADMIN, timeout=2.0)
    assert status == 200, body
    metrics = next(i["metrics"] for i in body["instances"] if i["agent_id"] == D)
    return float(metrics["kv_in_bytes"] or 0.0)


def prompt(i: int) -> str:
    """A prompt of ``PROMPT_TOKENS`` tokens, distinct from its first block on (no prefix is shared)."""
    head = f"{i:05d} {time.time_ns()} a shaped link between a prefill and a decode host. "
    return (head * (PROMPT_TOKENS // len(head) + 1))[:PROMPT_TOKENS]


async def stream(http: aiohttp.ClientSession, base: str, text: str) -> Sent:
    """One streamed completion, checked word for word; TTFT is the time to its first token."""
    started = time.monotonic()
    body = {"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS, "stream": True}
    first, out = 0.0, []
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece and not first:
                first = time.monotonic() - started
            out.append(piece)
        prefill, decode = resp.headers.get("X-Disagg-Prefill", ""), resp.headers.get("X-Disagg-Decode", "")
    assert "".join(out) == expected_text(text, MAX_TOKENS)
    assert first > 0, "no token streamed"
    return Sent(prefill, decode, first)


class Client:
    """Sends the test's requests one after another, at most one per ``PACE_S``."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.base = http, base
        self._count = 0

    async def send(self, n: int) -> list[Sent]:
        loop = asyncio.get_running_loop()
        sent: list[Sent] = []
        for _ in range(n):
            started = loop.time()
            sent.append(await stream(self.http, self.base, prompt(self._count)))
            self._count += 1
            await asyncio.sleep(max(0.0, started + PACE_S - loop.time()))  # the pace, not a wait for state
        return sent


@contextlib.asynccontextmanager
async def cordoned(http: aiohttp.ClientSession, base: str, agent_id: str) -> AsyncIterator[None]:
    """``agent_id`` takes no new request inside the block."""
    await admin_post(http, f"{base}/admin/v1/instances/{agent_id}/cordon")
    yield
    await admin_post(http, f"{base}/admin/v1/instances/{agent_id}/uncordon")


async def admin_post(http: aiohttp.ClientSession, url: str) -> None:
    async with http.post(url, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()


def report(d: Deployment, shaped: Shaped, rates: dict[str, float], slow: list[Sent], free: list[Sent]) -> str:
    """The numbers measured, for the test's output."""
    final = {i["prefill"]: f"{i['gbps']:.3f} Gbit/s ({i['samples']} samples)" for i in links(d)["links"]}
    around = sum(s.prefill == P1 for s in free) / len(free)
    slow_ms = statistics.median(s.ttft_s for s in slow) * 1e3
    free_ms = statistics.median(s.ttft_s for s in free) * 1e3
    nbytes, packets = shaped.sent()
    delay = f"{shaped.delay_ms} ms" if not shaped.netem_error else f"none ({shaped.netem_error})"
    return (
        f"shaped P0->D: htb {shaped.rate_mbit} Mbit/s, delay {delay}; {nbytes} bytes in {packets} packets\n"
        f"learned: P0->D {rates[P0]:.3f} Gbit/s, P1->D {rates[P1]:.3f} Gbit/s "
        f"({rates[P1] / rates[P0]:.1f}x); at the end: P0->D {final.get(P0)}, P1->D {final.get(P1)}\n"
        f"paired P1->D after learning: {around:.0%} of {len(free)}\n"
        f"TTFT median: {slow_ms:.0f} ms over the slow link ({len(slow)}), {free_ms:.0f} ms after "
        f"({len(free)}): ratio {free_ms / slow_ms:.2f}"
    )


async def learned(d: Deployment) -> dict[str, float]:
    """The learned rates once the orchestrator has every transfer D made so far: the next phase's
    sends then never share a sample with this one's."""
    total = engine_kv_bytes(d)
    await eventually(
        lambda: reported_kv_bytes(d) >= total,
        timeout=LEARN_S,
        interval=0.1,
        what=f"D's heartbeat with {total} bytes",
    )
    return rates(d)


async def test_a_slow_p_to_d_link_is_learned_from_measured_transfers_and_routed_around(
    deployment: Deployment,
) -> None:
    d = deployment
    await eventually(lambda: ready(d), timeout=READY_S, interval=0.2, what="P0, P1 and D ready")
    shaped = shape(d.net["p0"], d.addr("decode"), RATE_MBIT, DELAY_MS)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60.0)) as http:
        client = Client(http, d.base)
        async with cordoned(http, d.base, P1):
            slow = await client.send(SEEDING)
        assert {(s.prefill, s.decode) for s in slow} == {(P0, D)}, slow
        assert P0 in await learned(d)
        async with cordoned(http, d.base, P0):
            fast = await client.send(SEEDING)
        assert {(s.prefill, s.decode) for s in fast} == {(P1, D)}, fast
        gbps = await learned(d)
        assert {P0, P1} <= gbps.keys(), gbps
        free = await client.send(FREE)
    print(report(d, shaped, gbps, slow, free))
    assert gbps[P1] >= MIN_RATE_RATIO * gbps[P0], gbps
    assert gbps[P0] <= SHAPED_SLACK * RATE_MBIT / 1e3, gbps
    assert all(s.decode == D for s in free), free
    assert sum(s.prefill == P1 for s in free) >= MIN_AROUND * len(free), free
    slow_ttft = statistics.median(s.ttft_s for s in slow)
    assert statistics.median(s.ttft_s for s in free) < MAX_TTFT_RATIO * slow_ttft, (slow, free)
