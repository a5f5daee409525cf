"""The etcd client against a real etcd server: keys, transactions, leases, watches, and failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.etcd_support import EtcdServer
from tests.helpers import free_port
from tests.integration.etcd.conftest import ClientFactory
from vllm_disagg.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    WatchCanceled,
    WatchEvent,
)

WAIT_S = 10.0  # generous: a loaded 2-core machine


async def next_events(stream: AsyncIterator[list[WatchEvent]], count: int) -> list[WatchEvent]:
    """The next ``count`` events of a watch, however they are batched."""
    events: list[WatchEvent] = []
    async with asyncio.timeout(WAIT_S):
        while len(events) < count:
            events += await anext(stream)
    return events


async def test_a_put_key_reads_back_with_its_revisions(etcd_client: EtcdClient) -> None:
    first = await etcd_client.put("a/x", b"one")
    second = await etcd_client.put("a/x", b"two")
    kv = await etcd_client.get("a/x")
    assert second == first + 1
    assert kv == KeyValue(
        key="a/x", value=b"two", create_revision=first, mod_revision=second, version=2, lease=0
    )
    assert await etcd_client.get("a/missing") is None


async def test_keys_and_values_are_bytes_safe(etcd_client: EtcdClient) -> None:
    value = bytes(range(256))
    await etcd_client.put("ключ/ü", value)
    kv = await etcd_client.get("ключ/ü")
    assert kv is not None and kv.value == value and kv.key == "ключ/ü"


async def test_a_prefix_reads_its_keys_sorted_and_the_revision_of_the_read(etcd_client: EtcdClient) -> None:
    for key in ("p/b", "p/a", "p/c/deep", "p0", "o/z"):
        last = await etcd_client.put(key, key.encode())
    kvs, revision = await etcd_client.get_prefix("p/")
    assert [kv.key for kv in kvs] == ["p/a", "p/b", "p/c/deep"]
    assert revision == last
    assert await etcd_client.get_prefix("none/") == ([], last)


async def test_delete_and_delete_prefix_say_how_many_went(etcd_client: EtcdClient) -> None:
    for key in ("d/1", "d/2", "d/3", "dx"):
        await etcd_client.put(key, b"v")
    assert await etcd_client.delete("d/1") == 1
    assert await etcd_client.delete("d/1") == 0
    assert await etcd_client.delete_prefix("d/") == 2
    assert await etcd_client.get("dx") is not None


async def test_create_only_creates_an_absent_key(etcd_client: EtcdClient) -> None:
    created = await etcd_client.create("c/k", b"first")
    assert created is not None
    assert (created.key, created.value, created.version) == ("c/k", b"first", 1)
    assert created.create_revision == created.mod_revision > 0
    assert await etcd_client.create("c/k", b"second") is None
    kv = await etcd_client.get("c/k")
    assert kv is not None and kv.value == b"first"


async def test_put_if_swaps_only_at_the_expected_revision(etcd_client: EtcdClient) -> None:
    assert await etcd_client.put_if("cas", b"v1", mod_revision=0)  # 0: only if absent
    assert not await etcd_client.put_if("cas", b"again", mod_revision=0)
    kv = await etcd_client.get("cas")
    assert kv is not None
    assert not await etcd_client.put_if("cas", b"stale", mod_revision=kv.mod_revision - 1)
    assert await etcd_client.put_if("cas", b"v2", mod_revision=kv.mod_revision)
    now = await etcd_client.get("cas")
    assert now is not None and now.value == b"v2" and now.version == 2


async def test_a_revoked_lease_takes_its_keys_with_it(etcd_client: EtcdClient) -> None:
    lease = await etcd_client.grant(30)
    await etcd_client.put("l/a", b"a", lease=lease)
    created = await etcd_client.create("l/b", b"b", lease=lease)
    assert created is not None and created.lease == lease
    kv = await etcd_client.get("l/a")
    assert kv is not None and kv.lease == lease
    await etcd_client.revoke(lease)
    kvs, revision = await etcd_client.get_prefix("l/")
    assert kvs == [] and revision > created.mod_revision  # the revoke deleted both: a new revision
    await etcd_client.revoke(lease)  # a lease already gone is no error


async def test_keepalive_answers_the_ttl_and_zero_once_the_lease_is_gone(etcd_client: EtcdClient) -> None:
    lease = await etcd_client.grant(7)
    assert await etcd_client.keepalive(lease) == 7
    await etcd_client.revoke(lease)
    assert await etcd_client.keepalive(lease) == 0


async def test_etcd_raises_a_ttl_below_its_minimum(etcd_client: EtcdClient) -> None:
    lease = await etcd_client.grant(1)
    assert await etcd_client.keepalive(lease) == 2  # docs/etcd.md: the minimum TTL


async def test_a_watch_sees_puts_and_deletes_in_order(
    etcd_client: EtcdClient, make_client: ClientFactory
) -> None:
    writer = make_client()
    _, revision = await etcd_client.get_prefix("w/")
    stream = etcd_client.watch(
        "w/", prefix=True, start_revision=revision + 1
    )  # misses nothing after the read
    async with contextlib.aclosing(stream):
        watched = asyncio.ensure_future(next_events(stream, 3))
        put = await writer.put("w/a", b"1")
        await writer.put("other", b"not watched")
        await writer.put("w/b", b"2")
        deleted = await writer.delete("w/a")
        events = await watched
    assert deleted == 1
    assert [(e.kind, e.kv.key, e.kv.value) for e in events] == [
        ("put", "w/a", b"1"),
        ("put", "w/b", b"2"),
        ("delete", "w/a", b""),
    ]
    assert events[0].kv.mod_revision == put and events[2].kv.mod_revision == put + 3


async def test_a_watch_from_a_start_revision_replays_history(etcd_client: EtcdClient) -> None:
    start = await etcd_client.put("h/k", b"1")
    await etcd_client.put("h/k", b"2")
    await etcd_client.delete("h/k")
    stream = etcd_client.watch("h/k", start_revision=start)
    async with contextlib.aclosing(stream):
        events = await next_events(stream, 3)
    assert [(e.kind, e.kv.value, e.kv.mod_revision) for e in events] == [
        ("put", b"1", start),
        ("put", b"2", start + 1),
        ("delete", b"", start + 2),
    ]


async def test_a_watch_from_a_compacted_revision_is_canceled(
    etcd: EtcdServer, etcd_client: EtcdClient
) -> None:
    first = await etcd_client.put("k", b"1")
    last = await etcd_client.put("k", b"2")
    compaction = {"revision": str(last)}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{etcd.url}/v3/kv/compaction", json=compaction) as resp,
    ):
        assert resp.status == 200, await resp.text()
    stream = etcd_client.watch("k", start_revision=first)
    with pytest.raises(WatchCanceled, match="compacted") as raised:
        async with contextlib.aclosing(stream):
            await anext(stream)
    assert raised.value.compact_revision == last


async def test_a_watch_breaks_with_etcd_unavailable_when_etcd_dies(
    etcd: EtcdServer, etcd_client: EtcdClient
) -> None:
    _, revision = await etcd_client.get_prefix("x")
    stream = etcd_client.watch("x", prefix=True, start_revision=revision + 1)
    async with contextlib.aclosing(stream):
        first = asyncio.ensure_future(next_events(stream, 1))
        await etcd_client.put("x", b"1")
        await first  # the stream is open
        etcd.kill()
        with pytest.raises(EtcdUnavailable, match=str(etcd.client_port)):
            await next_events(stream, 1)


async def test_the_next_endpoint_answers_when_the_first_is_dead(
    etcd: EtcdServer, make_client: ClientFactory
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = make_client([dead, etcd.url])
    await client.put("fo", b"ok")
    kv = await client.get("fo")
    assert kv is not None and kv.value == b"ok"
    stream = client.watch("fo", start_revision=kv.mod_revision)
    async with contextlib.aclosing(stream):
        assert [e.kv.value for e in await next_events(stream, 1)] == [b"ok"]


async def test_etcd_down_is_etcd_unavailable_naming_the_endpoint(
    etcd: EtcdServer, make_client: ClientFactory
) -> None:
    client = make_client()
    etcd.kill()
    with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{etcd.client_port}"):
        await client.get("k")
    with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{etcd.client_port}"):
        await anext(client.watch("k"))


async def test_a_frozen_etcd_is_etcd_unavailable_after_the_timeout(
    etcd: EtcdServer, make_client: ClientFactory
) -> None:
    client = make_client(timeout_s=0.5)
    await client.put("k", b"v")
    etcd.pause()
    try:
        with pytest.raises(EtcdUnavailable, match=r"127\.0\.0\.1:\d+: /v3/kv/range: no answer in 0.5 s"):
            await client.get("k")
        with pytest.raises(EtcdUnavailable):
            await client.keepalive(1)
    finally:
        etcd.resume()
    # A resumed etcd answers again once it has caught up; how soon depends on the machine, so the
    # check waits for its health rather than for the short timeout above.
    await etcd.wait_ready_async()
    kv = await make_client().get("k")
    assert kv is not None and kv.value == b"v"


async def test_an_error_answer_is_etcd_error_with_its_message(etcd_client: EtcdClient) -> None:
    with pytest.raises(EtcdError, match="too large lease TTL") as raised:
        await etcd_client.grant(10**12)
    assert not isinstance(raised.value, EtcdUnavailable)
    assert raised.value.code == 11  # gRPC OUT_OF_RANGE


@pytest.fixture
async def not_etcd() -> AsyncIterator[str]:
    """An HTTP server that is not etcd: truncated JSON on range, a key that is not base64 on delete, a
    list where a list of objects belongs on txn, and 404 in plain text elsewhere."""
    answers = {
        "/v3/kv/range": b'{"kvs": [',
        "/v3/kv/deleterange": b'{"deleted": "many"}',
        "/v3/kv/txn": b'{"succeeded": true, "responses": [1, 2]}',
        "/v3/lease/grant": b'{"ID": "0", "TTL": "5"}',
    }

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=answers[request.path], content_type="application/json")

    app = web.Application()
    for path in answers:
        app.router.add_post(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_server_that_is_not_etcd_gives_etcd_errors(not_etcd: str, make_client: ClientFactory) -> None:
    client = make_client([not_etcd])
    with pytest.raises(EtcdError, match="/v3/kv/range with HTTP 200") as raised:
        await client.get("k")
    assert not isinstance(raised.value, EtcdUnavailable)
    with pytest.raises(EtcdError, match="/v3/kv/put with HTTP 404"):
        await client.put("k", b"v")
    with pytest.raises(EtcdError, match="non-integer deleted"):
        await client.delete("k")
    with pytest.raises(EtcdError, match="malformed responses"):
        await client.create("k", b"v")
    with pytest.raises(EtcdError, match="granted no lease"):
        await client.grant(5)
