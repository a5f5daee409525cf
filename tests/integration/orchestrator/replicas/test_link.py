"""The replicas' link on real ZeroMQ sockets, on a fake clock: how soon a replica's load reaches its
peers (the bound: ``LOAD_PUSH_S`` after a change, ``LOAD_KEEPALIVE_S`` without one), when a silent
peer stops counting, and what a frame that is not a peer's gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from tests.helpers import eventually
from vllm_disagg.clock import FakeClock
from vllm_disagg.orchestrator.replicas.peers import PeerLink
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.replicas import (
    LOAD_KEEPALIVE_S,
    LOAD_PUSH_S,
    LOAD_STALE_S,
    PEER_CODEC,
    REPLICA_LINK_VERSION,
    PeerLoad,
    PeerRefuse,
)

Pair = tuple[PeerLink, Registry, PeerLink, Registry]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def pair(clock: FakeClock) -> AsyncIterator[Pair]:
    """Replicas a and b, linked both ways, each running its link on the fake clock."""
    reg_a, reg_b = Registry(1.0), Registry(1.0)
    a = PeerLink("c", "a", "tcp://127.0.0.1:*", reg_a, clock)
    b = PeerLink("c", "b", "tcp://127.0.0.1:*", reg_b, clock)
    a.connect_to({"a": a.endpoint, "b": b.endpoint})
    b.connect_to({"a": a.endpoint, "b": b.endpoint})
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        yield a, reg_a, b, reg_b
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.close()
        await b.close()


def peers_of(registry: Registry) -> dict[str, int]:
    return registry.remote_in_flight("peers")


async def linked(clock: FakeClock, a: PeerLink, b: PeerLink) -> None:
    """Until each has heard the other (a frame sent before a connection is up is dropped), with both
    pushers left waiting for a change (not in their coalescing pause)."""

    async def heard() -> bool:
        await clock.run_for(LOAD_KEEPALIVE_S + LOAD_PUSH_S)
        return "a" in b.heard() and "b" in a.heard()

    await eventually(heard, what="a and b linked")


async def test_a_burst_of_changes_is_one_frame_and_reaches_the_peer_within_the_push_interval(
    pair: Pair, clock: FakeClock
) -> None:
    a, reg_a, b, reg_b = pair
    await linked(clock, a, b)
    sent = a._seq
    for _ in range(10):
        reg_a.acquire("d0")
    await clock.settle()
    assert a._seq - sent <= 1, "until the clock moves, a burst is one frame at most"
    await clock.run_for(LOAD_PUSH_S)  # the bound: no later than this after the change
    await eventually(lambda: peers_of(reg_b) == {"d0": 10}, what="all ten at b")
    assert reg_b.snapshot().in_flight_of("d0") == 10
    for _ in range(10):
        reg_a.release("d0")
    await clock.run_for(LOAD_PUSH_S)
    await eventually(lambda: peers_of(reg_b) == {}, what="none left at b")
    assert reg_b.snapshot().in_flight_of("d0") == 0


async def test_unchanged_counts_are_said_again_and_a_silent_peer_stops_counting(
    pair: Pair, clock: FakeClock
) -> None:
    a, reg_a, b, reg_b = pair
    await linked(clock, a, b)
    reg_a.acquire("d0")
    await clock.run_for(LOAD_PUSH_S)
    await eventually(lambda: peers_of(reg_b) == {"d0": 1}, what="a's count at b")
    sent = a._seq
    await clock.run_for(LOAD_KEEPALIVE_S + LOAD_PUSH_S)
    assert a._seq > sent, "a keepalive went out without a change"
    a.connect_to({"a": a.endpoint})  # a stops talking to b, as a replica that died would

    async def forgotten() -> bool:
        # A frame a sent just before it stopped may reach b only after fake time has passed (a loaded
        # machine), renewing the count: fake time must go on passing until b forgets it.
        await clock.run_for(LOAD_STALE_S + LOAD_KEEPALIVE_S)
        return peers_of(reg_b) == {}

    await eventually(forgotten, what="a's counts forgotten at b")
    assert reg_b.snapshot().in_flight_of("d0") == 0


async def test_a_frame_that_is_not_a_peers_load_is_refused_with_a_reason_and_changes_nothing(
    pair: Pair,
) -> None:
    _, _, b, reg_b = pair
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(b.endpoint)
    try:
        frames = [
            b"\xc1 not msgpack",
            msgpack.packb(["peer_load", {"version": REPLICA_LINK_VERSION}]),
            PEER_CODEC.encode(PeerLoad(REPLICA_LINK_VERSION + 1, "c", "a", 1, {"d0": 5})),
            PEER_CODEC.encode(PeerLoad(REPLICA_LINK_VERSION, "other", "a", 1, {"d0": 5})),
        ]
        codes = []
        for frame in frames:
            await sock.send(frame)
            answer = PEER_CODEC.decode(await sock.recv())
            assert isinstance(answer, PeerRefuse)
            codes.append(answer.code)
        assert codes == ["malformed_frame", "field_type_error", "mismatch", "mismatch"]
        assert b.refused == 4 and peers_of(reg_b) == {}
        # A well-formed load from a replica that is not a member (not in etcd) is not counted either.
        await sock.send(PEER_CODEC.encode(PeerLoad(REPLICA_LINK_VERSION, "c", "stranger", 1, {"d0": 5})))
        await sock.send(b"\xc1")
        assert isinstance(PEER_CODEC.decode(await sock.recv()), PeerRefuse)  # it was read, and ignored
        assert peers_of(reg_b) == {}
    finally:
        sock.close(linger=0)
        ctx.term()
