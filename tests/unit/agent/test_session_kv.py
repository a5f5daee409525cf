"""The agent session's KV pool commands: ``kv_grant`` and ``kv_fetch`` reach the agent's ``KvPlane``
(here a recording fake) and are Acked with their counts; a fetch waits in a task of its own, so the
session keeps answering; bad args and an agent without a pool get a clear refusal. And an
orchestrator before 1.3 never hears of the pool's KV events. The commands come typed (1.5); what an
orchestrator of 1.3 or 1.4 sends and reads instead: tests/unit/protocol/test_commands.py.

Real ROUTER/DEALER pair on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from tests.helpers import eventually
from vllm_disagg.agent.kv.plane import FetchStarted
from vllm_disagg.agent.session import NO_POOL, AgentSession
from vllm_disagg.protocol.commands import FetchResult, GrantResult, KvFetch, KvGrant, to_args
from vllm_disagg.protocol.messages import (
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    Ack,
    Command,
    Hello,
    InstanceInfo,
    KvEvent,
    KvEvents,
    MetricsSnapshot,
    Welcome,
)
from vllm_disagg.protocol.transport import DealerTransport, RouterTransport

KEYS = [bytes([0xA0 + i]) * 32 for i in range(1, 4)]  # hex with letters
HEX = [k.hex() for k in KEYS]
PEER = b"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a z85 public key: 40 characters
Z85 = PEER.decode()


def grant(token: str = "tok", peer_key: str = "", ttl_s: float = 30.0) -> KvGrant:
    return KvGrant(token, KEYS, peer_key, ttl_s)


def fetch(endpoint: str = "tcp://h:1", peer_key: str = "", timeout_s: float = 2.0) -> KvFetch:
    return KvFetch("tok", KEYS, endpoint, peer_key, timeout_s)


WELCOME = Welcome(PROTOCOL_VERSION, "a1", 0.5, 2.0, protocol_minor=PROTOCOL_MINOR)


class FakePlane:
    """A ``KvPlane`` that records what it is asked; a fetch waits for ``gate`` when one is set."""

    endpoint = "tcp://127.0.0.1:7001"

    def __init__(self, *, held: int | None = None, fetch_error: Exception | None = None) -> None:
        self.held = held
        self.fetch_error = fetch_error
        self.gate: asyncio.Event | None = None
        self.grants: list[tuple[str, list[bytes], bytes | None, float]] = []
        self.fetches: list[tuple[str, bytes | None, str, list[bytes], float]] = []
        self.landed: asyncio.Future[int] | None = None

    def grant(self, token: str, keys: Sequence[bytes], peer_public_key: bytes | None, ttl_s: float) -> int:
        self.grants.append((token, list(keys), peer_public_key, ttl_s))
        return len(keys) if self.held is None else self.held

    async def fetch(
        self,
        endpoint: str,
        peer_public_key: bytes | None,
        token: str,
        keys: Sequence[bytes],
        timeout_s: float,
    ) -> FetchStarted:
        self.fetches.append((endpoint, peer_public_key, token, list(keys), timeout_s))
        if self.gate is not None:
            await self.gate.wait()
        if self.fetch_error is not None:
            raise self.fetch_error
        self.landed = asyncio.get_running_loop().create_future()
        return FetchStarted(requested=len(keys), already_held=1, reserved=len(keys) - 1, done=self.landed)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RouterTransport, DealerTransport]]:
    router = RouterTransport("tcp://127.0.0.1:0")
    dealer = DealerTransport(router.endpoint)
    try:
        yield router, dealer
    finally:
        dealer.close()
        router.close()


def new_session(transport: DealerTransport, plane: FakePlane | None) -> AgentSession:
    return AgentSession(
        transport,
        "a1",
        InstanceInfo(url="http://e", role="both", model="m", kv_pool_endpoint=FakePlane.endpoint),
        engine_state=lambda: "ready",
        metrics=MetricsSnapshot,
        kv_plane=plane,
    )


class Running:
    """A session registered with the test's ROUTER: send it commands, read what it sends back."""

    def __init__(self, router: RouterTransport, session: AgentSession) -> None:
        self.router = router
        self.session = session
        self.peer = b""
        self.task: asyncio.Task[Any] | None = None

    async def start(self, welcome: Welcome = WELCOME) -> Running:
        self.task = asyncio.create_task(self.session.run())
        hello = await asyncio.wait_for(self.router.recv(), 30)
        assert isinstance(hello.message, Hello)
        self.peer = hello.peer
        assert self.router.send(self.peer, welcome)
        return self

    def send(self, command: Command) -> None:
        assert self.router.send(self.peer, command)

    async def next_ack(self) -> Ack:
        while True:
            incoming = await asyncio.wait_for(self.router.recv(), 30)
            if isinstance(incoming.message, Ack):
                return incoming.message

    async def next_kv_events(self) -> KvEvents:
        while True:
            incoming = await asyncio.wait_for(self.router.recv(), 30)
            if isinstance(incoming.message, KvEvents):
                return incoming.message

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def running(pair: tuple[RouterTransport, DealerTransport]) -> AsyncIterator[Any]:
    started: list[Running] = []

    async def start(plane: FakePlane | None, welcome: Welcome = WELCOME) -> Running:
        run = await Running(pair[0], new_session(pair[1], plane)).start(welcome)
        started.append(run)
        return run

    try:
        yield start
    finally:
        for run in started:
            await run.stop()


async def test_a_grant_reaches_the_plane_and_is_acked_with_how_many_blocks_are_held(running: Any) -> None:
    plane = FakePlane(held=2)
    run = await running(plane)
    run.send(Command.of(1, grant(peer_key=Z85)))
    assert await run.next_ack() == Ack(1, True, result=GrantResult(requested=3, held=2))
    assert plane.grants == [("tok", KEYS, PEER, 30.0)]


@pytest.mark.parametrize(
    ("minor", "grant_ack", "fetch_ack"),
    [
        pytest.param(
            3,
            Ack(1, True, detail={"requested": "3", "held": "2"}),
            Ack(2, True, detail={"requested": "3", "already_held": "1", "reserved": "2"}),
            id="1.3: args in, string counts out",
        ),
        pytest.param(
            4,
            Ack(1, True, detail={"requested": "3", "held": "2"}),
            Ack(2, True, detail={"requested": "3", "already_held": "1", "reserved": "2"}),
            id="1.4: args in, string counts out",
        ),
        pytest.param(
            5,
            Ack(1, True, result=GrantResult(requested=3, held=2)),
            Ack(2, True, result=FetchResult(requested=3, already_held=1, reserved=2)),
            id="1.5: payloads in, typed results out",
        ),
    ],
)
async def test_an_orchestrator_of_each_minor_is_obeyed_and_answered_in_the_form_it_reads(
    running: Any, minor: int, grant_ack: Ack, fetch_ack: Ack
) -> None:
    """An orchestrator of 1.3 or 1.4 sends the string args of its time (``for_minor``) and reads
    ``detail``; the agent does the same for it as for one of 1.5."""
    plane = FakePlane(held=2)
    run = await running(plane, dataclasses.replace(WELCOME, protocol_minor=minor))
    run.send(Command.of(1, grant(peer_key=Z85)).for_minor(minor))
    assert await run.next_ack() == grant_ack
    run.send(Command.of(2, fetch("tcp://10.0.0.5:7001")).for_minor(minor))
    assert await run.next_ack() == fetch_ack
    assert plane.grants == [("tok", KEYS, PEER, 30.0)]
    assert plane.fetches == [("tcp://10.0.0.5:7001", None, "tok", KEYS, 2.0)]


async def test_a_grant_token_never_reaches_the_log(running: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Whoever holds it may fetch the granted blocks of someone's prompt."""
    caplog.set_level(logging.DEBUG)
    run = await running(FakePlane())
    secret = "grant-token-that-must-stay-secret"
    run.send(Command.of(1, grant(secret, Z85)))
    await run.next_ack()
    assert "command 1: kv_grant" in caplog.text
    assert secret not in caplog.text


async def test_a_fetch_is_acked_once_started_with_its_counts_and_without_agent_keys_no_peer_key(
    running: Any,
) -> None:
    plane = FakePlane()
    run = await running(plane)
    run.send(Command.of(2, fetch("tcp://10.0.0.5:7001")))
    assert await run.next_ack() == Ack(2, True, result=FetchResult(requested=3, already_held=1, reserved=2))
    assert plane.fetches == [("tcp://10.0.0.5:7001", None, "tok", KEYS, 2.0)]
    assert plane.landed is not None
    plane.landed.set_result(1)  # fewer than reserved: logged, nothing else


async def test_a_fetch_waiting_for_its_transfer_does_not_hold_up_other_commands(running: Any) -> None:
    plane = FakePlane()
    plane.gate = asyncio.Event()
    run = await running(plane)
    run.send(Command.of(3, fetch("tcp://10.0.0.5:7001", Z85, 5.0)))
    run.send(Command(4, "drain"))
    assert await run.next_ack() == Ack(4, True), "the drain is answered while the fetch waits"
    assert len(plane.fetches) == 1
    plane.gate.set()
    ack = await run.next_ack()
    assert (ack.id, ack.ok) == (3, True)


async def test_a_fetch_that_does_not_start_in_time_is_refused_saying_so(running: Any) -> None:
    plane = FakePlane()
    plane.gate = asyncio.Event()  # never set: the transfer never starts
    run = await running(plane)
    run.send(Command.of(5, fetch("tcp://10.0.0.5:7001", timeout_s=0.05)))
    ack = await run.next_ack()
    assert (ack.id, ack.ok) == (5, False)
    assert "did not start within 0.05 s" in ack.error


@pytest.mark.parametrize(
    ("command", "error"),
    [
        pytest.param(
            Command(1, "kv_grant", {**to_args(grant()), "keys": "zz"}),
            "kv_grant: 'keys'[0] is not a lowercase hex block key: 'zz'",
            id="a key that is not hex",
        ),
        pytest.param(
            Command(1, "kv_grant", {**to_args(grant()), "keys": HEX[0].upper()}),
            "kv_grant: 'keys'[0] is not a lowercase hex block key",
            id="an uppercase key",
        ),
        pytest.param(
            Command(1, "kv_grant", {**to_args(grant()), "keys": ""}),
            "kv_grant: 'keys' names no block",
            id="no keys",
        ),
        pytest.param(
            Command(1, "kv_grant", to_args(grant(""))),
            "kv_grant: 'token' must not be empty",
            id="no token",
        ),
        pytest.param(
            Command(1, "kv_grant", {**to_args(grant()), "ttl_s": "soon"}),
            "kv_grant: 'ttl_s' must be a number of seconds, got 'soon'",
            id="a ttl that is not a number",
        ),
        pytest.param(
            Command(1, "kv_grant", to_args(grant(ttl_s=0.0))),
            "kv_grant: 'ttl_s' must be > 0 seconds",
            id="a ttl of zero",
        ),
        pytest.param(
            Command(1, "kv_grant", {**to_args(grant()), "peer_key": "short"}),
            "kv_grant: 'peer_key' must be a CurveZMQ public key (40 z85 characters) or empty",
            id="a peer key that is not one",
        ),
        pytest.param(
            Command(1, "kv_fetch", to_args(fetch("10.0.0.5:7001"))),
            "kv_fetch: 'endpoint' must be a ZeroMQ endpoint (tcp://host:port), got '10.0.0.5:7001'",
            id="an endpoint without a scheme",
        ),
        pytest.param(
            Command(1, "kv_fetch", {**to_args(fetch()), "timeout_s": "inf"}),
            "kv_fetch: 'timeout_s' must be > 0 seconds",
            id="an endless timeout",
        ),
    ],
)
async def test_malformed_args_are_refused_with_the_reason_and_never_reach_the_plane(
    running: Any, command: Command, error: str
) -> None:
    plane = FakePlane()
    run = await running(plane)
    run.send(command)
    ack = await run.next_ack()
    assert (ack.ok, ack.error[: len(error)]) == (False, error)
    assert plane.grants == [] and plane.fetches == []


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        pytest.param(grant(""), "kv_grant: 'token' must not be empty", id="no token"),
        pytest.param(KvGrant("tok", [], "", 30.0), "kv_grant: 'keys' names no block", id="no keys"),
        pytest.param(
            KvGrant("tok", [b"k" * 65], "", 30.0),
            "kv_grant: 'keys'[0] is not a block key of 1 to 64 bytes",
            id="a key longer than any block hash",
        ),
        pytest.param(grant(ttl_s=0.0), "kv_grant: 'ttl_s' must be > 0 seconds", id="a ttl of zero"),
        pytest.param(
            grant(peer_key="short"),
            "kv_grant: 'peer_key' must be a CurveZMQ public key (40 z85 characters) or empty",
            id="a peer key that is not one",
        ),
        pytest.param(
            fetch("10.0.0.5:7001"),
            "kv_fetch: 'endpoint' must be a ZeroMQ endpoint (tcp://host:port), got '10.0.0.5:7001'",
            id="an endpoint without a scheme",
        ),
        pytest.param(
            fetch(timeout_s=float("inf")),
            "kv_fetch: 'timeout_s' must be > 0 seconds",
            id="an endless timeout",
        ),
    ],
)
async def test_typed_payloads_follow_the_same_rules_and_are_refused_with_the_reason(
    running: Any, payload: KvGrant | KvFetch, error: str
) -> None:
    plane = FakePlane()
    run = await running(plane)
    run.send(Command.of(1, payload))
    ack = await run.next_ack()
    assert (ack.ok, ack.error[: len(error)]) == (False, error)
    assert plane.grants == [] and plane.fetches == []


async def test_an_agent_without_a_pool_refuses_both_commands_saying_how_to_run_one(running: Any) -> None:
    run = await running(None)
    run.send(Command.of(1, grant()))
    run.send(Command.of(2, fetch()))
    assert [await run.next_ack(), await run.next_ack()] == [Ack(1, False, NO_POOL), Ack(2, False, NO_POOL)]
    assert "--kv-connector vllm-disagg" in NO_POOL


async def test_a_plane_that_fails_is_answered_not_ok_and_the_session_goes_on(running: Any) -> None:
    plane = FakePlane(fetch_error=ConnectionRefusedError("holder gone"))
    run = await running(plane)
    run.send(Command.of(1, fetch()))
    ack = await run.next_ack()
    assert (ack.ok, ack.error) == (False, "kv_fetch failed: ConnectionRefusedError: holder gone")
    run.send(Command(2, "drain"))
    assert await run.next_ack() == Ack(2, True)


GPU = KvEvent("stored", [1], None, [5, 6], 2)
POOL = dataclasses.replace(GPU, block_hashes=[9], medium="pool")


@pytest.mark.parametrize(
    ("minor", "expected"),
    [
        pytest.param(3, [GPU, POOL], id="1.3 hears both"),
        pytest.param(2, [GPU], id="1.2 hears the engine's alone"),
    ],
)
async def test_pool_events_go_only_to_an_orchestrator_that_tells_them_apart(
    running: Any, minor: int, expected: list[KvEvent]
) -> None:
    run = await running(FakePlane(), dataclasses.replace(WELCOME, protocol_minor=minor))
    session = run.session

    await eventually(lambda: session.registered, what="the Welcome read")
    assert session.send_kv_events(KvEvents(seq=1, events=[POOL])) is True  # nothing it may hear (1.2)
    assert session.send_kv_events(KvEvents(seq=2, events=[GPU, POOL])) is True
    first = await run.next_kv_events()
    if minor < 3:
        assert first == KvEvents(seq=2, events=expected)
    else:
        assert first == KvEvents(seq=1, events=[POOL])
        assert await run.next_kv_events() == KvEvents(seq=2, events=expected)
