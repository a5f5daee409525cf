"""Gateway workers: two gateway processes on one port, one scheduler state.

A real orchestrator with ``gateway_workers=2`` starts a real worker process; the kernel spreads new
connections over the two (SO_REUSEPORT). Every request below comes on a connection of its own, so
with 24 of them both processes serve some (each lands on one of two listeners: all on one has a
chance of 2**-23). Sim engines, fake agents, real sockets.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, eventually, free_port
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config, sample, scrape
from vllm_disagg.config import SimTiming
from vllm_disagg.orchestrator.app import GATEWAY_KEY, WORKERS_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import KvEvent, KvEvents, Role
from vllm_disagg.sim_engine.textgen import expected_text, tokenize

pytestmark = pytest.mark.timeout(300)

PROMPT = "Two gateway processes share one port and one view of the cluster: this prompt is cached. " * 2
N = 24
BLOCK = 16  # the sim's block size


@pytest.fixture
async def orch() -> AsyncIterator[OrchestratorServer]:
    # No tokenizer-library preload: the sim's tokens are bytes, and the worker starts in a second.
    config = orch_config(gateway_workers=2, preload_tokenizer_libs=False, breaker_failures=1)
    server = await start_orchestrator(config, shutdown_timeout_s=2.0)
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def agents(orch: OrchestratorServer) -> AsyncIterator[list[FakeAgent]]:
    made: list[FakeAgent] = []
    yield made
    for agent in made:
        await agent.close()


async def join(
    orch: OrchestratorServer, agents: list[FakeAgent], agent_id: str, url: str, role: Role
) -> FakeAgent:
    agent = FakeAgent(orch.zmq_endpoint, agent_id, url, role)
    agents.append(agent)
    await agent.join()
    return agent


async def one(url: str, request_id: str, max_tokens: int = 4, stream: bool = False) -> tuple[int, str, str]:
    """One request on a connection of its own: (status, the prefill instance, the body)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http,
        http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp,
    ):
        return resp.status, resp.headers.get("X-Disagg-Prefill", ""), await resp.text()


async def per_worker_requests(http: aiohttp.ClientSession, url: str, total: int) -> dict[str, float]:
    """Requests counted by each process, once ``/metrics`` has every process's (a worker that does not
    answer in 2 s, as on a machine that froze, is left out of one scrape: the next one is asked)."""

    async def counted() -> dict[str, float] | None:
        samples = await scrape(http, url)
        served = {w: sample(samples, "vllm_disagg_requests_total", worker=w) for w in ("0", "1")}
        return served if sum(served.values()) == total else None

    return await eventually(counted, interval=0.2, what=f"{total} requests in /metrics")


async def admin_json(http: aiohttp.ClientSession, url: str) -> Any:
    """An admin answer, asked again while it is a 404 (a worker's answer may miss one ask, as above)."""

    async def answered() -> Any:
        async with http.get(url, headers=ADMIN) as resp:
            if resp.status == 404:
                return None
            assert resp.status == 200, await resp.text()
            return await resp.json()

    return await eventually(answered, interval=0.2, what=url)


async def cached_on_p1(orch: OrchestratorServer, agents: list[FakeAgent], engine: EngineFactory) -> None:
    """2P1D where only p1 caches PROMPT (its agent says so with KV events): the prefix scorer
    sends PROMPT to p1 in any process that knows the KV index."""
    p0, p1, d0 = await engine(), await engine(), await engine()
    await join(orch, agents, "p0", p0.url, "prefill")
    p1_agent = await join(orch, agents, "p1", p1.url, "prefill")
    await join(orch, agents, "d0", d0.url, "decode")
    ids = tokenize(PROMPT)
    blocks = len(ids) // BLOCK
    stored = KvEvent("stored", list(range(1, blocks + 1)), None, ids[: blocks * BLOCK], BLOCK)
    p1_agent.transport.send(KvEvents(seq=1, events=[stored]))

    def ready() -> bool:
        snap = orch.registry.snapshot()
        return len(snap.ready_prefill.get(MODEL, ())) == 2 and bool(snap.ready_decode.get(MODEL))

    await eventually(ready, what="2P1D ready")
    await eventually(lambda: orch.kv_index.blocks_of("p1") == blocks, what="p1's blocks indexed")


async def test_two_processes_serve_one_port_with_one_state_and_one_admin_view(
    orch: OrchestratorServer,
    agents: list[FakeAgent],
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
) -> None:
    await cached_on_p1(orch, agents, sim_engine)
    answers = await asyncio.gather(*(one(orch.url, f"w-{i}") for i in range(N)))
    for status, prefill, text in answers:
        assert status == 200, text
        assert prefill == "p1", "each process routes by the same KV index"
        assert expected_text(PROMPT, 4) in text
    served = await per_worker_requests(http, orch.url, N)  # /metrics: one view, each process labelled
    assert served["0"] > 0 and served["1"] > 0, served
    for i in range(N):  # each process keeps its records; the admin API finds each, whoever asks
        assert (await admin_json(http, f"{orch.url}/admin/v1/requests/w-{i}"))["prefill"] == "p1"

    async def all_listed() -> list[str] | None:
        async with http.get(f"{orch.url}/admin/v1/requests?limit={N}", headers=ADMIN) as resp:
            ids = sorted(r["client_request_id"] for r in (await resp.json())["requests"])
        return ids if len(ids) == N else None

    listed = await eventually(all_listed, interval=0.2, what="every process's records listed")
    assert listed == sorted(f"w-{i}" for i in range(N)), "the newest of every process"
    async with http.get(f"{orch.url}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{orch.url}/admin/v1/instances", headers={"Authorization": "Bearer wrong"}) as resp:
        assert resp.status == 401, "the admin API's guard holds on every process's connections"


async def test_requests_in_flight_in_every_process_reach_the_scheduler_state(
    orch: OrchestratorServer,
    agents: list[FakeAgent],
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
) -> None:
    # A slow decode engine holds every request far longer than the test looks (1,000 steps of 0.1 s),
    # however slowly a loaded machine sends them: all N are in flight at once, until their clients go.
    p, d = await sim_engine(), await sim_engine(timing=SimTiming(decode_step_s=0.1, max_num_seqs=64))
    await join(orch, agents, "p0", p.url, "prefill")
    await join(orch, agents, "d0", d.url, "decode")
    await eventually(lambda: bool(orch.registry.snapshot().ready_decode.get(MODEL)), what="1P1D ready")
    sent = [asyncio.create_task(one(orch.url, f"slow-{i}", max_tokens=1000, stream=True)) for i in range(N)]
    try:
        await eventually(lambda: orch.registry.snapshot().in_flight_of("d0") == N, what=f"{N} in flight")

        async def all_live() -> list[dict[str, Any]] | None:
            async with http.get(f"{orch.url}/admin/v1/live-requests", headers=ADMIN) as resp:
                live: list[dict[str, Any]] = (await resp.json())["requests"]
            return live if len(live) == N else None

        live = await eventually(all_live, interval=0.2, what=f"{N} live requests listed")
        assert sorted(r["client_request_id"] for r in live) == sorted(f"slow-{i}" for i in range(N))
        assert any(r.get("worker") == 1 for r in live), "the worker's live requests are listed"
    finally:
        for task in sent:  # the clients leave: every process releases what it held
            task.cancel()
        await asyncio.gather(*sent, return_exceptions=True)
    await eventually(lambda: orch.registry.snapshot().in_flight_of("d0") == 0, what="all released")


async def test_a_killed_worker_is_restarted_with_the_whole_state_and_serves_again(
    orch: OrchestratorServer,
    agents: list[FakeAgent],
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
) -> None:
    await cached_on_p1(orch, agents, sim_engine)
    hub = orch.app[WORKERS_KEY]
    (before,) = hub.describe()
    os.kill(before["pid"], signal.SIGKILL)

    def restarted() -> bool:
        (now,) = hub.describe()
        return bool(now["pid"] != before["pid"] and now["serving"] and now["restarts"] == 1)

    await eventually(restarted, timeout=60, what="the worker restarted and serving")
    answers = await asyncio.gather(*(one(orch.url, f"again-{i}") for i in range(N)))
    assert [(status, prefill) for status, prefill, _ in answers] == [(200, "p1")] * N, (
        "the new worker knows the instances and the KV index it never saw change"
    )

    async def counted_by_new_worker() -> bool:
        samples = await scrape(http, orch.url)
        return sample(samples, "vllm_disagg_requests_total", worker="1") > 0

    await eventually(counted_by_new_worker, interval=0.2, what="the new worker's requests in /metrics")
    assert any(e.kind == "gateway_worker_restarted" for e in orch.app[GATEWAY_KEY].events.since(0))


async def test_a_failing_engine_opens_its_breaker_from_any_process_and_no_request_fails(
    orch: OrchestratorServer,
    agents: list[FakeAgent],
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
) -> None:
    p, d = await sim_engine(), await sim_engine()
    await join(orch, agents, "p0", p.url, "prefill")
    await join(orch, agents, "d0", d.url, "decode")
    dead = await sim_engine()
    await join(orch, agents, "d1", dead.url, "decode")
    await eventually(lambda: len(orch.registry.snapshot().ready_decode.get(MODEL, ())) == 2, what="1P2D")
    await dead.close()  # d1's agent still says ready: only the legs can tell
    answers = await asyncio.gather(*(one(orch.url, f"b-{i}") for i in range(N)))
    assert [status for status, _, _ in answers] == [200] * N
    view = orch.registry.get("d1")
    assert view is not None and view.breaker.state != "closed"


async def test_every_other_path_answers_alike_on_any_process_streams_included(
    orch: OrchestratorServer, agents: list[FakeAgent], sim_engine: EngineFactory
) -> None:
    """Each ask on a connection of its own: about half land on the worker, which proxies them (an SSE
    stream as it comes). A proxy that broke any of them would fail some of the 12 tries."""
    p, d = await sim_engine(), await sim_engine()
    await join(orch, agents, "p0", p.url, "prefill")
    await join(orch, agents, "d0", d.url, "decode")
    await eventually(lambda: bool(orch.registry.snapshot().ready_decode.get(MODEL)), what="1P1D ready")
    for _ in range(12):
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            async with http.get(f"{orch.url}/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
            async with http.get(f"{orch.url}/dashboard") as resp:
                assert resp.status == 200 and "text/html" in resp.headers["Content-Type"]
            async with http.post(f"{orch.url}/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
            async with http.get(f"{orch.url}/admin/v1/events?since=0", headers=ADMIN) as resp:
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
                assert first.startswith(b"id: 1\nevent: joined\n"), first


async def test_tenants_weights_reach_the_worker_and_the_admission_view_counts_both_processes(
    orch: OrchestratorServer,
    agents: list[FakeAgent],
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
) -> None:
    url = f"{orch.url}/admin/v1/admission"

    def weights_everywhere(expected: dict[str, float]) -> Callable[[], Awaitable[list[Any] | None]]:
        async def probe() -> list[Any] | None:
            processes: list[Any] = (await admin_json(http, url))["processes"]
            return processes if [p["tenant_weights"] for p in processes] == [expected, expected] else None

        return probe

    async with http.put(f"{url}/tenants/gold", json={"weight": 4}, headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
    processes = await eventually(weights_everywhere({"gold": 4.0}), interval=0.2, what="gold=4 in both")
    assert [p["worker"] for p in processes] == [0, 1]
    async with http.delete(f"{url}/tenants/gold", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
    await eventually(weights_everywhere({}), interval=0.2, what="gold back to 1 in both")

    p, d = await sim_engine(), await sim_engine()
    await join(orch, agents, "p0", p.url, "prefill")
    await join(orch, agents, "d0", d.url, "decode")
    await eventually(lambda: bool(orch.registry.snapshot().ready_decode.get(MODEL)), what="1P1D ready")
    answers = await asyncio.gather(*(one(orch.url, f"a-{i}") for i in range(N)))
    assert [status for status, _, _ in answers] == [200] * N

    async def all_counted() -> bool:  # the kernel spread the connections: only the sum counts them all
        model = (await admin_json(http, url))["models"].get(MODEL, {})
        return bool(model.get("counts", {}).get("admitted") == N)

    await eventually(all_counted, interval=0.2, what=f"{N} admitted over both processes")


GATE = """\
import os, pathlib, time
_gate = pathlib.Path(os.environ["WORKER_GATE"])
(_gate.parent / "worker-started").touch()
while not _gate.exists():  # the test opens the gate once it has tried the port
    time.sleep(0.01)
"""


async def test_the_port_takes_no_connection_until_every_worker_serves_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the worker serves, the orchestrator only holds the port: a client that got an answer there
    (``up`` polling for readiness, a load balancer's probe) would otherwise send all its traffic to the
    one process listening. The worker is held at its interpreter's start by a ``sitecustomize``."""
    (tmp_path / "sitecustomize.py").write_text(GATE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("WORKER_GATE", str(tmp_path / "gate"))
    port = free_port()
    config = orch_config(port=port, gateway_workers=2, preload_tokenizer_libs=False)
    starting = asyncio.create_task(start_orchestrator(config, shutdown_timeout_s=2.0))
    try:
        await eventually(lambda: (tmp_path / "worker-started").exists(), what="the worker process started")
        refused = await connection_refused(port)
        still_starting = not starting.done()
    finally:
        (tmp_path / "gate").touch()
        server = await asyncio.wait_for(starting, 60)
    try:
        assert refused, "the orchestrator took a connection before its worker served"
        assert still_starting
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/health") as resp:
            body = await resp.json()  # answered: no instance has joined yet
            assert (resp.status, body["instances"]) == (503, 0), body
    finally:
        await server.close()


async def connection_refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    await writer.wait_closed()
    return False
