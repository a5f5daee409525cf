"""An in-memory etcd behind the ``EtcdClient`` interface, on a ``FakeClock``: keys, revisions, leases that
expire on the fake clock, watches, and a switch that makes it stop answering (as a frozen etcd: calls
hang until the client's timeout, then raise ``EtcdUnavailable``).

Only what Election and Members use is modelled, and only as etcd behaves: a lease counts its TTL from
when a grant or keepalive is handled; an expired or revoked lease deletes its keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from vllm_disagg.clock import FakeClock, wait_event
from vllm_disagg.etcd.client import EtcdClient, EtcdError, EtcdUnavailable, KeyValue, WatchEvent
from vllm_disagg.etcd.gateway import GRPC_NOT_FOUND


class FakeEtcd(EtcdClient):
    """One etcd and a client of it, in memory."""

    def __init__(self, clock: FakeClock, *, timeout_s: float = 2.0) -> None:
        super().__init__(["http://fake-etcd.invalid"], timeout_s=timeout_s)
        self.clock = clock
        self.revision = 1
        self.keys: dict[str, KeyValue] = {}
        self.leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, expires at)
        self.calls: list[tuple[str, float]] = []  # (what, when it was handled)
        self._next_lease = 0x100
        self._answering = asyncio.Event()
        self._answering.set()
        self._watches: list[tuple[str, bool, asyncio.Queue[list[WatchEvent]]]] = []
        self.history: list[WatchEvent] = []

    def freeze(self) -> None:
        """Stop answering: calls wait for ``thaw`` up to the client's timeout."""
        self._answering.clear()

    def thaw(self) -> None:
        self._answering.set()

    def forget_lease(self, lease_id: int) -> None:
        """Lose the lease without a word to watchers (its keys stay): only keepalives can tell."""
        self.leases.pop(lease_id, None)

    async def _handle(self, what: str) -> None:
        """Wait until etcd answers (or the client gives up), then apply expiries due by now."""
        if not await wait_event(self.clock, self._answering, self.timeout_s):
            raise EtcdUnavailable(f"etcd at fake: {what}: no answer in {self.timeout_s:g} s")
        now = self.clock.monotonic()
        for lease_id, (_, expires_at) in list(self.leases.items()):
            if expires_at <= now:
                self._drop_lease(lease_id)
        self.calls.append((what, now))

    def _drop_lease(self, lease_id: int) -> None:
        self.leases.pop(lease_id, None)
        for key, kv in list(self.keys.items()):
            if kv.lease == lease_id:
                self._delete(key)

    def _delete(self, key: str) -> None:
        del self.keys[key]
        self.revision += 1
        self._emit(WatchEvent("delete", KeyValue(key, b"", 0, self.revision, 0, 0)))

    def _put(self, key: str, value: bytes, lease: int) -> KeyValue:
        if lease and lease not in self.leases:
            raise EtcdError("etcdserver: requested lease not found", code=GRPC_NOT_FOUND)
        self.revision += 1
        old = self.keys.get(key)
        kv = KeyValue(
            key=key,
            value=value,
            create_revision=old.create_revision if old else self.revision,
            mod_revision=self.revision,
            version=(old.version if old else 0) + 1,
            lease=lease,
        )
        self.keys[key] = kv
        self._emit(WatchEvent("put", kv))
        return kv

    def _emit(self, event: WatchEvent) -> None:
        self.history.append(event)
        for key, prefix, queue in self._watches:
            if _matches(event, key, prefix):
                queue.put_nowait([event])

    # -- the client's interface -------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        await self._handle("get")
        return self.keys.get(key)

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        await self._handle("get_prefix")
        return sorted((kv for k, kv in self.keys.items() if k.startswith(prefix)), key=lambda kv: kv.key), (
            self.revision
        )

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        await self._handle("put")
        return self._put(key, value, lease).mod_revision

    async def delete(self, key: str) -> int:
        await self._handle("delete")
        if key not in self.keys:
            return 0
        self._delete(key)
        return 1

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> KeyValue | None:
        await self._handle("create")
        if key in self.keys:
            return None
        return self._put(key, value, lease)

    async def grant(self, ttl_s: int) -> int:
        await self._handle("grant")
        self._next_lease += 1
        self.leases[self._next_lease] = (ttl_s, self.clock.monotonic() + ttl_s)
        return self._next_lease

    async def keepalive(self, lease_id: int) -> int:
        await self._handle("keepalive")
        if lease_id not in self.leases:
            return 0
        ttl, _ = self.leases[lease_id]
        self.leases[lease_id] = (ttl, self.clock.monotonic() + ttl)
        return ttl

    async def revoke(self, lease_id: int) -> None:
        await self._handle("revoke")
        self._drop_lease(lease_id)

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncGenerator[list[WatchEvent], None]:
        await self._handle("watch")
        queue: asyncio.Queue[list[WatchEvent]] = asyncio.Queue()
        for event in self.history:
            if start_revision and event.kv.mod_revision >= start_revision and _matches(event, key, prefix):
                queue.put_nowait([event])
        entry = (key, prefix, queue)
        self._watches.append(entry)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watches.remove(entry)


def _matches(event: WatchEvent, key: str, prefix: bool) -> bool:
    return event.kv.key == key or (prefix and event.kv.key.startswith(key))
