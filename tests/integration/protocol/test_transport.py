"""The ZeroMQ transport on real loopback sockets: delivery both ways, bad frames as typed errors, and a
connection per routing id (a reconnect is a new connection, never a stranded one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from tests.helpers import TcpProxy, eventually
from vllm_disagg.errors import FrameTooLarge, MalformedFrame, UnknownMessageType
from vllm_disagg.protocol.codec import encode
from vllm_disagg.protocol.messages import (
    Ack,
    Command,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    MetricsSnapshot,
    Welcome,
)
from vllm_disagg.protocol.transport import DealerTransport, Incoming, RouterTransport

HELLO = Hello(
    protocol_version=1, agent_id="agent-1", instance=InstanceInfo(url="http://e", role="both", model="m")
)
RECV_TIMEOUT = 10.0


@pytest.fixture
async def router() -> AsyncIterator[RouterTransport]:
    transport = RouterTransport("tcp://127.0.0.1:0", max_frame_bytes=4096)
    try:
        yield transport
    finally:
        transport.close()


@pytest.fixture
async def dealer(router: RouterTransport) -> AsyncIterator[DealerTransport]:
    transport = DealerTransport(router.endpoint)
    try:
        yield transport
    finally:
        transport.close()


async def recv(transport: RouterTransport | DealerTransport) -> Incoming:
    return await asyncio.wait_for(transport.recv(), RECV_TIMEOUT)


async def connected(dealer: DealerTransport, router: RouterTransport) -> bytes:
    """Say Hello until the router has it (the dealer refuses to queue while not connected); the peer."""
    await eventually(lambda: dealer.send(HELLO), timeout=RECV_TIMEOUT, what="dealer connected")
    first = await recv(router)
    assert (first.message, first.error) == (HELLO, None)
    return first.peer


async def test_a_bound_router_reports_its_real_endpoint(router: RouterTransport) -> None:
    assert router.endpoint.startswith("tcp://127.0.0.1:")
    assert not router.endpoint.endswith(":0")


async def test_dealer_to_router_delivers_messages_in_order_tagged_with_the_connection(
    router: RouterTransport, dealer: DealerTransport
) -> None:
    peer = await connected(dealer, router)
    beats = [
        Heartbeat(seq=i, engine_state="ready", metrics=MetricsSnapshot(num_running=i)) for i in range(1, 4)
    ]
    for beat in beats:
        assert dealer.send(beat)
    assert [await recv(router) for _ in beats] == [Incoming(peer, b, None) for b in beats]


async def test_router_to_dealer_delivers_to_the_addressed_agent(
    router: RouterTransport, dealer: DealerTransport
) -> None:
    peer = await connected(dealer, router)
    welcome = Welcome(protocol_version=1, agent_id="agent-1", heartbeat_interval_s=0.1, heartbeat_timeout_s=1)
    command = Command(id=3, kind="drain", args={"why": "test"})
    assert router.send(peer, welcome)
    assert router.send(peer, command)
    assert await recv(dealer) == Incoming(b"", welcome, None)
    assert await recv(dealer) == Incoming(b"", command, None)


async def test_router_send_to_an_unknown_peer_returns_false(router: RouterTransport) -> None:
    assert router.send(b"nobody", Goodbye(reason="x")) is False


async def test_dealer_send_without_a_router_returns_false() -> None:
    lonely = RouterTransport("tcp://127.0.0.1:0")
    endpoint = lonely.endpoint
    lonely.close()  # nothing listens there now
    dealer = DealerTransport(endpoint)
    try:
        assert dealer.send(HELLO) is False
    finally:
        dealer.close()


@pytest.mark.parametrize(
    ("garbage", "error"),
    [
        (b"\xc1not msgpack", MalformedFrame),
        (encode(Ack(id=1, ok=True))[:-2], MalformedFrame),
        (b"\x92\xa8teleport\x80", UnknownMessageType),  # ["teleport", {}]
        (b"\xc1" * 5000, FrameTooLarge),  # over the router's 4096-byte limit
    ],
    ids=["garbage bytes", "truncated frame", "unknown tag", "frame over the limit"],
)
async def test_a_bad_frame_reaches_the_router_as_an_error_and_the_next_good_frame_still_arrives(
    router: RouterTransport, dealer: DealerTransport, garbage: bytes, error: type[Exception]
) -> None:
    peer = await connected(dealer, router)
    assert dealer.send_raw(garbage)
    assert dealer.send(Goodbye(reason="after garbage"))
    bad = await recv(router)
    assert bad.peer == peer
    assert bad.message is None
    assert isinstance(bad.error, error)
    assert await recv(router) == Incoming(peer, Goodbye(reason="after garbage"), None)


async def test_a_bad_frame_reaches_the_dealer_as_an_error_and_the_next_good_frame_still_arrives() -> None:
    # A raw ROUTER stands in for an orchestrator that sends garbage (RouterTransport cannot).
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind("tcp://127.0.0.1:0")
    dealer = DealerTransport(raw.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        await eventually(lambda: dealer.send(HELLO), timeout=RECV_TIMEOUT, what="dealer connected")
        peer, _ = await asyncio.wait_for(raw.recv_multipart(), RECV_TIMEOUT)
        await raw.send_multipart([peer, b"\xc1\xc1"])
        await raw.send_multipart([peer, b"one", b"two"])  # two parts: not a protocol frame
        await raw.send_multipart([peer, encode(Goodbye(reason="still here"))])
        first, second, third = [await recv(dealer) for _ in range(3)]
        assert isinstance(first.error, MalformedFrame) and first.message is None
        assert isinstance(second.error, MalformedFrame) and "2" in str(second.error)
        assert third == Incoming(b"", Goodbye(reason="still here"), None)
    finally:
        dealer.close()
        raw.close(linger=0)
        ctx.term()


async def test_closing_with_linger_flushes_a_final_goodbye(router: RouterTransport) -> None:
    dealer = DealerTransport(router.endpoint)
    await eventually(lambda: dealer.send(HELLO), timeout=RECV_TIMEOUT, what="dealer connected")
    assert dealer.send(Goodbye(reason="leaving"))
    dealer.close(linger_ms=2000)
    hello = await recv(router)
    assert hello.message == HELLO
    assert await recv(router) == Incoming(hello.peer, Goodbye(reason="leaving"), None)


async def test_a_reconnect_is_a_new_connection_heard_even_while_the_old_one_had_frames_unread(
    router: RouterTransport,
) -> None:
    # The orchestrator may be starved of CPU while a link blips: the old connection's frames wait
    # unread in the router when the agent reconnects, and the agent goes on sending (heartbeats).
    # What it sends on the new connection must still arrive.
    proxy = await TcpProxy(int(router.endpoint.rsplit(":", 1)[1])).start()
    dealer = DealerTransport(f"tcp://127.0.0.1:{proxy.port}", reconnect_ivl_ms=20)
    sent: list[int] = []

    async def beat() -> None:
        while True:
            if dealer.send(Ack(id=len(sent), ok=True)):
                sent.append(proxy.accepted)  # which connection it went on
            await asyncio.sleep(0.005)

    old = await connected(dealer, router)
    beats = asyncio.create_task(beat())
    try:
        await eventually(lambda: len(sent) >= 20, timeout=RECV_TIMEOUT, what="frames queued unread")
        proxy.sever()
        await eventually(lambda: sent.count(2) >= 50, timeout=RECV_TIMEOUT, what="sent after a reconnect")
        first_after = sent.index(2)
        while True:
            incoming = await recv(router)
            assert isinstance(incoming.message, Ack), incoming
            if incoming.message.id >= first_after:
                break
            assert incoming.peer == old
        assert incoming.peer != old, "each connection has its own routing id"
        assert router.send(incoming.peer, WELCOME_BACK)
        assert (await recv(dealer)).message == WELCOME_BACK
        assert router.send(old, WELCOME_BACK) is False, "the closed connection takes nothing"
    finally:
        beats.cancel()
        dealer.close()
        await proxy.close()


WELCOME_BACK = Welcome(
    protocol_version=1, agent_id="agent-1", heartbeat_interval_s=0.1, heartbeat_timeout_s=1
)
