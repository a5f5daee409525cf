"""The schema of every message that crosses a process boundary, written down: each one's fields by
name and in order, and a round trip through its link's encoding. A failure here means a peer of
another release would read the message differently: renaming, removing or re-typing a field is a new
major version (orchestrator <-> agent) or a new version (KV frames, the local link), and an added
field goes at the end with a default, marked with the minor that added it (docs/protocol.md).

The links: orchestrator <-> agent (``protocol/``), agent <-> agent KV frames (``agent/kv/frames.py``),
connector <-> agent (``agent/kv/local_messages.py``). The gateway workers' link is pickles on a local
socket of one installation (``orchestrator/gateway/workers``), and vLLM's KV events and HTTP API are vLLM's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from vllm_disagg.agent.kv import frames, local_messages
from vllm_disagg.agent.kv.arena import Geometry
from vllm_disagg.agent.kv.local_messages import (
    A,
    Commit,
    Committed,
    LocalAnswer,
    LocalRequest,
    Lookup,
    Open,
    Opened,
    Pinned,
    Release,
    Released,
    Reserve,
    Reserved,
    SaveBlock,
    answer_to_wire,
    read_answer,
    read_request,
    request_to_wire,
)
from vllm_disagg.protocol import commands
from vllm_disagg.protocol.codec import decode, encode
from vllm_disagg.protocol.messages import (
    MESSAGE_TYPES,
    Ack,
    Command,
    EngineCapabilities,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvEvent,
    KvEvents,
    KvLayout,
    KvLinkCount,
    Message,
    MetricsSnapshot,
    Refuse,
    Welcome,
)


def names(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# --- orchestrator <-> agent ---------------------------------------------------------------------------

PROTOCOL_FIELDS: dict[type[Any], tuple[str, ...]] = {
    Hello: ("protocol_version", "agent_id", "instance", "incarnation", "protocol_minor"),
    Welcome: (
        "protocol_version", "agent_id", "heartbeat_interval_s", "heartbeat_timeout_s", "protocol_minor",
    ),
    Refuse: ("code", "reason"),
    Heartbeat: ("seq", "engine_state", "draining", "metrics"),
    Command: ("id", "kind", "args", "payload", "epoch"),
    Ack: ("id", "ok", "error", "code", "detail", "result"),
    Goodbye: ("reason",),
    KvEvents: ("seq", "events", "missed"),
    InstanceInfo: (
        "url", "role", "model", "engine", "revision", "block_size", "kv_connector", "max_model_len",
        "tokenizer", "tensor_parallel_size", "kv_pool_endpoint", "capabilities", "labels", "layout",
        "kv_pool_node",
    ),
    KvLayout: (
        "tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "dp_rank", "dtype", "kv_cache_dtype",
        "kv_layout", "attention_backend", "vllm_version", "model_path", "max_num_seqs",
    ),
    EngineCapabilities: ("known", "completions_token_ids", "chat_token_ids", "chat_prompt_ids"),
    MetricsSnapshot: (
        "scraped_at", "num_running", "num_waiting", "kv_cache_usage", "ttft_s", "tpot_s",
        "prefix_cache_hit_rate", "window_s", "requests_finished", "prompt_tokens", "generation_tokens",
        "queue_s", "prefill_tokens_per_s", "mean_prompt_tokens", "prompt_tokens_computed",
        "prompt_tokens_cached", "prompt_tokens_transferred", "age_s", "sent_at", "kv_in_bytes",
        "kv_in_seconds", "kv_in_transfers", "kv_in_links", "kv_pool_hit_rate",
    ),
    KvLinkCount: ("source", "nbytes", "seconds", "transfers"),
    KvEvent: ("kind", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"),
    commands.Drain: (),
    commands.Undrain: (),
    commands.Shutdown: (),
    commands.SetRole: ("role", "restart"),
    commands.KvGrant: ("token", "keys", "peer_key", "ttl_s"),
    commands.KvFetch: ("token", "keys", "endpoint", "peer_key", "timeout_s"),
    commands.GrantResult: ("requested", "held"),
    commands.FetchResult: ("requested", "already_held", "reserved"),
}  # fmt: skip
TAGS = {
    Hello: "hello", Welcome: "welcome", Refuse: "refuse", Heartbeat: "heartbeat", Command: "command",
    Ack: "ack", Goodbye: "goodbye", KvEvents: "kv_events",
}  # fmt: skip
KINDS = {
    commands.Drain: "drain", commands.Undrain: "undrain", commands.Shutdown: "shutdown",
    commands.SetRole: "set_role", commands.KvGrant: "kv_grant", commands.KvFetch: "kv_fetch",
    commands.GrantResult: "kv_grant", commands.FetchResult: "kv_fetch",
}  # fmt: skip
# Every field added after 1.0, with the minor that added it (the codec leaves it out at its default).
SINCE_MINOR = {
    (Hello, "protocol_minor"): 1,
    (Welcome, "protocol_minor"): 1,
    (Ack, "code"): 2,
    (Ack, "detail"): 3,
    (InstanceInfo, "kv_pool_endpoint"): 3,
    (KvEvent, "medium"): 3,
    (InstanceInfo, "capabilities"): 4,
    (Command, "payload"): 5,
    (Command, "epoch"): 6,
    (Ack, "result"): 5,
    (InstanceInfo, "labels"): 7,
    (InstanceInfo, "layout"): 7,
    (MetricsSnapshot, "kv_in_bytes"): 7,
    (MetricsSnapshot, "kv_in_seconds"): 7,
    (MetricsSnapshot, "kv_in_transfers"): 7,
    (MetricsSnapshot, "kv_in_links"): 7,
    (MetricsSnapshot, "kv_pool_hit_rate"): 8,
    (InstanceInfo, "kv_pool_node"): 9,
}


@pytest.mark.parametrize("cls", PROTOCOL_FIELDS, ids=lambda c: c.__name__)
def test_every_protocol_struct_has_its_golden_fields_in_order(cls: type[Any]) -> None:
    assert names(cls) == PROTOCOL_FIELDS[cls]


def test_every_message_and_payload_keeps_its_tag() -> None:
    assert {cls: cls.TAG for cls in MESSAGE_TYPES} == TAGS
    assert {cls: cls.KIND for cls in (*commands.PAYLOAD_TYPES, *commands.RESULT_TYPES)} == KINDS


def test_every_field_added_after_1_0_says_the_minor_that_added_it() -> None:
    marked = {
        (cls, f.name): f.metadata["since_minor"]
        for cls in PROTOCOL_FIELDS
        for f in dataclasses.fields(cls)
        if "since_minor" in f.metadata
    }
    assert marked == SINCE_MINOR


KEY = bytes(range(32))
PROTOCOL_EXAMPLES: list[Message] = [
    Hello(1, "p0", InstanceInfo("http://h:1", "prefill", "m", capabilities=EngineCapabilities(True)), "i", 5),
    Welcome(1, "p0", 0.25, 1.0, 5),
    Refuse("unknown_agent", "no session"),
    Heartbeat(3, "ready", True, MetricsSnapshot(num_running=2, ttft_s=0.5, prompt_tokens_cached=7)),
    Command.of(1, commands.Drain(), epoch=7),
    Command.of(2, commands.Undrain()),
    Command.of(3, commands.Shutdown()),
    Command.of(4, commands.SetRole("decode", restart=True)),
    Command.of(5, commands.KvGrant("tok", [KEY], "", 30.0)),
    Command.of(6, commands.KvFetch("tok", [KEY], "tcp://h:2", "", 2.0)),
    Command(7, "set_role", {"role": "prefill"}),
    Ack(5, True, result=commands.GrantResult(1, 1)),
    Ack(6, True, result=commands.FetchResult(1, 0, 1)),
    Ack(8, False, "no", code="restart_required", detail={"held": "1"}),
    Goodbye("bye"),
    KvEvents(4, [KvEvent("stored", [2**64 - 1], None, [1, 2], 2, medium="pool"), KvEvent("cleared")], 1),
]


@pytest.mark.parametrize("message", PROTOCOL_EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_protocol_message_round_trips(message: Message) -> None:
    assert decode(encode(message)) == message


# --- agent <-> agent: the KV frames -------------------------------------------------------------------

GEOMETRY = Geometry(num_layers=2, layer_block_bytes=64, block_size=4)
# A header is [op, field, ...] in this order; ``version`` (and a Refused's ``code``) only when not 1 ("").
FRAME_FIELDS: dict[type[Any], tuple[str, tuple[str, ...]]] = {
    frames.FetchRequest: ("fetch", ("token", "keys", "geometry", "window", "timeout_s", "version")),
    frames.Start: ("start", ("blocks", "geometry", "tokens", "version", "extras")),
    frames.Chunk: ("chunk", ("layer", "first")),
    frames.Credit: ("credit", ("chunks",)),
    frames.Done: ("done", ("landed",)),
    frames.Refused: ("refused", ("reason", "code")),
    frames.Ping: ("ping", ()),
}
FRAME_EXAMPLES: list[frames.Frame] = [
    frames.FetchRequest("tok", (KEY,), GEOMETRY, 8, 2.0),
    frames.Start(1, GEOMETRY, ((1, 2, 3, 4),)),
    frames.Chunk(1, 0),
    frames.Credit(2),
    frames.Done(1),
    frames.Refused("no", "unsupported_version"),
    frames.Ping(),
]


@pytest.mark.parametrize("frame", FRAME_EXAMPLES, ids=lambda f: type(f).__name__)
def test_every_kv_frame_has_its_golden_fields_and_round_trips(frame: frames.Frame) -> None:
    op, fields = FRAME_FIELDS[type(frame)]
    assert names(type(frame)) == fields
    header = msgpack.unpackb(frames.encode(frame), raw=False)
    assert header[0] == op
    written = [getattr(frame, name) for name in fields][: len(header) - 1]
    assert len(header) - 1 == len(written)  # nothing written that has no field
    assert frames.decode(frames.encode(frame), 1 << 16) == frame


def test_the_geometry_in_a_frame_is_a_map_of_three_counts() -> None:
    assert GEOMETRY.to_wire() == {"num_layers": 2, "layer_block_bytes": 64, "block_size": 4}


# --- connector <-> agent: the local link --------------------------------------------------------------

REQUEST_KEYS: dict[type[Any], tuple[str, ...]] = {
    Open: ("op", "v", "geometry", "engine", "pid"),
    Lookup: ("op", "v", "req", "keys"),
    Release: ("op", "v", "reqs"),
    Reserve: ("op", "v", "owner", "blocks"),
    Commit: ("op", "v", "owner", "keys"),
}
ANSWER_KEYS: dict[type[Any], tuple[str, ...]] = {
    Opened: ("ok", "path", "capacity"),
    Pinned: ("ok", "slots", "ready"),
    Released: ("ok",),
    Reserved: ("ok", "slots", "orphans"),
    Committed: ("ok", "committed"),
}
REQUESTS: list[LocalRequest] = [
    Open(GEOMETRY, "engine-0", 4242),
    Lookup("engine-0:r1", [KEY, KEY[::-1]]),
    Release(["engine-0:r1"]),
    Reserve("engine-0:3", [SaveBlock(KEY, None, [1, 2, 3, 4]), SaveBlock(KEY[::-1], KEY, [5, 6, 7, 8])]),
    Commit("engine-0:3", [KEY]),
]
ANSWERS: list[LocalAnswer] = [
    Opened("/dev/shm/vllm-disagg-pool-x", 64),
    Pinned([3, 4], [True, False]),
    Released(),
    Reserved([(KEY, 5)], [KEY]),
    Committed(1),
]


def through_msgpack(value: dict[str, Any]) -> Any:
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
def test_every_local_request_has_its_golden_keys_and_round_trips(request_: LocalRequest) -> None:
    sent = request_to_wire(request_)
    assert tuple(sent) == REQUEST_KEYS[type(request_)]
    assert (sent["op"], sent["v"]) == (request_.OP, local_messages.LOCAL_VERSION)
    assert read_request(through_msgpack(sent)) == request_


def test_a_saved_block_travels_as_key_parent_tokens() -> None:
    sent = through_msgpack(request_to_wire(REQUESTS[3]))
    assert sent["blocks"][1] == [KEY[::-1], KEY, [5, 6, 7, 8]]


# ``A``, not ``LocalAnswer``: ``read_answer`` takes one kind at a time, so mypy checks this for each kind.
@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: type(a).__name__)
def test_every_local_answer_has_its_golden_keys_and_round_trips(answer: A) -> None:
    sent = answer_to_wire(answer)
    assert tuple(sent) == ANSWER_KEYS[type(answer)]
    assert read_answer(through_msgpack(sent), type(answer)) == answer
