"""KV pools through the gateway: real orchestrator, real ZeroMQ, real agent sessions whose ``kv_plane``
is a recording fake, and simulated engines (the prefill one answers with the project's connector's
handle, as an engine launched with ``--kv-connector vllm-disagg`` does).

- A P→D request between ``vllm-disagg`` instances makes the orchestrator send ``kv_grant`` to P's
  agent, then ``kv_fetch`` to D's, with the prompt's block keys, one token, and each other's endpoint
  and (with agent keys) public key; a fetch that fails, or an agent too old for the commands, still
  serves the request and is counted by reason.
- A prompt some agent's pool holds whole goes straight to D: no prefill leg, and D's agent fetches the
  blocks from the holder first; the holder's entries go when its session ends.
- In a gateway worker process the same, through the orchestrator's control plane.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator_support import FakeAgent, orch_config, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.agent.kv.plane import FetchStarted
from vllm_disagg.agent.session import AgentSession
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.model.sim import tokenize
from vllm_disagg.orchestrator.app import GATEWAY_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.curve import ClientCurve, load_keypair, load_public, make_keypair
from vllm_disagg.protocol.messages import InstanceInfo, KvEvent, KvEvents, MetricsSnapshot, Role
from vllm_disagg.protocol.transport import DealerTransport
from vllm_disagg.sim_engine.engine import SimServer, start_engine
from vllm_disagg.wire.block_hash import event_hash, prompt_block_hashes

MODEL = "sim-model"
BLOCK = 16
PROMPT = "A document that the prefill engine saves in its agent's pool, block by block; " * 3
IDS = tokenize(PROMPT)
KEYS = prompt_block_hashes(IDS, BLOCK)  # every full block of the prompt
GRANT_TTL_S = 30.0  # KvMoveSettings' default


@dataclass
class Log:
    """Every call any agent's plane got, in order across agents."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)


class RecordingPlane:
    """A ``KvPlane`` that records grants and fetches; ``fetch_error`` makes its fetches fail."""

    def __init__(self, agent_id: str, endpoint: str, log: Log) -> None:
        self.agent_id = agent_id
        self._endpoint = endpoint
        self.log = log
        self.fetch_error: Exception | None = None
        self.held: int | None = None  # how many leading blocks a grant finds (None: all it names)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def grant(self, token: str, keys: Sequence[bytes], peer_public_key: bytes | None, ttl_s: float) -> int:
        self.log.calls.append(("grant", self.agent_id, token, list(keys), peer_public_key, ttl_s))
        return len(keys) if self.held is None else min(self.held, len(keys))

    async def fetch(
        self,
        endpoint: str,
        peer_public_key: bytes | None,
        token: str,
        keys: Sequence[bytes],
        timeout_s: float,
    ) -> FetchStarted:
        self.log.calls.append(("fetch", self.agent_id, endpoint, peer_public_key, token, list(keys)))
        if self.fetch_error is not None:
            raise self.fetch_error
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        done.set_result(len(keys))
        return FetchStarted(requested=len(keys), already_held=0, reserved=len(keys), done=done)


@dataclass
class Agent:
    session: AgentSession
    plane: RecordingPlane
    transport: DealerTransport
    task: asyncio.Task[Any]
    public_key: bytes | None


@dataclass
class PoolCluster:
    """One orchestrator, and agents with a pool each (``add``); closed at the end."""

    server: OrchestratorServer
    keys_dir: Path | None
    log: Log = field(default_factory=Log)
    agents: dict[str, Agent] = field(default_factory=dict)
    engines: list[SimServer] = field(default_factory=list)

    async def add(self, agent_id: str, role: Role, *, pool_handle: bool = False) -> Agent:
        """A sim engine (answering prefill legs with the pool handle when ``pool_handle``) and its agent."""
        engine = await start_engine(
            SimEngineConfig(port=0, model=MODEL, timing=SimTiming(block_size=BLOCK)),
            kv_connector="vllm-disagg" if pool_handle else "",
        )
        self.engines.append(engine)
        endpoint = f"tcp://127.0.0.1:{11000 + len(self.agents)}"
        info = InstanceInfo(
            url=engine.url,
            role=role,
            model=MODEL,
            engine="sim",
            block_size=BLOCK,
            kv_connector="vllm-disagg",
            kv_pool_endpoint=endpoint,
        )
        curve, public = None, None
        if self.keys_dir is not None:
            curve = ClientCurve(
                load_keypair(str(self.keys_dir / "agents" / f"{agent_id}.key_secret")),
                load_public(str(self.keys_dir / "orchestrator.key")),
            )
            public = curve.keys.public
        transport = DealerTransport(self.server.zmq_endpoint, curve=curve)
        plane = RecordingPlane(agent_id, endpoint, self.log)
        session = AgentSession(
            transport,
            agent_id,
            info,
            engine_state=lambda: "ready",
            metrics=MetricsSnapshot,
            heartbeat_interval_s=0.1,
            kv_plane=plane,
        )
        agent = Agent(session, plane, transport, asyncio.create_task(session.run()), public)
        self.agents[agent_id] = agent
        await eventually(
            lambda: (v := self.server.registry.get(agent_id)) is not None and v.state == "ready",
            what=f"{agent_id} ready",
        )
        return agent

    async def close(self) -> None:
        for agent in self.agents.values():
            agent.task.cancel()
            await asyncio.gather(agent.task, return_exceptions=True)
            agent.transport.close()
        for engine in self.engines:
            await engine.close()
        await self.server.close()


@pytest.fixture(params=["without agent keys", "with agent keys"])
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[PoolCluster]:
    keys: dict[str, Any] = {}
    keys_dir = None
    if request.param == "with agent keys":
        keys_dir = tmp_path
        make_keypair(tmp_path, "orchestrator")
        for agent_id in ("p0", "d0"):
            make_keypair(tmp_path / "agents", agent_id)
        keys = {
            "curve_secret_key_file": str(tmp_path / "orchestrator.key_secret"),
            "agent_keys_dir": str(tmp_path / "agents"),
        }
    server = await start_orchestrator(
        orch_config(preload_tokenizer_libs=False, **keys), shutdown_timeout_s=2.0
    )
    pool = PoolCluster(server, keys_dir)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def complete(http: aiohttp.ClientSession, url: str, request_id: str) -> tuple[int, dict[str, str]]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def attempts(http: aiohttp.ClientSession, url: str, request_id: str) -> list[tuple[str, str, str]]:
    async with http.get(f"{url}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
        assert resp.status == 200, await resp.text()
        record = jsonutil.loads(await resp.read())
    return [(a["leg"], a["instance"], a["outcome"]) for a in record["attempts"]]


async def test_a_prefill_between_pool_instances_has_d_fetch_the_blocks_from_ps_pool_before_decoding(
    cluster: PoolCluster, http: aiohttp.ClientSession
) -> None:
    p0 = await cluster.add("p0", "prefill", pool_handle=True)
    d0 = await cluster.add("d0", "decode")
    status, headers = await complete(http, cluster.server.url, "pd-1")
    assert status == 200
    assert (headers["X-Disagg-Mode"], headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"]) == (
        "disaggregated",
        "p0",
        "d0",
    )
    grant, fetch = cluster.log.calls
    assert grant == ("grant", "p0", grant[2], KEYS, d0.public_key, GRANT_TTL_S)
    assert fetch == ("fetch", "d0", p0.plane.endpoint, p0.public_key, grant[2], KEYS)
    assert len(grant[2]) >= 16, "a random token"
    assert await attempts(http, cluster.server.url, "pd-1") == [
        ("prefill", "p0", "ok"),
        ("kv_fetch", "d0", "ok"),
        ("decode", "d0", "ok"),
    ]
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_kv_pool_transfers_total", path="handoff") == 1
    assert sample(samples, "vllm_disagg_kv_pool_transfer_blocks_total", outcome="reserved") == len(KEYS)
    assert sample(samples, "vllm_disagg_kv_pool_transfer_failures_total") == 0


async def test_a_fetch_that_fails_is_counted_and_the_request_is_still_served_by_d(
    cluster: PoolCluster, http: aiohttp.ClientSession
) -> None:
    await cluster.add("p0", "prefill", pool_handle=True)
    d0 = await cluster.add("d0", "decode")
    d0.plane.fetch_error = ConnectionRefusedError("the holder's port is closed")
    status, headers = await complete(http, cluster.server.url, "pd-2")
    assert (status, headers["X-Disagg-Decode"]) == (200, "d0")
    assert [c[:2] for c in cluster.log.calls] == [("grant", "p0"), ("fetch", "d0")]
    assert await attempts(http, cluster.server.url, "pd-2") == [
        ("prefill", "p0", "ok"),
        ("kv_fetch", "d0", "fetch_refused"),
        ("decode", "d0", "ok"),
    ]
    samples = await scrape(http, cluster.server.url)
    assert (
        sample(samples, "vllm_disagg_kv_pool_transfer_failures_total", path="handoff", reason="fetch_refused")
        == 1
    )
    events = [
        e for e in cluster.server.app[GATEWAY_KEY].events.since(0) if e.kind == "kv_pool_transfer_failed"
    ]
    assert [(e.fields["reason"], e.fields["holder"], e.fields["receiver"]) for e in events] == [
        ("fetch_refused", "p0", "d0")
    ]
    assert "port is closed" in events[0].fields["error"]


async def test_a_prompt_a_pool_holds_whole_goes_straight_to_d_which_fetches_it_first(
    cluster: PoolCluster, http: aiohttp.ClientSession
) -> None:
    p0 = await cluster.add("p0", "prefill", pool_handle=True)
    d0 = await cluster.add("d0", "decode")
    stored = KvEvent("stored", [event_hash(k) for k in KEYS], None, IDS[: len(KEYS) * BLOCK], BLOCK, "pool")
    assert p0.session.send_kv_events(KvEvents(seq=1, events=[stored]))
    index = cluster.server.kv_index
    await eventually(lambda: index.pool_blocks_of("p0") == len(KEYS), what="p0's pool indexed")
    assert index.cached_tokens(IDS) == {}, "a pool is not an engine's prefix cache"
    status, headers = await complete(http, cluster.server.url, "direct-1")
    assert status == 200
    assert (headers["X-Disagg-Mode"], headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"]) == (
        "colocated",
        "",
        "d0",
    )
    grant, fetch = cluster.log.calls
    assert grant == ("grant", "p0", grant[2], KEYS, d0.public_key, GRANT_TTL_S)
    assert fetch == ("fetch", "d0", p0.plane.endpoint, p0.public_key, grant[2], KEYS)
    assert await attempts(http, cluster.server.url, "direct-1") == [
        ("kv_fetch", "d0", "ok"),
        ("decode", "d0", "ok"),
    ]
    samples = await scrape(http, cluster.server.url)
    assert sample(samples, "vllm_disagg_kv_pool_direct_requests_total", source="peer") == 1
    assert sample(samples, "vllm_disagg_kv_pool_transfers_total", path="direct") == 1
    assert sample(samples, "vllm_disagg_kv_pool_index_blocks", instance="p0") == len(KEYS)

    p0.task.cancel()  # the agent stops (else it would say Hello again), and says Goodbye
    await asyncio.gather(p0.task, return_exceptions=True)
    p0.session.goodbye("leaving")  # its session ends: nothing it held can be fetched any more
    await eventually(lambda: not index.has_pools, what="p0's pool entries dropped")
    status, headers = await complete(http, cluster.server.url, "after-goodbye")
    assert (status, headers["X-Disagg-Mode"]) == (200, "colocated")  # p0 is gone: no prefill instance
    assert len(cluster.log.calls) == 2, "no move from a holder that left"


async def test_a_pool_claiming_a_prompt_it_does_not_hold_makes_no_decoder_fetch_from_it(
    cluster: PoolCluster, http: aiohttp.ClientSession
) -> None:
    """A claim (the agent's pool events) only makes the orchestrator ask: its own grant, which the
    holder must answer by pinning the blocks. A holder that pins none is never fetched from."""
    p0 = await cluster.add("p0", "prefill", pool_handle=True)
    await cluster.add("d0", "decode")
    p0.plane.held = 0  # the claim is false: asked, its pool holds nothing of the prompt
    stored = KvEvent("stored", [event_hash(k) for k in KEYS], None, IDS[: len(KEYS) * BLOCK], BLOCK, "pool")
    assert p0.session.send_kv_events(KvEvents(seq=1, events=[stored]))
    await eventually(lambda: cluster.server.kv_index.pool_blocks_of("p0") == len(KEYS), what="indexed")
    status, headers = await complete(http, cluster.server.url, "false-claim")
    assert (status, headers["X-Disagg-Decode"]) == (200, "d0")
    assert [call[:2] for call in cluster.log.calls] == [("grant", "p0")], "asked, and no fetch ordered"
    assert await attempts(http, cluster.server.url, "false-claim") == [
        ("kv_fetch", "d0", "not_held"),
        ("decode", "d0", "ok"),
    ]


async def test_a_pool_whose_keys_are_not_the_ones_computed_here_is_not_asked_and_d_serves_alone(
    cluster: PoolCluster, http: aiohttp.ClientSession
) -> None:
    """Engines seeded with another PYTHONHASHSEED name every block otherwise: the orchestrator cannot
    name the holder's blocks, so it does not ask for them."""
    p0 = await cluster.add("p0", "prefill", pool_handle=True)
    await cluster.add("d0", "decode")
    other = prompt_block_hashes(IDS, BLOCK, seed="another seed")
    stored = KvEvent("stored", [event_hash(k) for k in other], None, IDS[: len(KEYS) * BLOCK], BLOCK, "pool")
    assert p0.session.send_kv_events(KvEvents(seq=1, events=[stored]))
    await eventually(lambda: cluster.server.kv_index.pool_blocks_of("p0") == len(KEYS), what="indexed")
    status, headers = await complete(http, cluster.server.url, "seeded")
    assert (status, headers["X-Disagg-Mode"]) == (200, "colocated")
    assert cluster.log.calls == []
    assert await attempts(http, cluster.server.url, "seeded") == [
        ("kv_fetch", "d0", "key_mismatch"),
        ("decode", "d0", "ok"),
    ]


async def test_an_agent_too_old_for_the_commands_is_never_sent_one_and_the_request_is_served(
    http: aiohttp.ClientSession,
) -> None:
    """P's agent speaks protocol 1.0 (a FakeAgent's Hello carries no minor) but says it has a pool."""
    server = await start_orchestrator(orch_config(preload_tokenizer_libs=False), shutdown_timeout_s=2.0)
    cluster = PoolCluster(server, None)
    old: FakeAgent | None = None
    try:
        engine = await start_engine(
            SimEngineConfig(port=0, model=MODEL, timing=SimTiming(block_size=BLOCK)),
            kv_connector="vllm-disagg",
        )
        cluster.engines.append(engine)
        info = InstanceInfo(
            engine.url,
            "prefill",
            MODEL,
            "sim",
            block_size=BLOCK,
            kv_connector="vllm-disagg",
            kv_pool_endpoint="tcp://h:1",
        )
        old = FakeAgent(server.zmq_endpoint, "p0", engine.url, "prefill", info=info)
        await old.join()
        await cluster.add("d0", "decode")
        status, _ = await complete(http, server.url, "old-1")
        assert status == 200
        assert old.commands == [] and cluster.log.calls == []
        samples = await scrape(http, server.url)
        assert sample(samples, "vllm_disagg_kv_pool_transfer_failures_total", reason="too_old") == 1
    finally:
        if old is not None:
            await old.close()
        await cluster.close()


async def test_a_gateway_worker_moves_kv_through_the_orchestrators_control_plane(
    http: aiohttp.ClientSession,
) -> None:
    config = orch_config(gateway_workers=2, preload_tokenizer_libs=False)
    cluster = PoolCluster(await start_orchestrator(config, shutdown_timeout_s=2.0), None)
    try:
        await cluster.add("p0", "prefill", pool_handle=True)
        await cluster.add("d0", "decode")
        served = 0  # disaggregated requests (a worker's first may find p0 not yet ready: colocated)

        async def moved_by_both() -> dict[str, float] | None:
            nonlocal served
            async with aiohttp.ClientSession() as one:  # a connection each: the kernel spreads them
                status, headers = await complete(one, cluster.server.url, f"w-{served}")
            assert status == 200
            served += headers["X-Disagg-Mode"] == "disaggregated"
            samples = await scrape(http, cluster.server.url)
            moved = {
                w: sample(samples, "vllm_disagg_kv_pool_transfers_total", path="handoff", worker=w)
                for w in ("0", "1")
            }
            return moved if all(moved.values()) and sum(moved.values()) == served else None

        await eventually(moved_by_both, interval=0.05, what="KV moved for requests in both processes")
        assert [c[:2] for c in cluster.log.calls] == [("grant", "p0"), ("fetch", "d0")] * served
        tokens = [c[2] for c in cluster.log.calls if c[0] == "grant"]
        assert len(set(tokens)) == served, "a token per move"
    finally:
        await cluster.close()
