"""Protocol 1.3 (KV pools): the new command kinds and fields round-trip, stay out of frames while they
hold their defaults (a peer of 1.0 refuses fields it does not know), are read with their defaults from
an older peer's frame, and the connector's handle and the commands' args (as 1.3 and 1.4 write them)
are checked. The typed payloads of 1.5: tests/unit/protocol/test_commands.py."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from vllm_disagg.errors import FieldTypeError
from vllm_disagg.protocol.codec import decode, encode, for_minor
from vllm_disagg.protocol.commands import KvFetch, KvGrant, to_args
from vllm_disagg.protocol.kv_pool import (
    MAX_COMMAND_KEYS,
    PoolHandle,
    pool_handle,
    read_pool_handle,
    split_keys,
)
from vllm_disagg.protocol.messages import (
    COMMAND_SINCE_MINOR,
    PROTOCOL_MINOR,
    Ack,
    Command,
    Hello,
    InstanceInfo,
    KvEvent,
    KvEvents,
    Message,
)

KEY = bytes(range(32))
PEER = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
POOL_INSTANCE = InstanceInfo(
    url="http://127.0.0.1:8100",
    role="prefill",
    model="m",
    kv_connector="vllm-disagg",
    kv_pool_endpoint="tcp://10.0.0.5:11100",
)


def fields(message: Message) -> dict[str, Any]:
    return dict(msgpack.unpackb(encode(message))[1])


def test_this_release_speaks_1_9_and_the_pool_commands_need_1_3() -> None:
    assert PROTOCOL_MINOR == 9
    assert dict(COMMAND_SINCE_MINOR) == {"kv_grant": 3, "kv_fetch": 3}


@pytest.mark.parametrize(
    "message",
    [
        Command(1, "kv_grant", to_args(KvGrant("tok", [KEY], PEER, 30.0))),
        Command(2, "kv_fetch", to_args(KvFetch("tok", [KEY], "tcp://h:1", "", 2.0))),
        Ack(2, True, detail={"requested": "1", "already_held": "0", "reserved": "1"}),
        Hello(protocol_version=1, agent_id="p0", instance=POOL_INSTANCE, protocol_minor=3),
        KvEvents(seq=1, events=[KvEvent("stored", [7], None, [1, 2], 2, medium="pool"), KvEvent("cleared")]),
    ],
    ids=["kv_grant", "kv_fetch", "ack with detail", "hello with a pool endpoint", "pool events"],
)
def test_minor_3_messages_round_trip(message: Message) -> None:
    assert decode(encode(message)) == message


@pytest.mark.parametrize(
    ("message", "absent", "container"),
    [
        pytest.param(Ack(1, True), "detail", None, id="an ack without detail"),
        pytest.param(
            Hello(protocol_version=1, agent_id="p0", instance=InstanceInfo("http://e", "decode", "m")),
            "kv_pool_endpoint",
            "instance",
            id="an instance without a pool",
        ),
    ],
)
def test_minor_3_fields_holding_their_default_stay_out_of_the_frame(
    message: Message, absent: str, container: str | None
) -> None:
    sent = fields(message)
    assert absent not in (sent if container is None else sent[container])


def test_a_gpu_event_carries_no_medium_and_a_pool_event_does() -> None:
    events = KvEvents(seq=1, events=[KvEvent("removed", [1]), KvEvent("removed", [2], medium="pool")])
    gpu, pool = fields(events)["events"]
    assert "medium" not in gpu and pool["medium"] == "pool"


def test_an_older_peers_frames_read_with_the_defaults() -> None:
    ack = decode(msgpack.packb(["ack", {"id": 1, "ok": True, "error": ""}]))
    event = decode(msgpack.packb(["kv_events", {"seq": 1, "events": [{"kind": "cleared"}]}]))
    hello = decode(
        msgpack.packb(
            [
                "hello",
                {
                    "protocol_version": 1,
                    "agent_id": "a",
                    "instance": {"url": "u", "role": "both", "model": "m"},
                },
            ]
        )
    )
    assert isinstance(ack, Ack) and ack == Ack(1, True) and ack.detail == {}
    assert event == KvEvents(seq=1, events=[KvEvent("cleared", medium="gpu")])
    assert isinstance(hello, Hello) and hello.instance.kv_pool_endpoint == ""


def test_a_kind_an_agent_of_1_2_does_not_know_is_refused_by_its_codec_so_it_is_never_sent() -> None:
    """What an agent of 1.2 does with a kv_grant: a typed refusal, which is why the control plane
    never sends one to it (``AgentTooOld``)."""
    frame = msgpack.packb(["command", {"id": 1, "kind": "kv_grant_v2", "args": {}}])
    with pytest.raises(FieldTypeError, match="kind"):
        decode(frame)


def test_for_minor_leaves_out_every_field_a_later_minor_added_nested_ones_too() -> None:
    hello = Hello(protocol_version=1, agent_id="p0", instance=POOL_INSTANCE, protocol_minor=3)
    as_1_0 = for_minor(hello, 0)
    assert as_1_0.protocol_minor == 0 and as_1_0.instance.kv_pool_endpoint == ""
    assert "protocol_minor" not in fields(as_1_0) and "kv_pool_endpoint" not in fields(as_1_0)["instance"]
    as_1_2 = for_minor(hello, 2)
    assert as_1_2.protocol_minor == 3 and as_1_2.instance.kv_pool_endpoint == ""
    assert for_minor(hello, 3) is hello
    ack = Ack(1, False, "no", code="restart_required", detail={"held": "0"})
    assert for_minor(ack, 2) == Ack(1, False, "no", code="restart_required")
    assert for_minor(ack, 1) == Ack(1, False, "no")


# --- the connector's handle ---------------------------------------------------------------------


def test_the_connectors_handle_names_the_blocks_in_hex_and_reads_back() -> None:
    params = pool_handle(16, [KEY, KEY[::-1]])
    assert params == {"vllm_disagg": {"block_size": 16, "keys": [KEY.hex(), KEY[::-1].hex()]}}
    assert read_pool_handle(params) == PoolHandle(16, (KEY.hex(), KEY[::-1].hex()))


def test_a_nixl_handle_is_no_pool_handle() -> None:
    assert read_pool_handle({"do_remote_prefill": True, "remote_block_ids": [1]}) is None


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        pytest.param({"vllm_disagg": [1]}, "must be an object", id="not an object"),
        pytest.param({"vllm_disagg": {"keys": []}}, "block_size must be an integer >= 1", id="no block size"),
        pytest.param(
            {"vllm_disagg": {"block_size": True, "keys": []}},
            "block_size must be an integer",
            id="a bool size",
        ),
        pytest.param(
            {"vllm_disagg": {"block_size": 16, "keys": ["XY"]}},
            "keys must be a list of lowercase hex",
            id="bad key",
        ),
        pytest.param({"vllm_disagg": {"block_size": 16}}, "keys must be a list", id="no keys"),
    ],
)
def test_a_malformed_handle_is_refused_with_the_reason(params: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        read_pool_handle(params)


# --- the commands' args -------------------------------------------------------------------------


def test_grant_and_fetch_args_read_back_what_the_orchestrator_wrote() -> None:
    grant = KvGrant("tok", [KEY, KEY], PEER, 12.5)
    assert to_args(grant)["keys"] == f"{KEY.hex()},{KEY.hex()}"  # as 1.3 and 1.4 wrote them
    assert Command(1, "kv_grant", to_args(grant)).read() == grant
    fetch = KvFetch("tok", [KEY], "tcp://10.0.0.5:11100", "", 2.0)
    assert Command(2, "kv_fetch", to_args(fetch)).read() == fetch


def test_one_command_carries_at_most_max_command_keys_and_fits_a_frame() -> None:
    keys = ",".join([KEY.hex()] * MAX_COMMAND_KEYS)
    assert len(split_keys(keys)) == MAX_COMMAND_KEYS
    with pytest.raises(ValueError, match="more than"):
        split_keys(keys + "," + KEY.hex())
    fetch = KvFetch("t" * 24, [KEY] * MAX_COMMAND_KEYS, "tcp://h:1", PEER, 2.0)
    assert len(encode(Command(1, "kv_fetch", to_args(fetch)))) < 1 << 20  # to an agent of 1.3 or 1.4
    assert len(encode(Command.of(1, fetch))) < 1 << 19  # typed (1.5): the keys as bytes, half the size
