"""The agent's side of the local link to its engine's connector, and what it reports of the pool.

``PoolService.handle`` is the whole protocol as a function of one request; one test runs it behind
its real ROUTER socket with the connector's real REQ client.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import pytest
import zmq
import zmq.asyncio

from vllm_disagg.agent.kv.arena import Capacity, Geometry
from vllm_disagg.agent.kv.local import LocalClient, LocalError, local_endpoint, make_local_dir
from vllm_disagg.agent.kv.local_messages import Open, Opened, Release, Released
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.report import changed_events, pool_snapshot
from vllm_disagg.agent.kv.service import PoolService
from vllm_disagg.protocol.messages import MEDIUM_DISK, MEDIUM_POOL
from vllm_disagg.wire.block_hash import event_hash, prompt_block_hashes

GEOMETRY = Geometry(num_layers=2, layer_block_bytes=64, block_size=4)
TOKENS = list(range(100, 116))  # four blocks of four
KEYS = prompt_block_hashes(TOKENS, 4)


def _blocks(n: int) -> list[list[Any]]:
    return [[KEYS[i], KEYS[i - 1] if i else None, TOKENS[4 * i : 4 * i + 4]] for i in range(n)]


@dataclass(frozen=True)
class Teleport:
    """An op no agent knows."""

    OP: ClassVar[str] = "teleport"


@pytest.fixture
def node() -> Iterator[PoolNode]:
    node = PoolNode(f"test-kv-service-{uuid.uuid4().hex[:8]}", Capacity.parse("3"))
    yield node
    node.close()


@pytest.fixture
def service(node: PoolNode) -> PoolService:
    service = PoolService(node)
    assert service.handle({"op": "open", "geometry": GEOMETRY.to_wire(), "engine": "e", "pid": 1})["ok"]
    return service


def _save(service: PoolService, owner: str, n: int) -> None:
    slots = service.handle({"op": "reserve", "owner": owner, "blocks": _blocks(n)})["slots"]
    keys = [k for k, _ in slots]
    assert service.handle({"op": "commit", "owner": owner, "keys": keys}) == {
        "ok": True,
        "committed": len(keys),
    }


def test_open_names_the_arena_the_worker_maps(node: PoolNode) -> None:
    answer = PoolService(node).handle({"op": "open", "geometry": GEOMETRY.to_wire(), "engine": "e", "pid": 1})
    assert answer["ok"] and answer["capacity"] == 3
    assert Path(answer["path"]).exists()
    assert node.arena is not None and str(node.arena.path) == answer["path"]


def test_a_block_s_extra_keys_are_kept_with_it_and_a_malformed_one_is_refused(service: PoolService) -> None:
    block = [*_blocks(1)[0], [["lora", "ada", "/a"]]]
    assert service.handle({"op": "reserve", "owner": "e:1", "blocks": [block]})["slots"]
    pool = service.node.pool
    assert pool is not None and pool.extra_of(KEYS[0]) == (("lora", "ada", "/a"),)
    bad = [*_blocks(2)[1], [[None]]]
    answer = service.handle({"op": "reserve", "owner": "e:1", "blocks": [bad]})
    assert answer["ok"] is False and "extra keys" in answer["error"]


def test_a_block_whose_chain_left_the_pool_is_answered_as_an_orphan(service: PoolService) -> None:
    answer = service.handle({"op": "reserve", "owner": "e:1", "blocks": _blocks(3)[2:]})
    assert answer == {"ok": True, "slots": [], "orphans": [KEYS[2]]}  # the engine sends the chain again
    assert service.offered == 1


def test_a_saved_prompt_is_found_and_pinned_for_the_request_that_asks(service: PoolService) -> None:
    _save(service, "e:1", 2)
    answer = service.handle({"op": "lookup", "req": "e:r1", "keys": KEYS})
    assert answer["ok"] and len(answer["slots"]) == 2 and answer["ready"] == [True, True]
    pool = service.node.pool
    assert pool is not None and pool.references(KEYS[0]) == 1
    # Asking again for the same request replaces its pins: a request the engine re-asks holds no more.
    service.handle({"op": "lookup", "req": "e:r1", "keys": KEYS})
    assert pool.references(KEYS[0]) == 1
    service.handle({"op": "release", "reqs": ["e:r1"]})
    assert pool.references(KEYS[0]) == 0


def test_a_waiting_request_keeps_its_prefix_while_other_prompts_fill_the_pool(service: PoolService) -> None:
    _save(service, "e:1", 2)
    service.handle({"op": "lookup", "req": "e:waiting", "keys": KEYS[:2]})
    other = prompt_block_hashes(list(range(500, 512)), 4)
    blocks = [[k, other[i - 1] if i else None, [0, 0, 0, 0]] for i, k in enumerate(other)]
    got = service.handle({"op": "reserve", "owner": "e:2", "blocks": blocks})["slots"]
    assert len(got) == 1  # one free slot: the pinned prefix was not evicted for the others
    assert service.handle({"op": "lookup", "req": "e:waiting", "keys": KEYS[:2]})["ready"] == [True, True]


def test_a_restarted_engine_leaves_no_pin_or_half_written_block_behind(service: PoolService) -> None:
    _save(service, "e:1", 1)
    service.handle({"op": "lookup", "req": "e:r1", "keys": KEYS[:1]})
    service.handle({"op": "reserve", "owner": "e:2", "blocks": _blocks(2)})  # block 1, never committed
    pool = service.node.pool
    assert pool is not None and pool.stats().pending == 1
    # Same engine name, new process: whatever the old process held goes.
    assert service.handle({"op": "open", "geometry": GEOMETRY.to_wire(), "engine": "e", "pid": 2})["ok"]
    assert pool.references(KEYS[0]) == 0
    assert pool.stats().pending == 0 and pool.lookup(KEYS) == 1


def test_another_engine_opening_the_same_pool_keeps_the_first_ones_pins(service: PoolService) -> None:
    _save(service, "e:1", 1)
    service.handle({"op": "lookup", "req": "e:r1", "keys": KEYS[:1]})
    assert service.handle({"op": "open", "geometry": GEOMETRY.to_wire(), "engine": "f", "pid": 9})["ok"]
    pool = service.node.pool
    assert pool is not None and pool.references(KEYS[0]) == 1


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        pytest.param([1, 2], "a request is a map with an op", id="not a map"),
        pytest.param({"op": "teleport"}, "unknown op 'teleport'", id="unknown op"),
        pytest.param(
            {"op": "lookup", "req": "r", "keys": ["ab"]}, "keys must be a list of byte", id="text keys"
        ),
        pytest.param({"op": "lookup", "keys": []}, "req must be a non-empty string", id="no req"),
        pytest.param({"op": "release", "reqs": "r1"}, "reqs must be a list", id="reqs not a list"),
        pytest.param(
            {"op": "reserve", "owner": "o", "blocks": [[b"k"]]}, "a block is [key,", id="short block"
        ),
        pytest.param(
            {"op": "open", "geometry": {"num_layers": 0}, "engine": "e", "pid": 1},
            "bad geometry",
            id="geometry",
        ),
    ],
)
def test_a_malformed_request_is_refused_with_a_reason(
    service: PoolService, request_: object, error: str
) -> None:
    answer = service.handle(request_)
    assert answer["ok"] is False and error in answer["error"]
    assert service.handle({"op": "lookup", "req": "e:r", "keys": KEYS})["ok"]  # and it goes on


@pytest.mark.parametrize(
    ("version", "answer"),
    [
        pytest.param(..., {"ok": True}, id="a connector before versions is read as v1"),
        pytest.param(1, {"ok": True}, id="v1"),
        pytest.param(
            2,
            {
                "ok": False,
                "error": "local link v2: this agent reads v1 to v1 (the engine's vllm-disagg is newer "
                "than its agent's: upgrade the agent)",
                "code": "unsupported_version",
            },
            id="v2 is refused naming both versions",
        ),
        pytest.param("1", {"ok": False, "error": "v must be an integer >= 1"}, id="a version as text"),
        pytest.param(0, {"ok": False, "error": "v must be an integer >= 1"}, id="version 0"),
    ],
)
def test_a_request_of_a_version_the_agent_cannot_read_is_refused_with_a_code(
    service: PoolService, version: object, answer: dict[str, object]
) -> None:
    request = {"op": "release", "reqs": ["e:r1"], **({} if version is ... else {"v": version})}
    assert service.handle(request) == answer


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A directory short enough for a socket path (107 bytes at most): pytest's temporary directories
    outgrow it once their numbers and a worker's name are in the path."""
    path = tempfile.mkdtemp(prefix="kv-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_the_client_raises_the_agents_refusal_with_its_code(sock_dir: str) -> None:
    """What a connector of a later release hears from an agent of this one."""
    ctx = zmq.asyncio.Context()
    endpoint = local_endpoint("t", sock_dir)
    make_local_dir(endpoint)
    agent = ctx.socket(zmq.ROUTER)
    agent.bind(endpoint)
    refusal = {
        "ok": False,
        "error": "local link v9: this agent reads v1 to v1",
        "code": "unsupported_version",
    }

    async def answer_once() -> None:
        peer, empty, _ = await agent.recv_multipart()
        await agent.send_multipart([peer, empty, msgpack.packb(refusal)])

    client = LocalClient(endpoint, timeout_s=5)
    try:
        answering = asyncio.create_task(answer_once())
        with pytest.raises(LocalError, match="local link v9") as caught:
            await asyncio.to_thread(client.call, Release(["e:r1"]), Released)
        assert caught.value.code == "unsupported_version"
        await answering
    finally:
        client.close()
        agent.close(linger=0)
        ctx.term()


def test_before_the_engine_says_its_geometry_there_is_no_pool_to_ask(node: PoolNode) -> None:
    answer = PoolService(node).handle({"op": "lookup", "req": "r", "keys": KEYS})
    assert answer == {
        "ok": False,
        "error": "the pool is not open (no engine said its geometry)",
        "code": "not_open",
    }


async def test_the_connectors_client_talks_to_the_service_over_its_socket(
    node: PoolNode, sock_dir: str
) -> None:
    service = PoolService(node)
    endpoint = local_endpoint("t", sock_dir)
    await service.start(endpoint)
    client = LocalClient(endpoint, timeout_s=5)
    try:
        # The client blocks (it runs in vLLM's synchronous processes): run it off the loop.
        call = asyncio.to_thread
        answer = await call(client.call, Open(GEOMETRY, "e", os.getpid()), Opened)
        assert answer.capacity == 3
        with pytest.raises(LocalError, match="unknown op"):
            await call(client.call, Teleport(), Released)  # type: ignore[arg-type]
        # The directory of the socket admits only this user: the bytes behind it are prompts' KV.
        directory = Path(endpoint.removeprefix("ipc://")).parent
        assert directory.stat().st_mode & 0o777 == 0o700
    finally:
        client.close()
        await service.close()


def test_pool_changes_are_reported_as_pool_events_with_vllms_folded_hashes(service: PoolService) -> None:
    node = service.node
    heard: list[tuple[list[bytes], list[bytes]]] = []
    node.listeners.append(lambda stored, removed: heard.append((stored, removed)))
    _save(service, "e:1", 2)
    (stored, removed) = heard[-1]
    events = changed_events(node, stored, removed)
    assert [e.kind for e in events] == ["stored", "stored"]
    assert all(e.medium == MEDIUM_POOL and e.block_size == 4 for e in events)
    assert events[0].block_hashes == [event_hash(KEYS[0])] and events[0].parent_block_hash is None
    assert events[1].parent_block_hash == event_hash(KEYS[0]) and events[1].token_ids == TOKENS[4:8]


def test_a_snapshot_starts_the_pool_over_with_every_parent_before_its_child(service: PoolService) -> None:
    # A chain's later blocks stored before its first one (its first block's save never committed,
    # then saved again): the pool holds them in that order, but the index can only chain a block to
    # a known parent.
    blocks = _blocks(3)
    for owner, part, commit in (("e:1", blocks, KEYS[1:3]), ("e:2", blocks[:1], KEYS[:1])):
        service.handle({"op": "reserve", "owner": owner, "blocks": part})
        service.handle({"op": "commit", "owner": owner, "keys": list(commit)})
    pool = service.node.pool
    assert pool is not None and pool.held_keys() == [KEYS[1], KEYS[2], KEYS[0]]
    snapshot = pool_snapshot(service.node)
    # Both media start over (the disk tier's too, although this node has none: an earlier one may have).
    assert [(e.kind, e.medium) for e in snapshot[:2]] == [("cleared", MEDIUM_POOL), ("cleared", MEDIUM_DISK)]
    assert [e.block_hashes[0] for e in snapshot[2:]] == [event_hash(k) for k in KEYS[:3]]


def test_a_long_agent_id_still_makes_a_socket_path_the_kernel_takes() -> None:
    long_id = "a" * 128
    path = local_endpoint(long_id).removeprefix("ipc://")
    assert len(path.encode()) <= 100
    assert local_endpoint(long_id) != local_endpoint("b" * 128)
    assert local_endpoint("prefill-0").endswith("/kv-prefill-0.sock")


def test_engines_of_one_host_share_the_pool_and_see_each_other_s_blocks(node: PoolNode) -> None:
    service = PoolService(node)
    for engine in ("prefill-0", "decode-0"):
        opened = service.handle(
            {"op": "open", "geometry": GEOMETRY.to_wire(), "engine": engine, "pid": os.getpid()}
        )
        assert opened["ok"] and opened["path"] == str(node.arena.path if node.arena else "")
    _save(service, "prefill-0:1", 2)
    assert service.handle({"op": "lookup", "req": "decode-0:r1", "keys": KEYS[:2]})["slots"] != []


def test_an_engine_that_has_not_mapped_the_open_arena_is_refused(service: PoolService) -> None:
    answer = service.handle({"op": "lookup", "req": "other:r1", "keys": KEYS})
    assert (answer["ok"], answer["code"]) == (False, "not_open")  # it would read slots it has not mapped
    assert service.handle({"op": "release", "reqs": ["other:r1"]})["ok"]  # letting go is always fine


def test_an_engine_of_another_geometry_is_refused_while_the_first_runs(node: PoolNode) -> None:
    service = PoolService(node)
    first = {"op": "open", "geometry": GEOMETRY.to_wire(), "engine": "a", "pid": os.getpid()}
    assert service.handle(first)["ok"]
    other = Geometry(GEOMETRY.num_layers + 1, GEOMETRY.layer_block_bytes, GEOMETRY.block_size)
    answer = service.handle({"op": "open", "geometry": other.to_wire(), "engine": "b", "pid": os.getpid()})
    assert (answer["ok"], answer["code"]) == (False, "geometry") and "engine a's" in answer["error"]
    assert node.geometry == GEOMETRY  # the first engine's blocks stay
