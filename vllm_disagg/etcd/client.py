"""An asyncio etcd v3 client: keys, transactions, leases and watches, over etcd's gRPC JSON gateway.

Why the gateway, and no new dependency: etcd serves its v3 API as HTTP/1.1 + JSON on its client port
(``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/grant``, ``/v3/watch``, ...), generated from the same
``rpc.proto`` as its gRPC API and stable from etcd 3.4 to 3.5. aiohttp, a dependency already, is then
the whole client. The maintained asyncio gRPC clients (aetcd, etcetra) would bring grpcio, a large
native dependency, and follow etcd's releases late. docs/etcd.md says more, and what the gateway's
JSON looks like is in ``gateway.py``.

Each call is one POST with a deadline (``timeout_s``) on one ``aiohttp.ClientSession``. The endpoints
are tried in turn, starting with the one that answered last, when a connection cannot be made (the
request never left, so trying the next is safe even for a write); a timeout or a connection lost
mid-call raises at once (a write may have been applied: the caller decides), and the next call starts
at the next endpoint. Failures to reach etcd raise ``EtcdUnavailable``, an error answer ``EtcdError``;
a watch whose stream breaks raises ``EtcdUnavailable`` too, and ``WatchCanceled`` when etcd cancels it
(its start revision compacted): the caller re-reads and watches again from the read's revision + 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.etcd import gateway
from vllm_disagg.etcd.gateway import (
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    WatchCanceled,
    WatchEvent,
    b64,
    key_bytes,
    key_range,
    number,
)

__all__ = ["EtcdClient", "EtcdError", "EtcdUnavailable", "KeyValue", "WatchCanceled", "WatchEvent"]

_JSON = {"Content-Type": "application/json"}
# The request never reached the server: the next endpoint may have it, even a write.
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_READ_CHUNK = 64 * 1024


def _cause(exc: BaseException) -> str:
    """An exception as a short cause: its class, and its message when it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EtcdClient:
    """One etcd cluster through its JSON gateway: ``endpoints`` are ``http://host:2379`` URLs."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 2.0) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise ValueError("EtcdClient needs a list of endpoint URLs, e.g. ['http://127.0.0.1:2379']")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self._endpoints = tuple(url.rstrip("/") for url in endpoints)
        self._timeout_s = timeout_s
        self._next = 0  # the endpoint a call tries first: the one that answered last
        self._session: aiohttp.ClientSession | None = None  # made on first use, inside the event loop
        self._closed = False

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoint URLs, in the order given."""
        return self._endpoints

    @property
    def timeout_s(self) -> float:
        """Each call's deadline."""
        return self._timeout_s

    async def close(self) -> None:
        """Close the HTTP session (open watches end with ``EtcdUnavailable``); the client is done."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- keys ------------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        """The key, or None when it does not exist."""
        answer = await self._call("/v3/kv/range", key_range(key, prefix=False))
        kvs = gateway.key_values(answer)
        return kvs[0] if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key starting with ``prefix``, sorted by key, and the store revision of the read (watch
        from it + 1 to miss nothing)."""
        answer = await self._call("/v3/kv/range", key_range(prefix, prefix=True))
        return gateway.key_values(answer), gateway.revision(answer)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Set the key (attached to ``lease``, 0: none); the store's new revision."""
        body = {"key": b64(key_bytes(key)), "value": b64(value), "lease": str(lease)}
        return gateway.revision(await self._call("/v3/kv/put", body))

    async def delete(self, key: str) -> int:
        """Delete the key; how many keys were deleted (0 or 1)."""
        return number(await self._call("/v3/kv/deleterange", key_range(key, prefix=False)), "deleted")

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``; how many."""
        return number(await self._call("/v3/kv/deleterange", key_range(prefix, prefix=True)), "deleted")

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> KeyValue | None:
        """Set the key only if it does not exist (one transaction); the created key, or None if it exists."""
        raw = b64(key_bytes(key))
        body = {
            "compare": [{"key": raw, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [
                {"request_put": {"key": raw, "value": b64(value), "lease": str(lease)}},
                {"request_range": {"key": raw}},
            ],
        }
        answer = await self._call("/v3/kv/txn", body)
        if not answer.get("succeeded"):
            return None
        responses = gateway.objects(answer, "responses")
        kvs = gateway.key_values(responses[-1].get("response_range") or {}) if responses else []
        if not kvs:
            raise EtcdError(f"etcd created {key!r} but its transaction did not read it back")
        return kvs[0]

    async def put_if(self, key: str, value: bytes, *, mod_revision: int) -> bool:
        """Set the key only if its ``mod_revision`` is still this one (0: only if absent); whether it was."""
        raw = b64(key_bytes(key))
        body = {
            "compare": [{"key": raw, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}],
            "success": [{"request_put": {"key": raw, "value": b64(value)}}],
        }
        return bool((await self._call("/v3/kv/txn", body)).get("succeeded"))

    async def put_fenced(self, key: str, value: bytes | None, *, fence_key: str, fence_revision: int) -> bool:
        """Set the key (``value`` None: delete it) only while ``fence_key`` exists with this
        ``create_revision`` (a leader's term: its epoch), in one transaction; whether it was done."""
        return await self.put_many_fenced({key: value}, fence_key=fence_key, fence_revision=fence_revision)

    async def put_many_fenced(
        self, values: Mapping[str, bytes | None], *, fence_key: str, fence_revision: int
    ) -> bool:
        """``put_fenced`` of several keys at once: all of them or none (one transaction)."""
        ops: list[dict[str, Any]] = []
        for key, value in values.items():
            raw = b64(key_bytes(key))
            if value is None:
                ops.append({"request_delete_range": {"key": raw}})
            else:
                ops.append({"request_put": {"key": raw, "value": b64(value)}})
        fence = b64(key_bytes(fence_key))
        compare = {
            "key": fence,
            "target": "CREATE",
            "result": "EQUAL",
            "create_revision": str(fence_revision),
        }
        body = {"compare": [compare], "success": ops}
        return bool((await self._call("/v3/kv/txn", body)).get("succeeded"))

    # -- leases ----------------------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds (etcd raises a TTL below its minimum, 2 s by default); its id."""
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl_s), "ID": "0"})
        lease_id = number(answer, "ID")
        if lease_id == 0:
            raise EtcdError(f"etcd granted no lease: {answer!r}")
        return lease_id

    async def keepalive(self, lease_id: int) -> int:
        """Renew the lease; its TTL again, in seconds, or 0 when the lease is gone (expired or revoked)."""
        endpoint, status, raw = await self._call_raw("/v3/lease/keepalive", {"ID": str(lease_id)})
        path = "/v3/lease/keepalive"
        first = raw.strip().split(b"\n", 1)[0]
        if status != 200 or not first:
            gateway.parse_answer(status, raw, endpoint=endpoint, path=path)  # raises for an error answer
            raise EtcdError(f"etcd at {endpoint}: {path}: an empty answer", endpoint=endpoint)
        return max(0, number(gateway.stream_result(first, endpoint=endpoint, path=path), "TTL"))

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease, deleting every key attached to it; a lease already gone is no error."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdUnavailable:
            raise
        except EtcdError as exc:
            if exc.code != gateway.GRPC_NOT_FOUND:
                raise

    # -- watches ---------------------------------------------------------------------------------------

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncGenerator[list[WatchEvent], None]:
        """The changes to ``key`` (or every key under it), a batch per message, from ``start_revision``
        (0: from now), on one streaming answer, for as long as the caller iterates. Raises
        ``EtcdUnavailable`` when the stream breaks or ends and ``WatchCanceled`` when etcd cancels it.

        It cannot tell a silent etcd (a frozen process, a lost network) from a quiet key: pair it with
        something that has a deadline, such as a lease's keepalives. Close it (``contextlib.aclosing``)
        when stopping early, which closes the stream and so cancels the watch in etcd.
        """
        request = {**key_range(key, prefix=prefix), "start_revision": str(start_revision)}
        endpoint, response = await self._open_watch({"create_request": request})
        try:
            async for line in self._lines(endpoint, response):
                result = gateway.stream_result(line, endpoint=endpoint, path="/v3/watch")
                events = gateway.watch_events(result, endpoint=endpoint)
                if events:
                    yield events
        finally:
            response.close()

    async def _open_watch(self, body: dict[str, Any]) -> tuple[str, aiohttp.ClientResponse]:
        """Open the stream and read etcd's ``created`` message, all within the call's deadline."""
        causes: list[str] = []
        for index, endpoint in self._rotation():
            url = f"{endpoint}/v3/watch"
            try:
                async with asyncio.timeout(self._timeout_s):
                    response = await self._http().post(url, data=jsonutil.dumps(body), headers=_JSON)
                    try:
                        await self._expect_created(endpoint, response)
                    except BaseException:
                        response.close()
                        raise
            except _NOT_SENT as exc:
                causes.append(f"{endpoint}: {_cause(exc)}")
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._next = (index + 1) % len(self._endpoints)
                raise EtcdUnavailable(f"etcd at {endpoint}: watch: {_cause(exc)}", endpoint=endpoint) from exc
            self._next = index
            return endpoint, response
        raise self._unreachable("/v3/watch", causes)

    async def _expect_created(self, endpoint: str, response: aiohttp.ClientResponse) -> None:
        """The stream's first message says the watch was created; anything else raises."""
        if response.status != 200:
            raw = await response.read()
            gateway.parse_answer(response.status, raw, endpoint=endpoint, path="/v3/watch")
        line = await response.content.readline()
        result = gateway.stream_result(line, endpoint=endpoint, path="/v3/watch")
        gateway.watch_events(result, endpoint=endpoint)  # a watch canceled at once (compacted) raises
        if not result.get("created"):
            raise EtcdError(f"etcd at {endpoint}: the watch stream did not start with its creation")

    @staticmethod
    async def _lines(endpoint: str, response: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
        """The stream's messages, one per line (a message may come in many chunks); a broken or ended
        stream raises EtcdUnavailable."""
        buffer = b""
        while True:
            try:
                chunk = await response.content.read(_READ_CHUNK)
            except (aiohttp.ClientError, OSError) as exc:
                raise EtcdUnavailable(
                    f"etcd at {endpoint}: the watch stream broke: {_cause(exc)}", endpoint=endpoint
                ) from exc
            if not chunk:
                raise EtcdUnavailable(f"etcd at {endpoint}: the watch stream ended", endpoint=endpoint)
            lines, buffer = gateway.split_lines(buffer + chunk)
            for line in lines:
                yield line

    # -- plumbing --------------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EtcdUnavailable("the etcd client is closed")
        if self._session is None:
            # Deadlines are each call's (``asyncio.timeout``): a watch's stream has none once open.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    def _rotation(self) -> list[tuple[int, str]]:
        """The endpoints in the order a call tries them: the preferred one first."""
        count = len(self._endpoints)
        return [((self._next + i) % count, self._endpoints[(self._next + i) % count]) for i in range(count)]

    def _unreachable(self, path: str, causes: list[str]) -> EtcdUnavailable:
        return EtcdUnavailable(f"no etcd endpoint reachable for {path}: " + "; ".join(causes))

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path``; the answer's JSON object (an error answer raises EtcdError)."""
        endpoint, status, raw = await self._call_raw(path, body)
        return gateway.parse_answer(status, raw, endpoint=endpoint, path=path)

    async def _call_raw(self, path: str, body: dict[str, Any]) -> tuple[str, int, bytes]:
        """POST ``body`` to ``path`` on the first endpoint that takes the connection: (endpoint, status,
        raw answer)."""
        data = jsonutil.dumps(body)
        causes: list[str] = []
        for index, endpoint in self._rotation():
            try:
                async with asyncio.timeout(self._timeout_s):
                    async with self._http().post(f"{endpoint}{path}", data=data, headers=_JSON) as response:
                        raw = await response.read()
            except _NOT_SENT as exc:
                causes.append(f"{endpoint}: {_cause(exc)}")
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._next = (index + 1) % len(self._endpoints)
                cause = (
                    f"no answer in {self._timeout_s:g} s" if isinstance(exc, TimeoutError) else _cause(exc)
                )
                raise EtcdUnavailable(f"etcd at {endpoint}: {path}: {cause}", endpoint=endpoint) from exc
            self._next = index
            return endpoint, response.status, raw
        raise self._unreachable(path, causes)
