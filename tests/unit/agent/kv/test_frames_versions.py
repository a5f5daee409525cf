"""The agents' KV frames carry a version: version 1 is the layout of the agents before versions (so a
rolling upgrade mixes them freely), and a later version is refused with a typed error that names
both versions, never misread."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from vllm_disagg.agent.kv.arena import Geometry
from vllm_disagg.agent.kv.frames import FRAMES_VERSION, FetchRequest, Frame, Refused, Start, decode, encode
from vllm_disagg.errors import CodecError, MalformedFrame, UnsupportedVersion

GEOMETRY = Geometry(num_layers=2, layer_block_bytes=64, block_size=4)
GEO = GEOMETRY.to_wire()
KEY = bytes(range(32))


def packed(*fields: object) -> bytes:
    return bytes(msgpack.packb(list(fields), use_bin_type=True))


def test_this_release_speaks_version_1() -> None:
    assert FRAMES_VERSION == 1


@pytest.mark.parametrize(
    ("frame", "before_versions"),
    [
        pytest.param(
            FetchRequest("tok", (KEY,), GEOMETRY, 8, 2.0),
            packed("fetch", "tok", [KEY], GEO, 8, 2.0),
            id="fetch",
        ),
        pytest.param(
            Start(1, GEOMETRY, ((1, 2, 3, 4),)), packed("start", 1, GEO, [[1, 2, 3, 4]]), id="start"
        ),
        pytest.param(Refused("unknown token"), packed("refused", "unknown token"), id="refused"),
    ],
)
def test_version_1_is_written_byte_for_byte_as_the_agents_before_versions_wrote_it(
    frame: Frame, before_versions: bytes
) -> None:
    assert encode(frame) == before_versions
    assert decode(before_versions, 1 << 16) == frame


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(
            packed("fetch", "t", [KEY], GEO, 8, 2.0, 1),
            FetchRequest("t", (KEY,), GEOMETRY, 8, 2.0),
            id="fetch v1 said",
        ),
        pytest.param(packed("start", 0, GEO, [], 1), Start(0, GEOMETRY, ()), id="start v1 said"),
        pytest.param(
            packed("refused", "later", "unsupported_version"),
            Refused("later", "unsupported_version"),
            id="a coded refusal",
        ),
    ],
)
def test_a_version_said_explicitly_or_a_refusals_code_is_read(data: bytes, expected: Frame) -> None:
    assert decode(data, 1 << 16) == expected


V1 = ("t", [KEY], GEO, 8, 2.0)  # a fetch's fields of version 1


@pytest.mark.parametrize(
    ("data", "error", "reason"),
    [
        pytest.param(
            encode(FetchRequest("t", (KEY,), GEOMETRY, 8, 2.0, version=2)),
            UnsupportedVersion,
            "fetch of KV frames v2: this agent reads v1 to v1",
            id="a fetch of v2",
        ),
        pytest.param(
            packed("fetch", *V1, 3, "a field v3 added"),
            UnsupportedVersion,
            "KV frames v3",
            id="a fetch of v3 with a field of its own",
        ),
        pytest.param(
            encode(Start(0, GEOMETRY, (), version=2)),
            UnsupportedVersion,
            "start of KV frames v2",
            id="a start of v2",
        ),
        pytest.param(packed("fetch", *V1, 0), MalformedFrame, "version", id="version 0"),
        pytest.param(packed("fetch", *V1, "2"), MalformedFrame, "version", id="version as text"),
        pytest.param(packed("fetch", *V1, True), MalformedFrame, "version", id="version as a bool"),
        pytest.param(
            packed("fetch", *V1, 1, "x"), MalformedFrame, "expected 6 fields", id="v1 with an extra field"
        ),
        pytest.param(
            packed("chunk", 0, 0, 1), MalformedFrame, "expected 2 fields", id="a chunk has no version"
        ),
        pytest.param(packed("refused", "no", 7), MalformedFrame, "reason", id="a code that is not text"),
    ],
)
def test_a_frame_this_agent_cannot_read_is_refused_with_a_typed_reason(
    data: bytes, error: type[CodecError], reason: str
) -> None:
    with pytest.raises(error) as caught:
        decode(data, 1 << 16)
    assert reason in str(caught.value)


def test_a_later_version_is_its_own_error_with_a_code_the_holder_sends_back() -> None:
    assert UnsupportedVersion.code == "unsupported_version"
    assert issubclass(UnsupportedVersion, CodecError) and not issubclass(UnsupportedVersion, MalformedFrame)


def fields(frame: Frame) -> list[Any]:
    return list(msgpack.unpackb(encode(frame), raw=False))


def test_a_later_version_is_written_after_the_fields_of_version_1() -> None:
    assert fields(FetchRequest("t", (KEY,), GEOMETRY, 8, 2.0, version=2))[6] == 2
    assert fields(Start(0, GEOMETRY, (), version=2))[4] == 2


def test_a_start_with_extra_keys_says_its_version_then_each_block_s_extra_keys() -> None:
    extra = (("lora", "ada", "/a"),)
    frame = Start(2, GEOMETRY, ((1, 2, 3, 4), (5, 6, 7, 8)), 1, (extra, None))
    assert encode(frame) == packed(
        "start", 2, GEO, [[1, 2, 3, 4], [5, 6, 7, 8]], 1, [[["lora", "ada", "/a"]], None]
    )
    assert decode(encode(frame), 1 << 16) == frame


@pytest.mark.parametrize(
    "extras",
    [
        pytest.param([None], id="fewer than the blocks"),
        pytest.param([[["lora", True]], None], id="a boolean item"),
        pytest.param([[], None], id="an empty list of keys"),
        pytest.param("lora", id="not a list"),
    ],
)
def test_malformed_extra_keys_are_refused(extras: object) -> None:
    with pytest.raises(MalformedFrame):
        decode(packed("start", 2, GEO, [[1, 2, 3, 4], [5, 6, 7, 8]], 1, extras), 1 << 16)
