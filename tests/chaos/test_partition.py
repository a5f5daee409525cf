"""Network partition (issue 9): instances behind a cut link are routed around, then rejoin.

Real processes on both sides of a real veth pair. The root namespace runs the orchestrator and a 1P1D
set of agents and simulated engines (``outer-*``); a private namespace runs another 1P1D set
(``inner-*``), whose engines listen on the namespace's address so that the gateway reaches them across
the veth, and whose agents reach the orchestrator's ZeroMQ endpoint across it too. Every engine
listens on an address of the veth /30, not on loopback: a decoder pulls KV from its prefiller's engine
(the simulated engine's side channel), and a pair may straddle the link. Nothing leaves the machine:
the root end's address is local, the inner one exists only inside the namespace.

The cut is silent (see ``netns_support``): nobody sees an error, connections just stop moving.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.chaos.netns_support import NetnsLink, netns_link
from tests.helpers import ADMIN, cli_argv, eventually, eventually_sync, free_port
from vllm_disagg import jsonutil
from vllm_disagg.cli.up import stop_processes
from vllm_disagg.runtime import die_with_parent
from vllm_disagg.sim_engine.textgen import expected_text

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")

MODEL = "sim-model"
OUTER = ("outer-prefill", "outer-decode")
INNER = ("inner-prefill", "inner-decode")
INNER_ENGINE_PORTS = {"inner-prefill": 8100, "inner-decode": 8101}  # the namespace's own port space
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 1.0  # fast detection, as the issue asks
IDLE_TIMEOUT_S = 8.0  # the gateway fails a leg silent this long (a stream stuck behind the cut)
DECODE_STEP_S = 0.05
LOAD_TOKENS = 40  # ~2 s streams at DECODE_STEP_S: some are always in flight when the link is cut
REJOIN_TOKENS = 8
LOAD_WORKERS = 4
LOAD_MAX_REQUESTS = 300  # the whole load phase, whatever happens
CLIENT_TIMEOUT_S = 45.0  # the bound on "every request ends": IDLE_TIMEOUT_S plus room for retries
AFTER_DETECTION = 12  # requests admitted after detection that must all succeed
READY_TIMEOUT_S = 120.0  # eight Python processes starting on a busy 2-core machine
DETECT_TIMEOUT_S = 20.0
REJOIN_TIMEOUT_S = 60.0  # TCP retransmits back off while cut: the first after restore may take seconds
REJOIN_TRAFFIC_MAX_REQUESTS = 200
REJOIN_TRAFFIC_TIMEOUT_S = 90.0  # an instance's breaker may still be open from the cut
STOP_GRACE_S = 10.0


# --- the namespace itself -----------------------------------------------------------------------

ECHO_SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    conn, _ = srv.accept()
    while data := conn.recv(4096):
        conn.sendall(data)
    conn.close()
"""


@pytest.fixture
def link() -> Iterator[NetnsLink]:
    """A fresh namespace and veth pair."""
    with netns_link() as made:
        yield made


@pytest.fixture
def echo_inside(link: NetnsLink) -> Iterator[tuple[str, int]]:
    """A TCP echo server inside the namespace; its (address, port)."""
    port = 7000  # the namespace's own port space: nothing else listens there
    proc = subprocess.Popen(
        link.exec_argv([sys.executable, "-c", ECHO_SERVER, link.inner_addr, str(port)]),
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    try:
        eventually_sync(
            lambda: _connect_outcome(link.inner_addr, port) == "connected",
            timeout=30,
            what="the echo server inside the namespace",
        )
        yield link.inner_addr, port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _connect_outcome(addr: str, port: int) -> str:
    """How a TCP connect with a 1 s timeout ends: connected, refused, timeout, or the error."""
    try:
        socket.create_connection((addr, port), timeout=1.0).close()
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"error: {exc!r}"
    return "connected"


@pytest.mark.parametrize(
    ("target", "during_cut", "after_restore"),
    [
        pytest.param("inner listener", "timeout", "connected", id="a-connect-across-the-cut-just-times-out"),
        pytest.param(
            "inner closed port", "timeout", "refused", id="no-rst-across-the-cut-even-from-a-closed-port"
        ),
        pytest.param(
            "outer listener", "connected", "connected", id="the-root-ends-own-address-still-answers"
        ),
    ],
)
def test_a_cut_drops_silently_on_the_link_only(
    link: NetnsLink, echo_inside: tuple[str, int], target: str, during_cut: str, after_restore: str
) -> None:
    with socket.create_server((link.outer_addr, 0)) as outer:
        addr, port = {
            "inner listener": echo_inside,
            "inner closed port": (echo_inside[0], echo_inside[1] + 1),
            "outer listener": (link.outer_addr, outer.getsockname()[1]),
        }[target]
        link.cut()
        assert _connect_outcome(addr, port) == during_cut
        link.restore()
        eventually_sync(
            lambda: _connect_outcome(addr, port) == after_restore,
            timeout=30,
            what=f"{after_restore} after restore",
        )


def test_an_established_connection_hangs_through_a_cut_and_resumes_after_restore(
    link: NetnsLink, echo_inside: tuple[str, int]
) -> None:
    with socket.create_connection(echo_inside, timeout=10) as conn:
        conn.sendall(b"before")
        assert conn.recv(16) == b"before"
        link.cut()
        conn.sendall(b"during")  # no error: the segment is queued and retransmitted
        conn.settimeout(1.0)
        with pytest.raises(TimeoutError):  # neither an answer nor a reset
            conn.recv(16)
        link.restore()
        conn.settimeout(30.0)  # the next retransmission, after the backoff the cut caused
        assert conn.recv(16) == b"during"


# --- the cluster across the link ----------------------------------------------------------------


@dataclass
class PartitionCluster:
    """The orchestrator and four agents, two of them inside the namespace."""

    link: NetnsLink
    base: str
    logs: dict[str, Path]
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    sessions: dict[str, int] = field(default_factory=dict)  # each instance's session once all were ready

    async def instances(self, http: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        """The admin API's instances by agent id."""
        async with http.get(f"{self.base}/admin/v1/instances", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()
            body = jsonutil.loads(await resp.read())
        return {item["agent_id"]: item for item in body["instances"]}

    async def wait_states(
        self,
        http: aiohttp.ClientSession,
        want: dict[str, str],
        *,
        timeout: float,
        newer_than: dict[str, int] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Poll until each agent in ``want`` is in its state (in a session newer than ``newer_than``'s)."""
        newer = newer_than or {}

        async def probe() -> dict[str, dict[str, Any]] | None:
            items = await self.instances(http)
            matches = (
                a in items and items[a]["state"] == state and items[a]["session"] > newer.get(a, 0)
                for a, state in want.items()
            )
            return items if all(matches) else None

        found: dict[str, dict[str, Any]] = await eventually(
            probe, timeout=timeout, interval=0.05, what=f"instance states {want}"
        )
        return found

    def log_tails(self, lines: int = 40) -> str:
        """The end of every child's log, for a failure message."""
        out = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace").splitlines() if path.exists() else []
            out.append(f"--- {name} ({path}) ---\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


async def _spawn(argv: list[str], log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _agent_argv(agent_id: str, role: str, zmq: str, host: str, port: int) -> list[str]:
    return cli_argv(
        "agent", "--engine", "sim", "--role", role, "--agent-id", agent_id, "--orchestrator", zmq,
        "--model", MODEL, "--engine-host", host, "--engine-port", str(port),
        "--health-timeout-s", "2", "--decode-step-s", str(DECODE_STEP_S),
    )  # fmt: skip


@pytest.fixture
async def cluster(link: NetnsLink, tmp_path: Path) -> AsyncIterator[PartitionCluster]:
    """Everything started and ready; stopped (and the namespace emptied) however the test ends."""
    http_port, zmq_port = free_port(), free_port()
    zmq = f"tcp://{link.outer_addr}:{zmq_port}"
    names = ("orchestrator", *OUTER, *INNER)
    running = PartitionCluster(
        link, f"http://127.0.0.1:{http_port}", {n: tmp_path / f"{n}.log" for n in names}
    )
    orchestrator = cli_argv(
        "orchestrator", "--host", "127.0.0.1", "--port", str(http_port), "--zmq-endpoint", zmq,
        "--insecure-agents",  # agents in network namespaces, without keys: the partition is the subject
        "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
        "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
        "--connect-timeout-s", "2", "--idle-timeout-s", str(IDLE_TIMEOUT_S), "--no-preload-tokenizer-libs",
    )  # fmt: skip
    try:
        running.procs["orchestrator"] = await _spawn(orchestrator, running.logs["orchestrator"])
        for agent_id in OUTER:
            role = agent_id.split("-")[1]
            argv = _agent_argv(agent_id, role, zmq, link.outer_addr, free_port())
            running.procs[agent_id] = await _spawn(argv, running.logs[agent_id])
        for agent_id in INNER:
            role = agent_id.split("-")[1]
            argv = link.exec_argv(
                _agent_argv(agent_id, role, zmq, link.inner_addr, INNER_ENGINE_PORTS[agent_id])
            )
            running.procs[agent_id] = await _spawn(argv, running.logs[agent_id])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            try:
                items = await running.wait_states(
                    http, dict.fromkeys(names[1:], "ready"), timeout=READY_TIMEOUT_S
                )
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{running.log_tails()}") from None
        running.sessions = {a: items[a]["session"] for a in names[1:]}
        yield running
    finally:
        agents = [p for n, p in running.procs.items() if n != "orchestrator"]
        await stop_processes(agents, STOP_GRACE_S)
        if "orchestrator" in running.procs:
            await stop_processes([running.procs["orchestrator"]], STOP_GRACE_S)
        print(running.log_tails())  # shown by pytest only when the test failed


@dataclass
class Outcome:
    """One request through the gateway and how it ended."""

    request_id: str
    prompt: str
    max_tokens: int
    sent_at: float
    ended_at: float | None = None
    status: int | None = None
    prefill: str = ""
    decode: str = ""
    text: str = ""
    done: bool = False  # the stream ended with ``data: [DONE]``
    error: str = ""
    record: dict[str, Any] | None = None  # the gateway's record of it, fetched for the report

    @property
    def ok(self) -> bool:
        """A complete stream with exactly the simulated engine's text."""
        want = expected_text(self.prompt, self.max_tokens)
        return self.status == 200 and self.done and not self.error and self.text == want

    def routed(self, agents: tuple[str, ...]) -> bool:
        """Whether its response says either leg ran on one of ``agents``."""
        return self.prefill in agents or self.decode in agents

    def describe(self) -> str:
        """One line for a report or a failure message."""
        took = f"{self.ended_at - self.sent_at:.2f}s" if self.ended_at is not None else "not ended"
        verdict = (
            "ok" if self.ok else f"FAILED ({self.error or ('wrong text' if self.done else 'no [DONE]')})"
        )
        route = f"P={self.prefill or '-'} D={self.decode or '-'}"
        extra = ""
        if self.record:
            attempts = [f"{a['leg']}@{a['instance']}:{a['outcome']}" for a in self.record.get("attempts", [])]
            extra = f" attempts={attempts} resumes={self.record.get('resumes', 0)}"
            if self.record.get("fallback"):
                extra += f" fallback={self.record['fallback']!r}"
        return f"{self.request_id}: status={self.status} {route} {verdict} in {took}{extra}"


async def send(http: aiohttp.ClientSession, base: str, outcome: Outcome) -> Outcome:
    """Stream one completion and record everything about how it ended; never raises for the request."""
    body = {"model": MODEL, "prompt": outcome.prompt, "max_tokens": outcome.max_tokens, "stream": True}
    headers = {"Content-Type": "application/json", "X-Request-Id": outcome.request_id}
    raw = b""
    try:
        async with http.post(f"{base}/v1/completions", data=jsonutil.dumps(body), headers=headers) as resp:
            outcome.status = resp.status
            outcome.prefill = resp.headers.get("X-Disagg-Prefill", "")
            outcome.decode = resp.headers.get("X-Disagg-Decode", "")
            raw = await resp.read()
    except TimeoutError:
        outcome.error = f"client timeout: no end within {CLIENT_TIMEOUT_S:g}s"
    except (aiohttp.ClientError, OSError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended_at = time.monotonic()
    events = [line[6:] for line in raw.decode(errors="replace").split("\n") if line.startswith("data: ")]
    outcome.done = bool(events) and events[-1] == "[DONE]"
    for event in events:
        try:
            parsed = json.loads(event)
        except ValueError:
            continue
        if isinstance(parsed, dict) and "error" in parsed:
            outcome.error = outcome.error or f"error event: {parsed['error']}"
        for choice in parsed.get("choices", []) if isinstance(parsed, dict) else []:
            outcome.text += choice.get("text", "")
    if outcome.status is not None and outcome.status != 200 and not outcome.error:
        outcome.error = f"HTTP {outcome.status}: {raw[:200]!r}"
    return outcome


def _prompt(tag: str, n: int) -> str:
    # Distinct prompts, longer than a KV block: every request pulls KV, none rides a cached prefix.
    return f"Partition {tag} request {n}: does the gateway route around a link that went silent?"


class Load:
    """A few concurrent streams, bounded in count; each worker finishes its request when stopped."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http = http
        self.base = base
        self.outcomes: list[Outcome] = []

    def active(self) -> list[Outcome]:
        """Requests sent and not yet ended."""
        return [o for o in self.outcomes if o.ended_at is None]

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop`` or ``LOAD_MAX_REQUESTS``."""

        async def worker() -> None:
            while not stop.is_set() and len(self.outcomes) < LOAD_MAX_REQUESTS:
                n = len(self.outcomes)
                outcome = Outcome(f"part-load-{n}", _prompt("load", n), LOAD_TOKENS, time.monotonic())
                self.outcomes.append(outcome)
                await send(self.http, self.base, outcome)

        await asyncio.gather(*(worker() for _ in range(LOAD_WORKERS)))


async def _attach_records(http: aiohttp.ClientSession, base: str, outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        async with http.get(f"{base}/admin/v1/requests/{outcome.request_id}", headers=ADMIN) as resp:
            if resp.status == 200:
                outcome.record = jsonutil.loads(await resp.read())


@pytest.mark.slow
async def test_a_partitioned_pair_is_routed_around_and_rejoins(
    cluster: PartitionCluster, record_property: Callable[[str, object], None]
) -> None:
    base = cluster.base
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        load = Load(http, base)
        stop = asyncio.Event()
        load_task = asyncio.create_task(load.run(stop))
        try:
            # 1. A stream is decoding on the far side of the link when it is cut.
            await eventually(
                lambda: any(o.decode == "inner-decode" for o in load.active()),
                timeout=60,
                what="a stream in flight on inner-decode",
            )
            cluster.link.cut()
            cut_at = time.monotonic()
            in_flight_at_cut = load.active()

            # 2. The registry declares the inner instances dead.
            items = await cluster.wait_states(http, dict.fromkeys(INNER, "dead"), timeout=DETECT_TIMEOUT_S)
            detected_at = time.monotonic()
            assert {a: items[a]["state"] for a in OUTER} == dict.fromkeys(OUTER, "ready")

            # 3. Requests admitted from now on are served by the outer pair.
            await eventually(
                lambda: (
                    sum(o.sent_at > detected_at and o.ended_at is not None for o in load.outcomes)
                    >= AFTER_DETECTION
                ),
                timeout=90,
                what=f"{AFTER_DETECTION} requests admitted after detection",
            )
        finally:
            stop.set()
            await asyncio.wait_for(load_task, CLIENT_TIMEOUT_S + 15)  # each request is bounded itself

        after = [o for o in load.outcomes if o.sent_at > detected_at]
        lost = [o.describe() for o in after if not o.ok or o.routed(INNER)]
        assert not lost, "requests admitted after detection failed or went to a dead instance:\n" + "\n".join(
            lost
        )

        # What was in flight at the cut, or sent before detection, is recorded, not judged: it must only end.
        in_the_gap = [o for o in load.outcomes if cut_at <= o.sent_at <= detected_at]
        await _attach_records(http, base, in_flight_at_cut + in_the_gap)
        report = {
            "in_flight_at_cut": [o.describe() for o in in_flight_at_cut],
            "sent_between_cut_and_detection": [o.describe() for o in in_the_gap],
        }
        record_property("detection_s", round(detected_at - cut_at, 3))
        for name, lines in report.items():
            record_property(name, lines)
            print(f"{name} (detected {detected_at - cut_at:.2f}s after the cut):", *lines, sep="\n  ")
        hung = [
            o.describe() for o in load.outcomes if o.ended_at is None or o.error.startswith("client timeout")
        ]
        assert not hung, "requests that did not end within the bound:\n" + "\n".join(hung)

        # 4. The link heals: the inner instances come back with new sessions and serve again.
        cluster.link.restore()

        items = await cluster.wait_states(
            http, dict.fromkeys(INNER, "ready"), timeout=REJOIN_TIMEOUT_S, newer_than=cluster.sessions
        )
        record_property("sessions_after_rejoin", {a: items[a]["session"] for a in INNER})

        served: set[str] = set()
        rejoin: list[Outcome] = []
        deadline = time.monotonic() + REJOIN_TRAFFIC_TIMEOUT_S
        while not set(INNER) <= served:
            assert len(rejoin) < REJOIN_TRAFFIC_MAX_REQUESTS and time.monotonic() < deadline, (
                f"the inner instances got no traffic after rejoining (served by: {sorted(served)})"
            )
            batch = [
                Outcome(f"part-rejoin-{n}", _prompt("rejoin", n), REJOIN_TOKENS, time.monotonic())
                for n in range(len(rejoin), len(rejoin) + LOAD_WORKERS)
            ]
            rejoin += await asyncio.gather(*(send(http, base, o) for o in batch))
            served |= {o.prefill for o in rejoin if o.ok} | {o.decode for o in rejoin if o.ok}
        failed = [o.describe() for o in rejoin if not o.ok]
        assert not failed, "requests after the rejoin failed:\n" + "\n".join(failed)
