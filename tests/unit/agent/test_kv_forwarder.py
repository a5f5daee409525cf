"""The agent's KV-event forwarder: an engine's PUB socket in, ``KvEvents`` to the orchestrator out.

Each test publishes vLLM's frames (``encode_batch``) on a real PUB socket bound on loopback; the
forwarder sends through a real ``AgentSession``/``DealerTransport`` to a real ROUTER the test reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import zmq

from tests.helpers import eventually, free_port
from vllm_disagg.agent.kv.local import local_dir
from vllm_disagg.agent.kv_forwarder import KvEventForwarder, _items, forwarder_endpoint, to_protocol
from vllm_disagg.agent.main import add_arguments, config_from_args
from vllm_disagg.agent.session import AgentSession
from vllm_disagg.config import AgentConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.protocol.messages import (
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_POOL,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    InstanceInfo,
    KvEvent,
    KvEvents,
    MetricsSnapshot,
    Welcome,
)
from vllm_disagg.protocol.transport import DealerTransport, RouterTransport
from vllm_disagg.wire import kv_events
from vllm_disagg.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch

BS = 4
TOKENS = list(range(500, 540))  # ten blocks of 4


def blocks(first: int, count: int, parent: int | None = None) -> BlockStored:
    """``count`` blocks hashed ``first``, ``first + 1``, ... covering TOKENS from block ``first - 1``."""
    start = (first - 1) * BS
    return BlockStored(
        tuple(range(first, first + count)), parent, tuple(TOKENS[start : start + count * BS]), BS
    )


def as_sent(*events: kv_events.KvEvent) -> list[KvEvent]:
    return [piece for e in events for piece in to_protocol(e)]


class Rig:
    """A PUB socket playing the engine, a ROUTER playing the orchestrator, and the forwarder between."""

    def __init__(self) -> None:
        self.router = RouterTransport("tcp://127.0.0.1:0")
        self.dealer = DealerTransport(self.router.endpoint)
        self.session = AgentSession(
            self.dealer,
            "agent-1",
            InstanceInfo(url="http://e", role="both", model="m"),
            engine_state=lambda: "ready",
            metrics=MetricsSnapshot,
        )
        self.session.registered = True  # the session's own Hello/Welcome are tested elsewhere
        self._ctx = zmq.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0  # the engine's next sequence number
        self.forwarder: KvEventForwarder | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, **limits: Any) -> KvEventForwarder:
        """Run a forwarder and wait until it hears the engine (a SUB misses what precedes its joining)."""
        forwarder = self.forwarder = KvEventForwarder(self.endpoint, self.session, **limits)
        self._task = asyncio.create_task(forwarder.run())

        def probe() -> bool:
            self.publish()  # empty batches: they move the sequence, and nothing is sent for them
            return forwarder.batches > 0

        await eventually(probe, what="the forwarder to hear the engine")
        await eventually(lambda: forwarder.engine_seq == self.seq - 1, what="every probe read")
        assert forwarder.missed_total == 0  # what a SUB never heard before it joined is not a gap
        return forwarder

    def publish(self, *events: kv_events.KvEvent, seq: int | None = None) -> None:
        """One engine batch; its sequence number is the next one unless given."""
        seq = self.seq if seq is None else seq
        self.pub.send_multipart(encode_batch(seq, 1.0, events))
        self.seq = seq + 1

    async def next_message(self, timeout: float = 10.0) -> KvEvents:
        """The next KvEvents the orchestrator gets."""
        async with asyncio.timeout(timeout):
            incoming = await self.router.recv()
        assert incoming.error is None
        assert isinstance(incoming.message, KvEvents), incoming.message
        return incoming.message

    async def messages_until(self, done: Callable[[list[KvEvents]], bool]) -> list[KvEvents]:
        got: list[KvEvents] = []
        while not done(got):
            got.append(await self.next_message())
        return got

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        self._ctx.term()
        self.dealer.close()
        self.router.close()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        await r.close()


def events_of(messages: Sequence[KvEvents]) -> list[KvEvent]:
    return [e for m in messages for e in m.events]


async def queued(forwarder: KvEventForwarder, n: int) -> None:
    await eventually(lambda: forwarder.queued_events == n, what=f"{n} events queued")


async def test_batches_read_together_leave_in_one_message_in_order(rig: Rig) -> None:
    forwarder = await rig.start()
    rig.session.registered = False  # hold them back so that all three are readable at once
    rig.publish(blocks(1, 2))
    rig.publish(blocks(3, 1, parent=2), BlockRemoved((1,)))
    rig.publish(AllBlocksCleared())
    await queued(forwarder, 4)
    rig.session.registered = True
    message = await rig.next_message()
    assert message == KvEvents(
        seq=1,
        events=[
            KvEvent("stored", [1, 2], None, TOKENS[:8], BS),
            KvEvent("stored", [3], 2, TOKENS[8:12], BS),
            KvEvent("removed", [1]),
            KvEvent("cleared"),
        ],
        missed=0,
    )
    rig.publish(blocks(1, 1))
    assert (await rig.next_message()).seq == 2  # the agent's counter, not the engine's


async def test_a_big_stored_event_is_split_into_chained_pieces_that_index_like_the_whole(rig: Rig) -> None:
    # 19 items a message: 3 blocks of 4 tokens + 3 hashes + 1 per event = 16.
    forwarder = await rig.start(max_message_items=19)
    rig.publish(blocks(1, 10))
    messages = await rig.messages_until(lambda got: sum(len(m.events) for m in got) == 4)
    assert [[(e.block_hashes, e.parent_block_hash) for e in m.events] for m in messages] == [
        [([1, 2, 3], None)],
        [([4, 5, 6], 3)],
        [([7, 8, 9], 6)],
        [([10], 9)],
    ]
    index = KvIndex()
    index.apply("agent-1", events_of(messages))
    assert index.cached_tokens(TOKENS) == {"agent-1": 40}
    assert forwarder.events_sent == 4


async def test_no_message_holds_more_events_than_the_limit(rig: Rig) -> None:
    forwarder = await rig.start(max_message_events=3)
    rig.session.registered = False
    for h in range(7):
        rig.publish(BlockRemoved((h,)))
    await queued(forwarder, 7)
    rig.session.registered = True
    messages = await rig.messages_until(lambda got: len(events_of(got)) == 7)
    assert [len(m.events) for m in messages] == [3, 3, 1]
    assert [m.seq for m in messages] == [1, 2, 3]
    assert events_of(messages) == [KvEvent("removed", [h]) for h in range(7)]


async def test_a_gap_in_the_engines_sequence_is_reported_as_missed_once(rig: Rig) -> None:
    forwarder = await rig.start()
    rig.publish(blocks(1, 1), seq=rig.seq + 3)  # three engine batches never arrived
    first = await rig.next_message()
    rig.publish(blocks(2, 1, parent=1))
    second = await rig.next_message()
    assert (first.missed, first.events) == (3, as_sent(blocks(1, 1)))
    assert second.missed == 0
    assert forwarder.missed_total == 3


async def test_a_sequence_that_goes_back_is_a_restarted_engine_so_the_cache_is_cleared_first(
    rig: Rig,
) -> None:
    await rig.start()
    rig.publish(blocks(1, 1), seq=0)
    message = await rig.next_message()
    assert (message.events, message.missed) == ([KvEvent("cleared"), *as_sent(blocks(1, 1))], 0)


async def test_the_supervisors_restart_clears_and_the_new_engine_counts_from_zero(rig: Rig) -> None:
    forwarder = await rig.start()
    forwarder.engine_restarted()
    assert (await rig.next_message()).events == [KvEvent("cleared")]
    rig.publish(blocks(1, 1), seq=0)
    message = await rig.next_message()
    assert (message.events, message.missed) == (as_sent(blocks(1, 1)), 0)  # no second clear, no gap


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"kv-events", b"\x00" * 8, b"\xc1"], id="not-msgpack"),
        pytest.param([b"kv-events", b"\x00"], id="two-frames"),
    ],
)
async def test_a_batch_that_does_not_decode_is_counted_and_the_next_one_still_goes(
    rig: Rig, frames: list[bytes]
) -> None:
    forwarder = await rig.start()
    rig.pub.send_multipart(frames)
    await eventually(lambda: forwarder.bad_batches == 1, what="the bad batch counted")
    rig.seq += 1  # it used a sequence number: the next batch shows it as lost
    rig.publish(blocks(1, 1))
    message = await rig.next_message()
    assert (message.events, message.missed) == (as_sent(blocks(1, 1)), 1)


async def test_beyond_the_queue_bound_the_queue_becomes_a_resync_so_nothing_is_lost_or_missed(
    rig: Rig,
) -> None:
    # A removal costs 2 items, a one-block batch 4 tokens + 1 hash + 1 = 6: the fourth block goes beyond 20.
    forwarder = await rig.start(max_queued_items=20)
    rig.session.registered = False
    rig.publish(BlockRemoved((7,)))
    for h in range(1, 6):
        rig.publish(blocks(h, 1, parent=h - 1 if h > 1 else None))
    rig.publish(BlockRemoved((5,)))
    await eventually(lambda: forwarder.engine_seq == rig.seq - 1, what="every batch read")
    assert (forwarder.resync_pending, forwarder.queued_events, forwarder.missed_total) == (True, 0, 0)
    rig.session.registered = True
    message = await rig.next_message()
    assert (message.missed, message.events) == (0, [KvEvent("cleared"), *as_sent(blocks(1, 4))])
    assert forwarder.resyncs == 1


async def test_every_welcome_discards_the_queue_and_resyncs_the_index_before_anything_else(rig: Rig) -> None:
    forwarder = await rig.start()
    rig.session.on_welcome = forwarder.session_started
    rig.publish(blocks(1, 2))
    rig.publish(blocks(3, 1, parent=2))
    first = await rig.messages_until(lambda got: len(events_of(got)) == 2)
    assert events_of(first) == as_sent(blocks(1, 2), blocks(3, 1, parent=2))
    # The orchestrator restarted (or expired us): our next messages are refused, then a Welcome.
    rig.session.registered = False
    rig.publish(BlockRemoved((3,)))
    await queued(forwarder, 1)
    for _ in range(2):  # a repeated Hello is answered twice: each Welcome resyncs
        rig.session.handle(
            Welcome(
                protocol_version=PROTOCOL_VERSION,
                agent_id="agent-1",
                heartbeat_interval_s=0.25,
                heartbeat_timeout_s=1.0,
            )
        )
        resync = await rig.next_message()
        assert resync.events == [KvEvent("cleared"), *as_sent(blocks(1, 2))]
    rig.publish(blocks(3, 1, parent=2))
    assert (await rig.next_message()).events == as_sent(blocks(3, 1, parent=2))
    assert (forwarder.resyncs, rig.session.welcomes) == (2, 2)


def test_a_welcome_hook_that_fails_is_logged_and_the_session_stays_registered(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("resync bug")

    rig.session.registered = False
    rig.session.on_welcome = broken
    rig.session.handle(
        Welcome(
            protocol_version=PROTOCOL_VERSION,
            agent_id="agent-1",
            heartbeat_interval_s=0.25,
            heartbeat_timeout_s=1.0,
        )
    )
    assert (rig.session.registered, rig.session.welcomes) == (True, 1)
    assert "the Welcome hook failed" in caplog.text


async def test_a_resync_bigger_than_a_message_leaves_in_bounded_messages_that_rebuild_the_index(
    rig: Rig,
) -> None:
    forwarder = await rig.start(max_message_items=13, max_message_events=2)  # two blocks an event
    rig.session.registered = False
    rig.publish(blocks(1, 10))
    rig.publish(BlockRemoved((1, 2)))  # ghosts: blocks 3-10 still chain through them
    await eventually(lambda: forwarder.engine_seq == rig.seq - 1, what="every batch read")
    stale = KvIndex()
    stale.apply("agent-1", as_sent(blocks(1, 3)))  # what the orchestrator knew: replaced, not merged
    live = KvIndex()
    live.apply("agent-1", as_sent(blocks(1, 10), BlockRemoved((1, 2))))
    rig.session.registered = True
    forwarder.session_started()
    messages = await rig.messages_until(lambda got: bool(got) and got[-1].events[-1].kind == "removed")
    assert all(len(m.events) <= 2 and sum(map(_items, m.events)) <= 13 for m in messages)
    assert [m.seq for m in messages] == list(range(messages[0].seq, messages[0].seq + len(messages)))
    stale.apply("agent-1", events_of(messages))
    assert stale.engine_blocks("agent-1") == live.engine_blocks("agent-1")
    assert len(live.engine_blocks("agent-1")) == 8


async def test_nothing_is_lost_while_the_orchestrator_is_not_connected() -> None:
    dealer = DealerTransport(f"tcp://127.0.0.1:{free_port()}")  # nobody listens there
    session = AgentSession(
        dealer, "agent-1", InstanceInfo(url="http://e", role="both", model="m"),
        engine_state=lambda: "ready", metrics=MetricsSnapshot,
    )  # fmt: skip
    session.registered = True
    forwarder = KvEventForwarder("tcp://127.0.0.1:1", session)
    try:
        forwarder.feed(encode_batch(0, 0.0, [blocks(1, 2)]))
        assert forwarder.flush() == 0
        assert (forwarder.queued_events, forwarder.seq) == (1, 0)
    finally:
        dealer.close()


@pytest.mark.parametrize(
    ("changes", "endpoint"),
    [
        pytest.param({}, "tcp://127.0.0.1:10100", id="launched: engine port + 2000 on loopback"),
        pytest.param(
            {"engine_host": "0.0.0.0", "kv_events_port": 9999},
            "tcp://127.0.0.1:9999",
            id="launched: the configured port, on loopback whatever the engine's host",
        ),
        pytest.param(
            {"engine": "vllm", "engine_host": "0.0.0.0"},
            f"ipc://{local_dir()}/events-a-8100.sock",
            id="launched vLLM: its ipc socket in the agent's private directory, never tcp",
        ),
        pytest.param({"attach_url": "http://10.0.0.5:8000"}, "", id="attached without an endpoint: off"),
        pytest.param(
            {"attach_url": "http://10.0.0.5:8000", "kv_events_endpoint": "tcp://10.0.0.5:5557"},
            "tcp://10.0.0.5:5557",
            id="attached with an endpoint: that one",
        ),
    ],
)
def test_forwarder_endpoint(changes: dict[str, Any], endpoint: str) -> None:
    cfg = AgentConfig(agent_id="a", role="both", engine_port=8100, **changes)
    assert forwarder_endpoint(cfg) == endpoint


def test_to_protocol_splits_removals_and_keeps_a_small_event_whole() -> None:
    assert list(to_protocol(BlockRemoved(tuple(range(5))), max_items=3)) == [
        KvEvent("removed", [0, 1]),
        KvEvent("removed", [2, 3]),
        KvEvent("removed", [4]),
    ]
    assert list(to_protocol(blocks(1, 2))) == [KvEvent("stored", [1, 2], None, TOKENS[:8], BS)]
    assert list(to_protocol(AllBlocksCleared())) == [KvEvent("cleared")]


def test_the_kv_events_endpoint_flag_reaches_the_config_and_must_be_a_zeromq_endpoint() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--agent-id", "a", "--role", "decode", "--attach", "http://10.0.0.5:8000"]
    args = parser.parse_args([*argv, "--kv-events-endpoint", "tcp://10.0.0.5:10101"])
    assert config_from_args(args).kv_events_endpoint == "tcp://10.0.0.5:10101"
    assert config_from_args(parser.parse_args(argv)).kv_events_endpoint == ""
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        config_from_args(parser.parse_args([*argv, "--kv-events-endpoint", "10.0.0.5:10101"]))


def test_keyed_blocks_are_not_forwarded_so_their_tokens_never_score_a_hit() -> None:
    keyed = BlockStored((1, 2), None, tuple(TOKENS[:8]), BS, keyed=True)
    assert list(to_protocol(keyed)) == []


async def test_a_connectors_tiers_are_indexed_as_pool_and_disk_and_never_mirrored(rig: Rig) -> None:
    # vLLM's offloading connector publishes its tiers' blocks beside the engine's own: host memory
    # ("CPU") and storage. The engine loads either on a hit, so routing counts them, apart.
    forwarder = await rig.start()
    rig.session.peer_minor = PROTOCOL_MINOR  # an orchestrator that indexes more than the engine's cache
    offloaded = dataclasses.replace(blocks(1, 2), medium="cpu")
    stored = dataclasses.replace(blocks(3, 1), medium="storage")
    rig.publish(blocks(1, 2), offloaded, stored, BlockRemoved((1,), medium="cpu"))
    sent = events_of(await rig.messages_until(lambda got: len(events_of(got)) >= 4))
    assert [(e.kind, e.medium, e.block_hashes) for e in sent] == [
        ("stored", MEDIUM_GPU, [1, 2]),
        ("stored", MEDIUM_POOL, [1, 2]),
        ("stored", MEDIUM_DISK, [3]),
        ("removed", MEDIUM_POOL, [1]),
    ]
    snapshot = forwarder.mirror.snapshot(1000)  # what a resync sends: the engine's own cache alone
    assert [(e.kind, e.block_hashes) for e in snapshot] == [("cleared", []), ("stored", [1, 2])]
