"""Protocol 1.5: each command's payload and each Ack's result is typed per kind, and a peer of 1.4 or
older still gets (and sends) the string maps it knows, meaning the same."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from vllm_disagg.errors import FieldTypeError
from vllm_disagg.protocol.codec import decode, encode, for_minor
from vllm_disagg.protocol.commands import (
    PAYLOAD_TYPES,
    RESULT_TYPES,
    TYPED_MINOR,
    AckResult,
    CommandPayload,
    Drain,
    FetchResult,
    GrantResult,
    KvFetch,
    KvGrant,
    SetRole,
    Shutdown,
    Undrain,
    from_args,
    from_detail,
    to_args,
    to_detail,
)
from vllm_disagg.protocol.messages import COMMAND_KINDS, PROTOCOL_MINOR, Ack, Command

KEYS = [bytes([0xC0 + i]) * 32 for i in range(3)]
PEER = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
GRANT = KvGrant("q3Vx9GmS0bH2n7Lw4cTa8yKd", KEYS, PEER, 30.0)
FETCH = KvFetch("q3Vx9GmS0bH2n7Lw4cTa8yKd", KEYS[:2], "tcp://10.0.0.5:11100", PEER, 2.0)

PAYLOADS: list[CommandPayload] = [
    Drain(),
    Undrain(),
    Shutdown(),
    SetRole("decode"),
    SetRole("prefill", restart=True),
    GRANT,
    FETCH,
]
RESULTS: list[AckResult] = [
    GrantResult(requested=3, held=2),
    FetchResult(requested=2, already_held=1, reserved=1),
]


def wire(message: Any) -> dict[str, Any]:
    return dict(msgpack.unpackb(encode(message))[1])


def test_this_release_reads_typed_payloads_and_every_kind_has_one() -> None:
    assert PROTOCOL_MINOR >= TYPED_MINOR == 5
    assert sorted(cls.KIND for cls in PAYLOAD_TYPES) == sorted(COMMAND_KINDS)
    assert {type(p) for p in PAYLOADS} == set(PAYLOAD_TYPES) and {type(r) for r in RESULTS} == set(
        RESULT_TYPES
    )


@pytest.mark.parametrize("payload", PAYLOADS, ids=repr)
def test_a_typed_command_round_trips_and_carries_its_kind_twice(payload: CommandPayload) -> None:
    command = Command.of(7, payload)
    assert decode(encode(command)) == command
    sent = wire(command)
    # ``kind`` beside the payload: a peer before 1.5 reads it; inside it: the payload's own tag.
    assert sent["kind"] == sent["payload"]["kind"] == payload.KIND
    assert command.read() == payload


@pytest.mark.parametrize("result", RESULTS, ids=repr)
def test_a_typed_result_round_trips_in_its_ack(result: AckResult) -> None:
    ack = Ack(7, True, result=result)
    assert decode(encode(ack)) == ack
    assert wire(ack)["result"]["kind"] == result.KIND


def test_a_grants_keys_travel_as_bytes_not_hex() -> None:
    assert wire(Command.of(1, GRANT))["payload"]["keys"] == KEYS
    assert wire(Command.of(1, GRANT).for_minor(4))["args"]["keys"] == ",".join(k.hex() for k in KEYS)


# --- to and from a peer of 1.4 or older ------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "args"),
    [
        pytest.param(Drain(), {}, id="drain"),
        pytest.param(Shutdown(), {}, id="shutdown"),
        pytest.param(SetRole("decode"), {"role": "decode"}, id="set_role"),
        pytest.param(
            SetRole("decode", restart=True), {"role": "decode", "restart": "yes"}, id="set_role restart"
        ),
        pytest.param(
            GRANT,
            {
                "token": GRANT.token,
                "keys": ",".join(k.hex() for k in KEYS),
                "peer_key": PEER,
                "ttl_s": "30.0",
            },
            id="kv_grant",
        ),
        pytest.param(
            FETCH,
            {
                "token": FETCH.token,
                "keys": ",".join(k.hex() for k in KEYS[:2]),
                "endpoint": "tcp://10.0.0.5:11100",
                "peer_key": PEER,
                "timeout_s": "2.0",
            },
            id="kv_fetch",
        ),
    ],
)
def test_a_payload_goes_to_an_older_peer_as_the_args_it_knows_and_reads_back_the_same(
    payload: CommandPayload, args: dict[str, str]
) -> None:
    assert to_args(payload) == args
    assert from_args(payload.KIND, args) == payload
    assert Command(1, payload.KIND, args).read() == payload


@pytest.mark.parametrize(
    ("minor", "typed"),
    [
        pytest.param(0, False, id="1.0 gets args"),
        pytest.param(1, False, id="1.1 gets args"),
        pytest.param(4, False, id="1.4 gets args"),
        pytest.param(5, True, id="1.5 gets the payload"),
        pytest.param(6, True, id="a later minor gets the payload"),
    ],
)
def test_the_orchestrator_sends_a_payload_from_1_5_and_args_before(minor: int, typed: bool) -> None:
    command = Command.of(3, SetRole("prefill", restart=True))
    sent = command.for_minor(minor)
    if typed:
        assert sent is command and "payload" in wire(sent)
    else:
        assert sent == Command(3, "set_role", {"role": "prefill", "restart": "yes"})
        assert "payload" not in wire(sent), "a peer of 1.0 refuses a field it does not know"


@pytest.mark.parametrize(
    ("minor", "expected"),
    [
        pytest.param(5, Ack(4, True, result=GrantResult(3, 2)), id="1.5 reads the typed result"),
        pytest.param(4, Ack(4, True, detail={"requested": "3", "held": "2"}), id="1.4 reads detail"),
        pytest.param(3, Ack(4, True, detail={"requested": "3", "held": "2"}), id="1.3 reads detail"),
        pytest.param(2, Ack(4, True), id="1.2 has no field for it"),
    ],
)
def test_an_ack_goes_to_each_orchestrator_as_its_minor_reads_it(minor: int, expected: Ack) -> None:
    ack = Ack(4, True, result=GrantResult(3, 2))
    assert ack.for_minor(minor) == expected
    assert for_minor(ack, minor) == expected, "the codec's downgrade converts, it does not drop"


def test_the_codecs_downgrade_of_a_command_keeps_its_payload_as_args() -> None:
    command = Command.of(2, GRANT)
    assert for_minor(command, 4) == command.for_minor(4) == Command(2, "kv_grant", to_args(GRANT))
    assert for_minor(command, 5) is command


def test_a_command_without_a_payload_is_the_frame_of_1_4() -> None:
    assert wire(Command(9, "set_role", {"role": "decode"})) == {
        "id": 9,
        "kind": "set_role",
        "args": {"role": "decode"},
    }
    assert wire(Ack(9, True)) == {"id": 9, "ok": True, "error": ""}


@pytest.mark.parametrize("result", RESULTS, ids=repr)
def test_a_result_goes_to_an_orchestrator_of_1_3_or_1_4_as_its_detail_and_reads_back(
    result: AckResult,
) -> None:
    assert from_detail(result.KIND, to_detail(result)) == result
    assert all(isinstance(v, str) for v in to_detail(result).values())


@pytest.mark.parametrize(
    ("kind", "detail"),
    [
        pytest.param("kv_grant", {}, id="no detail"),
        pytest.param("kv_grant", {"requested": "3"}, id="a count missing"),
        pytest.param("kv_fetch", {"requested": "3", "already_held": "x", "reserved": "1"}, id="not a number"),
        pytest.param("drain", {"held": "1"}, id="a kind without a result"),
    ],
)
def test_a_detail_that_says_no_whole_result_reads_as_none(kind: Any, detail: dict[str, str]) -> None:
    assert from_detail(kind, detail) is None


# --- what is refused ---------------------------------------------------------------------------------


def frame(fields: dict[str, Any]) -> bytes:
    return bytes(msgpack.packb(["command", fields], use_bin_type=True))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        pytest.param(
            {"id": 1, "kind": "drain", "payload": {"kind": "explode"}},
            "'payload.kind': expected one of",
            id="a payload kind no command has",
        ),
        pytest.param(
            {"id": 1, "kind": "drain", "payload": {}}, "'payload.kind'", id="a payload without its kind"
        ),
        pytest.param(
            {"id": 1, "kind": "drain", "payload": ["drain"]}, "'payload': expected map", id="not a map"
        ),
        pytest.param(
            {"id": 1, "kind": "kv_grant", "payload": {"kind": "kv_grant", "token": "t", "keys": ["ab"]}},
            "KvGrant: missing field(s)",
            id="a payload missing fields",
        ),
        pytest.param(
            {
                "id": 1,
                "kind": "kv_grant",
                "payload": {"kind": "kv_grant", "token": "t", "keys": ["ab"], "peer_key": "", "ttl_s": 1.0},
            },
            "'payload.keys[0]': expected bytes, got str",
            id="a key as text",
        ),
        pytest.param(
            {
                "id": 1,
                "kind": "set_role",
                "payload": {"kind": "set_role", "role": "decode", "restart": "yes"},
            },
            "'payload.restart': expected bool",
            id="restart as the text of 1.4",
        ),
    ],
)
def test_a_malformed_payload_is_refused_by_the_codec_with_the_field_that_is_wrong(
    fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(FieldTypeError) as caught:
        decode(frame(fields))
    assert reason in str(caught.value)


def test_a_payload_of_another_kind_than_its_command_is_answered_with_the_reason() -> None:
    """The codec reads both; the agent refuses the command (an Ack with the reason), not the frame."""
    command = decode(frame({"id": 1, "kind": "drain", "payload": {"kind": "shutdown"}}))
    assert isinstance(command, Command)
    with pytest.raises(ValueError, match="a payload of kind 'shutdown' in a 'drain' command"):
        command.read()


def test_a_later_minors_fields_in_a_payload_or_result_are_ignored() -> None:
    payload = {"kind": "set_role", "role": "decode", "priority": 3}
    assert decode(frame({"id": 1, "kind": "set_role", "payload": payload})) == Command.of(
        1, SetRole("decode")
    )
    result = {"kind": "kv_grant", "requested": 2, "held": 1, "pinned_s": 30.0}
    ack = decode(bytes(msgpack.packb(["ack", {"id": 1, "ok": True, "result": result}])))
    assert ack == Ack(1, True, result=GrantResult(2, 1))
