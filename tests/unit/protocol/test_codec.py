"""The codec: every message survives a round trip, and every bad frame is refused with a typed reason."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_disagg import jsonutil
from vllm_disagg.errors import (
    CodecError,
    FieldTypeError,
    FrameTooLarge,
    MalformedFrame,
    UnknownMessageType,
)
from vllm_disagg.protocol.codec import DEFAULT_MAX_FRAME_BYTES, decode, encode
from vllm_disagg.protocol.messages import (
    ENGINE_STATES,
    MESSAGE_TYPES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    RESTART_REQUIRED,
    Ack,
    Command,
    EngineCapabilities,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvEvent,
    KvEvents,
    Message,
    MetricsSnapshot,
    Refuse,
    Welcome,
)

INSTANCE = InstanceInfo(
    url="http://127.0.0.1:8101",
    role="prefill",
    model="tiny",
    engine="sim",
    revision="r1",
    block_size=128,
    kv_connector="NixlConnector",
    max_model_len=512,
    tokenizer="/models/tiny",
    capabilities=EngineCapabilities(known=True, completions_token_ids=True),
)
METRICS = MetricsSnapshot(
    scraped_at=1.7e9 + 0.5,
    num_running=3,
    num_waiting=2,
    kv_cache_usage=0.25,
    ttft_s=0.125,
    tpot_s=None,
    prefix_cache_hit_rate=0.5,
    window_s=9.75,
    requests_finished=42,
    prompt_tokens=1000,
    generation_tokens=2000,
    queue_s=0.0625,
    prefill_tokens_per_s=None,
    mean_prompt_tokens=300.5,
)
U64_MAX = 2**64 - 1
KV_EVENTS = KvEvents(
    seq=3,
    events=[
        KvEvent("stored", [U64_MAX, 2**63], None, list(range(8)), 4),
        KvEvent("stored", [5], U64_MAX, [9, 9, 9, 9], 4),
        KvEvent("removed", [2**63, 5]),
        KvEvent("cleared"),
    ],
    missed=2,
)

# One example of every message, each with non-default values, including nested structs and None.
EXAMPLES: list[Message] = [
    Hello(protocol_version=PROTOCOL_VERSION, agent_id="agent-p0", instance=INSTANCE),
    Welcome(
        protocol_version=PROTOCOL_VERSION,
        agent_id="agent-p0",
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=2,
    ),
    Refuse(code="version_mismatch", reason="orchestrator speaks protocol 1, agent speaks 2"),
    Heartbeat(seq=7, engine_state="unhealthy", draining=True, metrics=METRICS),
    Heartbeat(seq=1, engine_state="starting"),
    Command(id=9, kind="shutdown", args={"reason": "scale-in", "grace_s": "5"}),
    Ack(id=9, ok=False, error="engine did not stop"),
    Goodbye(reason="shutdown command"),
    KV_EVENTS,
    KvEvents(seq=4),
]


def frame(tag: Any, fields: Any) -> bytes:
    """A hand-built frame, for shapes the encoder would never produce."""
    return bytes(msgpack.packb([tag, fields], use_bin_type=True))


def hello_fields(**changes: Any) -> dict[str, Any]:
    """A valid Hello's fields with some changed (a value of ``...`` removes the field)."""
    fields: dict[str, Any] = {
        "protocol_version": 1,
        "agent_id": "a",
        "instance": {"url": "http://x", "role": "decode", "model": "m"},
    }
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not ...}


def test_examples_cover_every_message_type() -> None:
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: f"{m.TAG}")
def test_every_message_round_trips_unchanged(message: Message) -> None:
    data = encode(message)
    assert decode(data) == message
    assert msgpack.unpackb(data)[0] == message.TAG  # the envelope is [tag, fields]


def test_a_float_field_sent_as_an_int_decodes_as_a_float() -> None:
    decoded = decode(encode(Welcome(1, "a", heartbeat_interval_s=1, heartbeat_timeout_s=3)))
    assert isinstance(decoded, Welcome)
    assert isinstance(decoded.heartbeat_interval_s, float)
    assert decoded.heartbeat_interval_s == 1.0


def test_fields_appended_with_defaults_may_be_omitted_by_an_older_peer() -> None:
    decoded = decode(frame("heartbeat", {"seq": 3, "engine_state": "ready"}))
    assert decoded == Heartbeat(seq=3, engine_state="ready", draining=False, metrics=MetricsSnapshot())


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
counts = st.integers(min_value=0, max_value=2**63 - 1)


@given(
    seq=counts,
    state=st.sampled_from(ENGINE_STATES),
    draining=st.booleans(),
    metrics=st.builds(
        MetricsSnapshot,
        scraped_at=finite,
        num_running=counts,
        num_waiting=counts,
        kv_cache_usage=finite,
        ttft_s=st.none() | finite,
        tpot_s=st.none() | finite,
        prefix_cache_hit_rate=st.none() | finite,
        window_s=finite,
        requests_finished=counts,
        prompt_tokens=counts,
        generation_tokens=counts,
    ),
)
def test_any_heartbeat_round_trips(seq: int, state: Any, draining: bool, metrics: MetricsSnapshot) -> None:
    message = Heartbeat(seq=seq, engine_state=state, draining=draining, metrics=metrics)
    assert decode(encode(message)) == message


hashes = st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=8)
kv_event = st.builds(
    KvEvent,
    kind=st.sampled_from(("stored", "removed", "cleared")),
    block_hashes=hashes,
    parent_block_hash=st.none() | st.integers(min_value=0, max_value=2**64 - 1),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31), max_size=64),
    block_size=st.integers(min_value=0, max_value=1024),
)


@given(seq=counts, events=st.lists(kv_event, max_size=10), missed=counts)
def test_any_kv_events_round_trip(seq: int, events: list[KvEvent], missed: int) -> None:
    message = KvEvents(seq=seq, events=events, missed=missed)
    assert decode(encode(message)) == message


def test_kv_events_decode_into_kv_event_instances_with_defaults_for_omitted_fields() -> None:
    decoded = decode(frame("kv_events", {"seq": 1, "events": [{"kind": "cleared"}]}))
    assert decoded == KvEvents(seq=1, events=[KvEvent("cleared", [], None, [], 0)], missed=0)
    assert isinstance(decoded, KvEvents) and type(decoded.events[0]) is KvEvent


def test_the_largest_kv_events_an_agent_sends_fits_the_default_frame_limit() -> None:
    # The forwarder's limits: 2,000 events, 50,000 token ids + hashes + events; hashes are the widest.
    events = [KvEvent("stored", [U64_MAX] * 24, U64_MAX, [], 2**31) for _ in range(2000)]
    data = encode(KvEvents(seq=2**63, events=events, missed=2**63))
    assert len(data) < DEFAULT_MAX_FRAME_BYTES
    assert decode(data) == KvEvents(seq=2**63, events=events, missed=2**63)


def test_nan_metrics_survive_a_round_trip() -> None:
    decoded = decode(encode(Heartbeat(1, "ready", metrics=MetricsSnapshot(kv_cache_usage=math.nan))))
    assert isinstance(decoded, Heartbeat)
    assert math.isnan(decoded.metrics.kv_cache_usage)


GOOD = encode(EXAMPLES[3])

REFUSALS: list[tuple[str, bytes, type[CodecError], str]] = [
    ("garbage bytes are malformed", b"\xc1\xc1\xc1", MalformedFrame, "not a msgpack frame"),
    ("an empty frame is malformed", b"", MalformedFrame, "not a msgpack frame"),
    ("a truncated frame is malformed", GOOD[:-5], MalformedFrame, "incomplete"),
    ("trailing bytes after the envelope are malformed", GOOD + b"\x00", MalformedFrame, "not a msgpack"),
    ("a bare map is not an envelope", msgpack.packb({"seq": 1}), MalformedFrame, "[tag, fields]"),
    ("an envelope of one element is malformed", msgpack.packb(["ack"]), MalformedFrame, "[tag, fields]"),
    ("a tag that is not a string is malformed", frame(7, {}), MalformedFrame, "[tag, fields]"),
    ("integer map keys are malformed", frame("ack", {1: 2}), MalformedFrame, "map key"),
    ("deeply nested garbage is malformed", b"\x91" * 100_000, MalformedFrame, "StackError"),
    ("an unknown tag is refused", frame("teleport", {}), UnknownMessageType, "'teleport'"),
    ("fields that are not a map", frame("ack", [1, True]), FieldTypeError, "map of fields"),
    ("a missing field", frame("ack", {"ok": True}), FieldTypeError, "missing field(s) ['id']"),
    (
        "a string where an int belongs",
        frame("ack", {"id": "1", "ok": True}),
        FieldTypeError,
        "'id': expected int",
    ),
    (
        "a bool where an int belongs",
        frame("ack", {"id": True, "ok": True}),
        FieldTypeError,
        "expected int, got bool",
    ),
    (
        "an int where a bool belongs",
        frame("ack", {"id": 1, "ok": 1}),
        FieldTypeError,
        "expected bool, got int",
    ),
    ("a float where an int belongs", frame("ack", {"id": 1.0, "ok": True}), FieldTypeError, "expected int"),
    (
        "a bool where a float belongs",
        frame(
            "welcome",
            {
                "protocol_version": 1,
                "agent_id": "a",
                "heartbeat_interval_s": True,
                "heartbeat_timeout_s": 1.0,
            },
        ),
        FieldTypeError,
        "'heartbeat_interval_s': expected float, got bool",
    ),
    (
        "bytes where a str belongs",
        frame("goodbye", {"reason": b"bye"}),
        FieldTypeError,
        "expected str, got bytes",
    ),
    ("a None where None is not allowed", frame("goodbye", {"reason": None}), FieldTypeError, "expected str"),
    (
        "a wrong literal value",
        frame("heartbeat", {"seq": 1, "engine_state": "asleep"}),
        FieldTypeError,
        "'engine_state': expected one of",
    ),
    ("a wrong command kind", frame("command", {"id": 1, "kind": "explode"}), FieldTypeError, "'kind'"),
    (
        "a wrong nested field type",
        frame("heartbeat", {"seq": 1, "engine_state": "ready", "metrics": {"ttft_s": "fast"}}),
        FieldTypeError,
        "'metrics.ttft_s'",
    ),
    (
        "a nested struct that is not a map",
        frame("hello", hello_fields(instance="http://x")),
        FieldTypeError,
        "'instance': expected map of fields",
    ),
    (
        "a missing nested field",
        frame("hello", hello_fields(instance={"url": "u", "role": "both"})),
        FieldTypeError,
        "missing field(s) ['model']",
    ),
    (
        "a wrong nested literal",
        frame("hello", hello_fields(instance={"url": "u", "role": "x", "model": "m"})),
        FieldTypeError,
        "'instance.role'",
    ),
    (
        "a missing top-level struct",
        frame("hello", hello_fields(instance=...)),
        FieldTypeError,
        "['instance']",
    ),
    (
        "a wrong event kind in a list of structs",
        frame("kv_events", {"seq": 1, "events": [{"kind": "stored"}, {"kind": "moved"}]}),
        FieldTypeError,
        "'events[1].kind': expected one of",
    ),
    (
        "a struct in a list that is not a map",
        frame("kv_events", {"seq": 1, "events": [7]}),
        FieldTypeError,
        "'events[0]': expected map of fields",
    ),
    (
        "a bool among the ints of a long list",
        frame("kv_events", {"seq": 1, "events": [{"kind": "stored", "token_ids": [1] * 1000 + [True]}]}),
        FieldTypeError,
        "'events[0].token_ids[1000]': expected int, got bool",
    ),
    (
        "a map value of the wrong type",
        frame("command", {"id": 1, "kind": "drain", "args": {"a": 1}}),
        FieldTypeError,
        "'args.a': expected str",
    ),
]


@pytest.mark.parametrize(("data", "error", "reason"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_bad_frames_are_refused_with_a_typed_error_and_a_reason(
    data: bytes, error: type[CodecError], reason: str
) -> None:
    with pytest.raises(error) as caught:
        decode(data)
    assert reason in str(caught.value)
    assert caught.value.code  # every refusal carries a machine-readable code for Refuse


def test_a_frame_over_the_limit_is_refused_before_decoding() -> None:
    # Garbage that would be malformed if decoded: FrameTooLarge proves the size check comes first.
    with pytest.raises(FrameTooLarge, match="over the limit of 100"):
        decode(b"\xc1" * 101, max_bytes=100)


def test_a_frame_at_the_limit_is_decoded() -> None:
    data = encode(Goodbye(reason="x" * 50))
    assert decode(data, max_bytes=len(data)) == Goodbye(reason="x" * 50)


def test_the_default_limit_refuses_a_huge_heartbeat() -> None:
    data = encode(Goodbye(reason="x" * DEFAULT_MAX_FRAME_BYTES))
    with pytest.raises(FrameTooLarge):
        decode(data)


def test_encoding_something_that_is_not_a_message_is_refused() -> None:
    with pytest.raises(UnknownMessageType, match="MetricsSnapshot"):
        encode(METRICS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (FrameTooLarge, "frame_too_large"),
        (MalformedFrame, "malformed_frame"),
        (UnknownMessageType, "unknown_message_type"),
        (FieldTypeError, "field_type_error"),
    ],
)
def test_refusal_codes_are_stable(error: type[CodecError], code: str) -> None:
    assert error.code == code


def test_every_example_in_the_protocol_doc_decodes_and_every_message_has_one() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "protocol.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", doc, flags=re.DOTALL)
    decoded = [decode(bytes(msgpack.packb(jsonutil.loads(block), use_bin_type=True))) for block in blocks]
    assert {type(m) for m in decoded} == set(MESSAGE_TYPES)


# --- versions: a newer minor's fields -------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (frame("ack", {"id": 1, "ok": True, "x": 0}), Ack(id=1, ok=True)),
        (
            frame("heartbeat", {"seq": 1, "engine_state": "ready", "metrics": {"gpu": 1, "num_running": 2}}),
            Heartbeat(seq=1, engine_state="ready", metrics=MetricsSnapshot(num_running=2)),
        ),
        (
            frame("kv_events", {"seq": 1, "events": [{"kind": "cleared", "tier": "host"}]}),
            KvEvents(seq=1, events=[KvEvent(kind="cleared")]),
        ),
        (frame("ack", {"id": 1, "ok": True, **{f"f{i}": 0 for i in range(10_000)}}), Ack(id=1, ok=True)),
    ],
    ids=["top level", "nested", "in a struct of a list", "ten thousand of them"],
)
def test_fields_a_newer_minor_version_adds_are_ignored(raw: bytes, expected: object) -> None:
    assert decode(raw) == expected


def test_an_agent_that_did_not_learn_its_engines_capabilities_sends_none_and_is_assumed_vllm() -> None:
    unknown = dataclasses.replace(INSTANCE, capabilities=EngineCapabilities())
    assert "capabilities" not in msgpack.unpackb(encode(Hello(1, "a", unknown)))[1]["instance"]
    assert "capabilities" in msgpack.unpackb(encode(Hello(1, "a", INSTANCE)))[1]["instance"]
    assert all(
        unknown.capabilities.token_ids(chat) and unknown.capabilities.resumes(chat) for chat in (False, True)
    )
    assert INSTANCE.capabilities.missing() == ["chat_token_ids", "chat_prompt_ids"]


def test_fields_added_after_1_0_are_left_out_while_they_hold_their_default() -> None:
    """A peer of 1.0 refuses fields it does not know: a Hello or Welcome to it must not carry the minor."""
    old = Hello(protocol_version=1, agent_id="a", instance=INSTANCE)
    new = dataclasses.replace(old, protocol_minor=PROTOCOL_MINOR)
    assert "protocol_minor" not in msgpack.unpackb(encode(old))[1]
    assert msgpack.unpackb(encode(new))[1]["protocol_minor"] == PROTOCOL_MINOR
    assert decode(encode(old)) == old and decode(encode(new)) == new
    welcome = Welcome(protocol_version=1, agent_id="a", heartbeat_interval_s=0.25, heartbeat_timeout_s=1.0)
    assert "protocol_minor" not in msgpack.unpackb(encode(welcome))[1]
    refused = Ack(id=1, ok=False, error="no")
    assert msgpack.unpackb(encode(refused))[1] == {"id": 1, "ok": False, "error": "no"}
    restart = Ack(id=1, ok=False, error="no", code=RESTART_REQUIRED)  # 1.2, only to an orchestrator of 1.2
    assert msgpack.unpackb(encode(restart))[1]["code"] == RESTART_REQUIRED
    assert decode(encode(restart)) == restart
