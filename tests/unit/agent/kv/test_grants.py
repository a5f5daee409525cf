"""The holder's grants: who may fetch which blocks, pinned until fetched, and the frames they come in."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import msgpack
import pytest

from vllm_disagg.agent.kv.arena import Capacity, Geometry
from vllm_disagg.agent.kv.frames import (
    Chunk,
    Credit,
    Done,
    FetchRequest,
    Frame,
    Ping,
    Refused,
    Start,
    decode,
    encode,
)
from vllm_disagg.agent.kv.grants import Grant, Grants, refusal, servable
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.pool import PrefixPool
from vllm_disagg.errors import MalformedFrame

GEOMETRY = Geometry(num_layers=2, layer_block_bytes=4096, block_size=16)
KEYS = tuple(bytes([i]) * 32 for i in range(6))
ALICE, MALLORY = b"A" * 40, b"M" * 40  # z85 public keys are 40 characters
NOW = 1000.0


def grant(**overrides: object) -> Grant:
    fields: dict[str, object] = {
        "token": "t",
        "named": frozenset(KEYS[:4]),
        "pinned": frozenset(KEYS[:3]),
        "peer_public_key": ALICE,
        "expires_at": NOW + 10,
        "pool": PrefixPool(8),
        "in_use": False,
    }
    fields.update(overrides)
    return Grant(**fields)  # type: ignore[arg-type]


# --- refusal: (grant, keys asked, client key, holder with keys?) -> reason or None -----------------
@pytest.mark.parametrize(
    ("the_grant", "keys", "client", "curve", "reason"),
    [
        (grant(), KEYS[:3], None, False, None),
        (grant(), KEYS[1:3], None, False, None),
        (grant(), KEYS[:4], None, False, None),
        (grant(), KEYS[:3], ALICE, True, None),
        (None, KEYS[:3], None, False, "unknown token"),
        (grant(in_use=True), KEYS[:3], None, False, "already in use"),
        (grant(expires_at=NOW), KEYS[:3], None, False, "grant expired"),
        (grant(), KEYS[:5], None, False, "1 of 5 keys requested were not granted"),
        (grant(), (KEYS[5],), None, False, "1 of 1 keys requested were not granted"),
        (grant(), (), None, False, "no keys requested"),
        (grant(), KEYS[:3], MALLORY, True, "public key is not the one granted"),
        (grant(peer_public_key=None), KEYS[:3], ALICE, True, "names no public key"),
        (grant(peer_public_key=None), KEYS[:3], None, False, None),
    ],
    ids=[
        "the-named-leading-keys-are-served",
        "any-subset-of-the-named-keys-is-served",
        "named-but-not-held-keys-may-be-asked-for",
        "with-keys-the-granted-client-is-served",
        "an-unknown-token-is-refused",
        "a-token-is-good-for-one-fetch-at-a-time",
        "an-expired-grant-is-refused",
        "a-key-beyond-the-grant-is-refused",
        "a-key-outside-the-grant-is-refused",
        "an-empty-fetch-is-refused",
        "with-keys-another-clients-key-is-refused",
        "with-keys-a-grant-without-a-key-serves-no-one",
        "without-keys-the-token-alone-authorizes",
    ],
)
def test_refusal(
    the_grant: Grant | None, keys: tuple[bytes, ...], client: bytes | None, curve: bool, reason: str | None
) -> None:
    got = refusal(the_grant, keys, client, NOW, curve)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


@pytest.mark.parametrize(
    ("keys", "served"),
    [(KEYS[:3], 3), (KEYS[:4], 3), (KEYS[1:3], 2), (KEYS[3:4], 0), ((KEYS[0], KEYS[3], KEYS[1]), 1)],
    ids=["all-pinned", "stops-at-the-first-unheld", "a-later-run", "none-held", "a-gap-ends-the-prefix"],
)
def test_servable_counts_the_leading_pinned_keys(keys: tuple[bytes, ...], served: int) -> None:
    assert servable(grant(), keys) == served


# --- the table: pins in a real pool ----------------------------------------------------------------
@pytest.fixture
def node() -> Iterator[PoolNode]:
    opened = PoolNode(f"vllm-disagg-test-{uuid.uuid4().hex}", Capacity(4, "blocks"))
    opened.open(GEOMETRY)
    yield opened
    opened.close()


def store(node: PoolNode, *keys: bytes) -> None:
    assert node.pool is not None
    node.pool.commit("save", node.pool.reserve("save", [(k, None, ()) for k in keys]))
    node.pool.release("save")


def test_a_grant_pins_the_leading_ready_blocks_so_they_are_not_evicted(node: PoolNode) -> None:
    store(node, *KEYS[:3])
    grants = Grants(node)
    granted = grants.add("t", KEYS[:4], None, NOW + 10)
    assert granted is not None and granted.pinned == frozenset(KEYS[:3])
    assert node.pool is not None
    assert node.pool.owners() == ["xfer:grant:t"]
    store(node, *KEYS[3:6])  # more than the one free slot: only unpinned blocks could go
    assert all(key in node.pool for key in KEYS[:3])


def test_a_block_still_being_written_is_not_granted(node: PoolNode) -> None:
    assert node.pool is not None
    node.pool.reserve("save", [(KEYS[0], None, ())])
    granted = Grants(node).add("t", KEYS[:1], None, NOW + 10)
    assert granted is not None and granted.pinned == frozenset()


def test_ending_a_grant_unpins_its_blocks(node: PoolNode) -> None:
    store(node, *KEYS[:2])
    grants = Grants(node)
    grants.add("t", KEYS[:2], None, NOW + 10)
    assert grants.end("t") and not grants.end("t")
    assert node.pool is not None and node.pool.stats().referenced == 0


def test_granting_a_token_again_replaces_its_pins(node: PoolNode) -> None:
    store(node, *KEYS[:2])
    grants = Grants(node)
    grants.add("t", KEYS[:2], None, NOW + 10)
    grants.add("t", KEYS[:1], None, NOW + 10)
    assert node.pool is not None and node.pool.references(KEYS[1]) == 0
    assert node.pool.references(KEYS[0]) == 1


def test_only_unused_grants_expire_and_only_once_their_ttl_passed(node: PoolNode) -> None:
    store(node, *KEYS[:2])
    grants = Grants(node)
    grants.add("early", KEYS[:1], None, NOW + 5)
    grants.add("late", KEYS[1:2], None, NOW + 50)
    grants.add("busy", KEYS[:1], None, NOW + 5)
    busy = grants.get("busy")
    assert busy is not None
    busy.in_use = True  # a stream reads its blocks: its pins must outlive the TTL
    assert grants.next_expiry() == NOW + 5
    assert grants.expire(NOW + 4.9) == []
    assert grants.expire(NOW + 5) == ["early"]
    assert grants.next_expiry() == NOW + 50
    assert sorted(g for g in ("early", "late", "busy") if grants.get(g)) == ["busy", "late"]


def test_the_handshake_admits_a_key_only_while_a_live_grant_names_it(node: PoolNode) -> None:
    grants = Grants(node)
    grants.add("t", KEYS[:1], ALICE, NOW + 5)
    assert grants.admits(ALICE, NOW) and not grants.admits(MALLORY, NOW)
    assert not grants.admits(ALICE, NOW + 5)


def test_without_a_pool_nothing_is_granted() -> None:
    assert Grants(PoolNode("never-opened", Capacity(4, "blocks"))).add("t", KEYS, None, NOW) is None


# --- frames ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "frame",
    [
        FetchRequest("tok", KEYS[:2], GEOMETRY, 16, 2.5),
        Start(3, GEOMETRY, ((), tuple(range(GEOMETRY.block_size)), (7,) * GEOMETRY.block_size)),
        Chunk(1, 8),
        Credit(4),
        Done(0),
        Refused("no"),
        Ping(),
    ],
    ids=lambda f: type(f).__name__,
)
def test_every_frame_round_trips(frame: Frame) -> None:
    assert decode(encode(frame), 1 << 20) == frame


def _packed(*fields: object) -> bytes:
    out: bytes = msgpack.packb(list(fields), use_bin_type=True)
    return out


GEO = GEOMETRY.to_wire()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xc1", "not msgpack"),
        (_packed(), "expected [op"),
        (msgpack.packb({"op": "fetch"}), "expected [op"),
        (_packed("steal"), "unknown op"),
        (_packed("fetch", "t", [KEYS[0]], GEO, 4), "expected 5 fields"),
        (_packed("fetch", "", [KEYS[0]], GEO, 4, 1.0), "token"),
        (_packed("fetch", "t", [], GEO, 4, 1.0), "keys"),
        (_packed("fetch", "t", ["text"], GEO, 4, 1.0), "keys"),
        (_packed("fetch", "t", [b"x" * 65], GEO, 4, 1.0), "keys"),
        (_packed("fetch", "t", [KEYS[0]], {"num_layers": 0}, 4, 1.0), "geometry"),
        (_packed("fetch", "t", [KEYS[0]], GEO, 0, 1.0), "window"),
        (_packed("fetch", "t", [KEYS[0]], GEO, True, 1.0), "window"),
        (_packed("fetch", "t", [KEYS[0]], GEO, 4, float("inf")), "timeout_s"),
        (_packed("chunk", -1, 0), "layer"),
        (_packed("refused", 5), "reason"),
        (b"x" * 1025, "over the limit"),
    ],
    ids=[
        "not-msgpack",
        "empty-list",
        "a-map",
        "unknown-op",
        "missing-field",
        "empty-token",
        "no-keys",
        "a-key-not-bytes",
        "a-key-too-long",
        "bad-geometry",
        "zero-window",
        "boolean-window",
        "infinite-timeout",
        "negative-layer",
        "reason-not-text",
        "oversized",
    ],
)
def test_garbage_is_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedFrame, match=reason.replace("[", r"\[")):
        decode(data, 1024)
