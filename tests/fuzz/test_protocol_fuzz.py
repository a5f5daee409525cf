"""Bad agents: whatever a peer sends to a real orchestrator's ZeroMQ socket, it refuses what is wrong with
a code and a reason, counts it, and keeps serving.

Each fuzzed message goes out from its own raw DEALER (so no example inherits a session from another),
followed by a probe frame of an unknown tag; the orchestrator handles one peer's frames in order, so
the probe's refusal marks the end of the answers to the fuzzed message. What the answer must be comes
from the codec (the reason of the ``CodecError`` it raises for those bytes) and, for frames that decode,
from the session rules of docs/protocol.md. After the examples: the refusal counter grew by exactly
what was refused, ``/health`` answers, and a well-behaved agent says Hello and heartbeats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import itertools
import logging
import math
import tracemalloc
import types
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import msgpack
import pytest
import zmq
import zmq.asyncio
from hypothesis import example, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from tests.fuzz.support import FUZZ, LoopThread, RawPeer, http_get, refused_counts
from tests.helpers import eventually_sync
from tests.integration.orchestrator_support import orch_config
from vllm_disagg import jsonutil
from vllm_disagg.errors import CodecError, FieldTypeError, MalformedFrame, UnknownMessageType
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.codec import decode, encode
from vllm_disagg.protocol.engine_urls import ENGINE_URL_REFUSED, EngineNetworks, engine_url_problem
from vllm_disagg.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    Command,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvEvents,
    Message,
    Refuse,
    Welcome,
    label_problem,
)
from vllm_disagg.protocol.transport import RouterTransport

MAX_FRAME = 16 * 1024  # the orchestrator's limit here: small, so oversized frames are cheap to make
GOOD_ID = "well-behaved-agent"  # no generated agent id or routing id is this
PROBE = bytes(msgpack.packb(["fuzz-probe", {}]))
PROBE_REFUSAL = Refuse(code="unknown_message_type", reason="unknown message type 'fuzz-probe'")
REPLY_TIMEOUT_S = 20.0
MAX_REASON = 1024  # a reason quotes the peer's bytes only in a bounded form
INT_MIN, UINT_MAX = -(2**63), 2**64 - 1  # msgpack's integer range

LOOPBACK = ipaddress.ip_address("127.0.0.1")


# --- valid messages, derived from the annotations (appended fields are fuzzed without edits here) ---

FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "agent_id": st.text(max_size=24).filter(lambda s: s != GOOD_ID),
    # A directory would make the orchestrator load a tokenizer from it: keep every one nonexistent.
    "tokenizer": st.just("") | st.text(max_size=16).map(lambda t: f"/nonexistent-fuzz/{t}"),
}


def values_of(tp: Any) -> st.SearchStrategy[Any]:
    """Every value the codec accepts for an annotation, extremes included (NaN, inf, 64-bit ints)."""
    origin = typing.get_origin(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(INT_MIN, UINT_MAX)
    if tp is float:
        return st.floats()
    if tp is str:
        return st.text(max_size=24)
    if tp is bytes:
        return st.binary(max_size=40)
    if origin is Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return st.one_of([st.none() if a is type(None) else values_of(a) for a in typing.get_args(tp)])
    if origin is list:
        return st.lists(values_of(typing.get_args(tp)[0]), max_size=6)
    if origin is dict:
        key, value = typing.get_args(tp)
        return st.dictionaries(values_of(key), values_of(value), max_size=4)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return structs(tp)
    raise TypeError(f"no strategy for {tp!r}")


def structs(cls: type[Any], **overrides: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Instances of a message or nested dataclass with every field drawn."""
    hints = typing.get_type_hints(cls)
    chosen = {**FIELD_VALUES, **overrides}
    fields = {
        f.name: chosen[f.name] if f.name in chosen else values_of(hints[f.name])
        for f in dataclasses.fields(cls)
    }
    return st.fixed_dictionaries(fields).map(lambda kwargs: cls(**kwargs))


messages: st.SearchStrategy[Message] = st.one_of([structs(cls) for cls in MESSAGE_TYPES])

# --- what a bad peer sends ---

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(INT_MIN, UINT_MAX)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, INT_MIN, UINT_MAX, 0.5, math.nan, math.inf, -math.inf, "", "é\u2028😀",
    "x" * 300, b"", b"\x00\xff", [], [1, "a", None], {}, {"k": [1]}, {1: 2}, {(1, 2): 3},
    msgpack.ExtType(7, b"ext"), msgpack.Timestamp(1, 0),
]  # fmt: skip
odd_values = st.sampled_from(ODD_VALUES) | msgpack_values
NEST = "\x00fuzz-nest\x00"  # packed in place of a deep value, then replaced by its bytes (packb nests <512)
ENVELOPES: list[Callable[[list[Any]], Any]] = [
    lambda t: t[1],  # fields alone
    lambda t: [t[0]],  # no fields
    lambda t: [*t, None],  # three elements
    lambda t: [t[1], t[0]],  # swapped
    lambda t: {t[0]: t[1]},  # a map
    lambda t: t[0],  # a bare tag
]


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True, strict_types=False))


def slots(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in a decoded frame, at any depth: the places a mutation can hit."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out: list[tuple[Any, Any]] = []
    for key, value in list(items):
        out.append((node, key))
        out.extend(slots(value))
    return out


def deep(depth: int, kind: str, leaf: bytes) -> bytes:
    """A value nested ``depth`` levels (msgpack refuses more than 1,024 on decode)."""
    return (b"\x91" if kind == "list" else b"\x81\xa1k") * depth + leaf


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame of some message type, then one mutation of its structure or of its bytes."""
    tree = msgpack.unpackb(encode(draw(messages)), raw=False)
    op = draw(
        st.sampled_from(
            ["replace", "drop", "add", "tag", "envelope", "nest", "flip", "truncate", "splice", "append"]
        )
    )
    if op in ("replace", "nest"):
        container, key = draw(st.sampled_from(slots(tree)))
        container[key] = NEST if op == "nest" else draw(odd_values)
        data = pack(tree)
        if op == "nest":
            depth = draw(st.integers(1, 1100))
            leaf = draw(st.sampled_from([b"\xc0", b"\x01", b"\xa5ready"]))
            data = data.replace(pack(NEST), deep(depth, draw(st.sampled_from(["list", "map"])), leaf))
        return data
    if op in ("drop", "add"):
        maps = [c[k] for c, k in slots(tree) if isinstance(c[k], dict)]
        target = draw(st.sampled_from(maps))
        if op == "drop" and target:
            del target[draw(st.sampled_from(sorted(target)))]
        else:
            target[draw(st.text(max_size=12))] = draw(msgpack_values)
        return pack(tree)
    if op == "tag":
        tree[0] = draw(st.text(max_size=40) | st.text(min_size=1000, max_size=1000) | odd_values)
        return pack(tree)
    if op == "envelope":
        return pack(draw(st.sampled_from(ENVELOPES))(tree))
    raw = bytearray(pack(tree))
    if op == "flip":
        for bit in draw(st.lists(st.integers(0, len(raw) * 8 - 1), min_size=1, max_size=8)):
            raw[bit // 8] ^= 1 << (bit % 8)
    elif op == "truncate":
        del raw[draw(st.integers(0, len(raw) - 1)) :]
    elif op == "splice":
        at = draw(st.integers(0, len(raw)))
        raw[at:at] = draw(st.binary(min_size=1, max_size=16))
    else:
        raw += draw(st.binary(min_size=1, max_size=16))
    return bytes(raw)


random_envelopes = st.builds(
    lambda tag, fields: pack([tag, fields]),
    st.sampled_from([cls.TAG for cls in MESSAGE_TYPES]) | st.text(max_size=12),
    st.dictionaries(st.text(max_size=12), msgpack_values, max_size=6) | msgpack_values,
)
bad_frames = st.binary(max_size=2048) | mutated_frames() | random_envelopes


# --- the orchestrator under test, and the oracle ---


@dataclass(frozen=True, slots=True)
class Expect:
    """The orchestrator's designed answer to one message from a peer without a session."""

    refuse: str | None = None  # the code of the Refuse it must send
    reason: str | None = None  # its exact reason, where the codec gives one
    welcome: str | None = None  # the agent id of the Welcome it must send instead


def expect_for_message(msg: Message) -> Expect:
    """docs/protocol.md: what a peer that has not said Hello (yet) gets for a well-formed message."""
    if isinstance(msg, Hello):
        if msg.protocol_version != PROTOCOL_VERSION:
            return Expect(refuse="version_mismatch")
        if not msg.agent_id or label_problem(msg.instance.labels) is not None:
            return Expect(refuse="invalid_hello")
        # The peers connect over loopback, to an orchestrator that allows no other engine network.
        if engine_url_problem(msg.instance.url, LOOPBACK, EngineNetworks()) is not None:
            return Expect(refuse=ENGINE_URL_REFUSED)
        return Expect(welcome=msg.agent_id)
    if isinstance(msg, Heartbeat | KvEvents):
        return Expect(refuse="unknown_agent")
    if isinstance(msg, Welcome | Command):
        return Expect(refuse="unexpected_message")
    if isinstance(msg, Ack | Goodbye | Refuse):
        return Expect()  # logged (or matched to nothing) and not answered
    raise AssertionError(f"say what the orchestrator answers a {type(msg).__name__} from a stranger")


def expect_for(parts: list[bytes]) -> Expect:
    """The answer to a message of these parts, with the codec as the oracle for each frame's fate."""
    if len(parts) != 1:
        return Expect(refuse=MalformedFrame.code)
    try:
        msg = decode(parts[0], max_bytes=MAX_FRAME)
    except CodecError as exc:
        return Expect(refuse=exc.code, reason=str(exc))
    return expect_for_message(msg)


def codec_refuses(frame: bytes) -> bool:
    """Whether the codec refuses these bytes (whatever a session would make of the message)."""
    return expect_for([frame]).reason is not None


@dataclass
class Orchestrator:
    """A real orchestrator on its own loop, the test's ZeroMQ context, and the refusals it must count."""

    server: OrchestratorServer
    ctx: zmq.Context[zmq.Socket[bytes]]
    caplog: pytest.LogCaptureFixture
    baseline: Counter[str]
    refused: Counter[str] = field(default_factory=Counter)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def peer(self, monitor_events: int = 0) -> RawPeer:
        """A raw agent socket with a routing id no other peer had (and a monitor of these events)."""
        identity = f"fuzz-{next(self._ids)}".encode()
        return RawPeer(self.ctx, self.server.zmq_endpoint, identity, monitor_events)

    def exchange(self, peer: RawPeer, parts: list[bytes]) -> list[Message]:
        """Send a message, then the probe; every answer before the probe's refusal."""
        peer.send(parts)
        peer.send([PROBE])
        self.refused[PROBE_REFUSAL.code] += 1
        answers: list[Message] = []
        while True:
            raw = peer.recv(REPLY_TIMEOUT_S)
            answer = decode(raw)
            if answer == PROBE_REFUSAL:
                return answers
            answers.append(answer)

    def check(self, parts: list[bytes]) -> list[Message]:
        """Send one message from a fresh peer; assert the orchestrator gave exactly its designed answer."""
        expected = expect_for(parts)
        peer = self.peer()
        try:
            answers = self.exchange(peer, parts)
        finally:
            peer.close()
        if expected.refuse is not None:
            self.refused[expected.refuse] += 1
            assert len(answers) == 1 and isinstance(answers[0], Refuse), answers
            refusal = answers[0]
            assert refusal.code == expected.refuse, (refusal, expected)
            assert refusal.reason.strip(), "a refusal says why"
            assert len(refusal.reason) <= MAX_REASON, len(refusal.reason)
            if expected.reason is not None:
                assert refusal.reason == expected.reason
        elif expected.welcome is not None:
            assert len(answers) == 1 and isinstance(answers[0], Welcome), answers
            assert answers[0].agent_id == expected.welcome
        else:
            assert answers == []
        return answers


@pytest.fixture
def orch(caplog: pytest.LogCaptureFixture) -> Iterator[Orchestrator]:
    """A real orchestrator (16 KiB frames, sessions that outlive a slow example) on real sockets."""
    caplog.set_level(logging.ERROR, logger="vllm_disagg")
    loop = LoopThread()
    config = orch_config(max_frame_bytes=MAX_FRAME, heartbeat_interval_s=0.5, heartbeat_timeout_s=60.0)
    server = loop.run(start_orchestrator(config, shutdown_timeout_s=2.0))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield Orchestrator(server, ctx, caplog, refused_counts(server.url))
    finally:
        ctx.destroy(linger=0)
        loop.run(server.close())
        loop.close()


def assert_still_serving(orch: Orchestrator) -> None:
    """No handler failed; every refusal counted once; /health answers; a well-behaved agent joins."""
    errors = [r.getMessage() for r in orch.caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, f"the orchestrator logged errors (a handler or a task failed): {errors}"
    after = refused_counts(orch.server.url)
    grown = {code: after[code] - orch.baseline[code] for code in after if after[code] != orch.baseline[code]}
    assert grown == dict(orch.refused), "vllm_disagg_protocol_refused_total grew by what was refused"
    status, body = http_get(f"{orch.server.url}/health")
    assert status in (200, 503) and jsonutil.loads(body)["status"], (status, body)  # 503: no decode yet
    good = RawPeer(orch.ctx, orch.server.zmq_endpoint, GOOD_ID.encode())
    try:
        info = InstanceInfo(url="http://127.0.0.1:9", role="decode", model="fuzz-model", engine="sim")
        good.send([encode(Hello(protocol_version=PROTOCOL_VERSION, agent_id=GOOD_ID, instance=info))])
        welcome = decode(good.recv(REPLY_TIMEOUT_S))
        assert isinstance(welcome, Welcome) and welcome.agent_id == GOOD_ID, welcome
        assert orch.exchange(good, [encode(Heartbeat(seq=1, engine_state="ready"))]) == []
    finally:
        good.close()

    def heartbeat_seen() -> bool:
        body = jsonutil.loads(http_get(f"{orch.server.url}/admin/v1/instances")[1])
        return any(i["agent_id"] == GOOD_ID and i["heartbeats"] >= 1 for i in body["instances"])

    eventually_sync(heartbeat_seen, timeout=REPLY_TIMEOUT_S, what="the well-behaved agent's heartbeat")
    assert http_get(f"{orch.server.url}/health")[0] == 200, (
        "its ready decode instance makes the service healthy"
    )


# --- through the orchestrator ---

DEEP_LITERAL = b"\x92\xa9heartbeat\x82\xa3seq\x01\xacengine_state" + deep(1010, "list", b"\xc0")


def test_random_and_mutated_frames_are_each_refused_with_the_codecs_code_and_reason(
    orch: Orchestrator,
) -> None:
    @settings(FUZZ, max_examples=500)
    @given(frame=bad_frames)
    @example(frame=DEEP_LITERAL)  # regression: quoting the value raised RecursionError, killing the reader
    @example(frame=pack(["t" * 10_000, {}]))  # regression: the reason echoed the whole tag
    @example(frame=pack(["ack", {f"f{i}": 0 for i in range(1000)}]))  # and every unknown field
    @example(frame=b"")
    @example(frame=b"\xdd\xff\xff\xff\xff")  # an array header claiming 4 billion elements
    def one(frame: bytes) -> None:
        orch.check([frame])

    one()
    assert_still_serving(orch)


def test_well_formed_messages_get_the_answer_the_session_rules_give_a_stranger(orch: Orchestrator) -> None:
    @settings(FUZZ, max_examples=200)
    @given(msg=messages)
    @example(msg=Hello(PROTOCOL_VERSION, "fuzz-agent", InstanceInfo(url="u", role="both", model="m")))
    @example(msg=Hello(PROTOCOL_VERSION, "", InstanceInfo(url="u", role="both", model="m")))
    def one(msg: Message) -> None:
        orch.check([encode(msg)])

    one()
    assert_still_serving(orch)


def padded_goodbye(size: int) -> bytes:
    """A valid Goodbye frame of exactly ``size`` bytes (256 < size < 65,536)."""
    overhead = len(encode(Goodbye(reason="x" * 300))) - 300
    data = encode(Goodbye(reason="x" * (size - overhead)))
    assert len(data) == size
    return data


def test_frames_over_the_limit_are_refused_before_decoding_and_one_at_the_limit_is_read(
    orch: Orchestrator,
) -> None:
    @settings(FUZZ, max_examples=30)
    @given(size=st.integers(MAX_FRAME + 1, 2 * MAX_FRAME), garbage=st.booleans())
    @example(size=MAX_FRAME, garbage=False)  # at the limit: a Goodbye from a stranger, read and not answered
    @example(size=MAX_FRAME + 1, garbage=False)
    def one(size: int, garbage: bool) -> None:
        frame = b"\xc1" * size if garbage else padded_goodbye(size)
        answers = orch.check([frame])
        if size > MAX_FRAME:
            assert answers == [Refuse("frame_too_large", f"frame of {size} bytes is over the limit of 16384")]

    one()
    assert_still_serving(orch)


def test_messages_of_several_parts_are_refused_by_their_part_count(orch: Orchestrator) -> None:
    part = st.binary(max_size=256) | messages.map(encode)

    @settings(FUZZ, max_examples=100)
    @given(parts=st.lists(part, min_size=2, max_size=64))
    @example(parts=[encode(Goodbye()), b""])
    def one(parts: list[bytes]) -> None:
        (refusal,) = orch.check(parts)
        assert isinstance(refusal, Refuse)
        assert f"expected 1 frame part, got {len(parts)}" in refusal.reason

    one()
    assert_still_serving(orch)


def test_an_agent_with_a_session_may_report_extreme_metrics_and_its_bad_frames_are_still_refused(
    orch: Orchestrator,
) -> None:
    """NaN, inf, negative and 64-bit values are well-formed: accepted, and the admin API still renders."""
    peer = RawPeer(orch.ctx, orch.server.zmq_endpoint, b"extreme")
    info = InstanceInfo(url="http://127.0.0.1:9", role="both", model="fuzz-model", engine="sim")
    peer.send([encode(Hello(protocol_version=PROTOCOL_VERSION, agent_id="extreme", instance=info))])
    assert isinstance(decode(peer.recv(REPLY_TIMEOUT_S)), Welcome)
    live = st.sampled_from(["starting", "ready", "unhealthy", "restarting"])  # "stopped" ends the session
    counts = st.integers(0, UINT_MAX)  # negative: test_a_kv_events_with_a_negative_missed_count_...
    reports = structs(Heartbeat, engine_state=live).map(encode) | structs(KvEvents, missed=counts).map(encode)

    @settings(FUZZ, max_examples=100)
    @given(frame=reports | mutated_frames().filter(codec_refuses))
    def one(frame: bytes) -> None:
        answers = orch.exchange(peer, [frame])
        if codec_refuses(frame):
            expected = expect_for([frame])
            assert expected.refuse is not None and expected.reason is not None
            orch.refused[expected.refuse] += 1
            assert answers == [Refuse(expected.refuse, expected.reason)]
        else:
            assert answers == [], "a heartbeat or KvEvents from a live session is not answered"
        for path in ("/admin/v1/instances", "/metrics", "/admin/v1/scheduler"):
            assert http_get(orch.server.url + path)[0] == 200

    try:
        one()
    finally:
        peer.close()
    assert_still_serving(orch)


def test_a_kv_events_with_a_negative_missed_count_is_refused_and_breaks_nothing(orch: Orchestrator) -> None:
    peer = RawPeer(orch.ctx, orch.server.zmq_endpoint, b"negative")
    try:
        info = InstanceInfo(url="http://127.0.0.1:9", role="both", model="fuzz-model", engine="sim")
        peer.send([encode(Hello(protocol_version=PROTOCOL_VERSION, agent_id="negative", instance=info))])
        assert isinstance(decode(peer.recv(REPLY_TIMEOUT_S)), Welcome)
        answers = orch.exchange(peer, [encode(KvEvents(seq=1, events=[], missed=-1))])
    finally:
        peer.close()
    assert len(answers) == 1 and isinstance(answers[0], Refuse), answers
    assert answers[0].code == "field_type_error" and "missed" in answers[0].reason
    orch.refused["field_type_error"] += 1
    assert_still_serving(orch)


def test_a_part_over_twice_the_limit_drops_the_connection_in_libzmq_and_nothing_is_refused(
    orch: Orchestrator,
) -> None:
    peer = orch.peer(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    monitor = peer.monitor
    assert monitor is not None

    def next_event() -> int:
        assert monitor.poll(int(REPLY_TIMEOUT_S * 1000)), "no socket event"
        return int(recv_monitor_message(monitor)["event"])

    try:
        assert next_event() == zmq.EVENT_HANDSHAKE_SUCCEEDED
        peer.send([b"\xc1" * (2 * MAX_FRAME + 1)])
        assert next_event() == zmq.EVENT_DISCONNECTED
    finally:
        peer.close()
    assert_still_serving(orch)  # and the refusal counter did not move


# --- the transport alone ---


async def test_a_message_of_many_large_parts_is_refused_without_being_copied() -> None:
    """A peer can make libzmq buffer N parts of just under the limit; the transport must not copy them."""
    router = RouterTransport("tcp://127.0.0.1:0", max_frame_bytes=1 << 20)
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(router.endpoint)
    part = b"\x00" * (1 << 20)
    try:
        await dealer.send_multipart([part] * 24)
        await dealer.send(encode(Goodbye(reason="after the parts")))
        tracemalloc.start()
        try:
            refused = await asyncio.wait_for(router.recv(), REPLY_TIMEOUT_S)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert isinstance(refused.error, MalformedFrame)
        assert "got 24 (25165824 bytes in all)" in str(refused.error)
        assert peak < 4 << 20, f"receiving 24 MiB of parts allocated {peak} bytes"  # a copy is 24 MiB
        after = await asyncio.wait_for(router.recv(), REPLY_TIMEOUT_S)
        assert after.message == Goodbye(reason="after the parts")
    finally:
        dealer.close(linger=0)
        ctx.term()
        router.close()


# --- the codec alone ---


@settings(FUZZ, max_examples=1000)
@given(frame=bad_frames)
@example(frame=DEEP_LITERAL)
def test_decoding_any_bytes_returns_a_message_or_raises_a_codec_error_with_a_short_reason(
    frame: bytes,
) -> None:
    try:
        decode(frame, max_bytes=MAX_FRAME)
    except CodecError as exc:
        assert exc.code and str(exc).strip()
        assert len(str(exc)) <= MAX_REASON
    # Anything else raised fails here: the transport only turns a CodecError into a refusal.


@settings(FUZZ, max_examples=300)
@given(msg=messages)
def test_every_well_formed_message_round_trips_from_bytes_and_from_a_buffer_view(msg: Message) -> None:
    data = encode(msg)
    for frame in (data, memoryview(data)):
        back = decode(frame)
        assert type(back) is type(msg)
        assert encode(back) == data  # NaN != NaN: compare the bytes, which are equal


LONG = 100_000


@pytest.mark.parametrize(
    ("frame", "error", "fragment"),
    [
        pytest.param(DEEP_LITERAL, FieldTypeError, "got [[[...]]]", id="a-literal-nested-1010-lists-deep"),
        pytest.param(
            b"\x92\xa9heartbeat\x82\xa3seq\x01\xacengine_state" + deep(1010, "map", b"\xc0"),
            FieldTypeError,
            "got {'k': {'k': {...}}}",
            id="a-literal-nested-1010-maps-deep",
        ),
        pytest.param(pack(["t" * LONG, {}]), UnknownMessageType, "...", id="an-unknown-tag-of-100k-chars"),
        pytest.param(
            pack(["heartbeat", {"seq": 1, "engine_state": "r" * LONG}]),
            FieldTypeError,
            "rrr...",
            id="a-literal-of-100k-chars",
        ),
        pytest.param(
            pack(["command", {"id": 1, "kind": "drain", "args": {"k" * LONG: 1}}]),
            FieldTypeError,
            f"({LONG + 5} chars)",
            id="a-map-key-of-100k-chars-in-the-field-path",
        ),
    ],
)
def test_a_hostile_value_is_quoted_in_a_bounded_reason_and_never_crashes_the_codec(
    frame: bytes, error: type[CodecError], fragment: str
) -> None:
    with pytest.raises(error) as caught:
        decode(frame)
    assert fragment in str(caught.value)
    assert len(str(caught.value)) <= MAX_REASON
