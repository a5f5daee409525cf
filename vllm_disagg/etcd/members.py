"""Replica membership: each replica's key under a prefix, on its own lease, and the live view of all.

A replica keeps ``<prefix><replica_id>`` (its value: the JSON it describes itself with, its URLs) on a
lease it keeps alive; when the lease is lost (etcd said it is gone, or no keepalive succeeded before the
step-down deadline: see ``lease.py``) it takes a new lease and puts the key again once etcd answers, and
it puts it back if anyone deletes it. A replica that dies stops renewing, and etcd deletes its key when
the lease expires. The view of every member is a read of the prefix followed by a watch from the read's
revision + 1, read again whenever the watch breaks; during an outage it stays as last seen (``etcd_ok``
says so).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from vllm_disagg.clock import Clock
from vllm_disagg.etcd.client import EtcdClient, EtcdError, KeyValue, WatchEvent
from vllm_disagg.etcd.lease import Backoff, LeaseHolder, Unwatch, Watchers, lease_gone, revoke_quietly

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Member:
    """One replica: its id (its key after the prefix) and the value it wrote (JSON: its URLs)."""

    replica_id: str
    value: bytes


class Members:
    """This replica's membership key `<prefix><replica_id>` on a lease (kept alive, re-put after an etcd
    outage or lease loss), and the live view of every member under `prefix` (get_prefix + watch, resync on
    a broken watch)."""

    def __init__(
        self, client: EtcdClient, prefix: str, replica_id: str, value: bytes, *, ttl_s: int, clock: Clock
    ) -> None:
        if not replica_id:
            raise ValueError("a member needs a replica id")
        self._client = client
        self._prefix = prefix
        self._replica_id = replica_id
        self._key = prefix + replica_id
        self._value = value
        self._clock = clock
        self._name = f"member {self._key!r}"
        self._holder = LeaseHolder(
            client,
            ttl_s,
            clock,
            work=self._serve,
            on_lost=self._lease_lost,
            report=self._report,
            name=self._name,
        )
        self._members: dict[str, Member] = {}
        self._etcd_ok = False
        self._watchers = Watchers()

    @property
    def key(self) -> str:
        """This replica's membership key."""
        return self._key

    @property
    def etcd_ok(self) -> bool:
        """Whether the last etcd call succeeded (while it does not, the view is as last seen)."""
        return self._etcd_ok

    def members(self) -> dict[str, Member]:
        """Every member as last seen, by replica id (this replica too, once its key is in etcd)."""
        return dict(self._members)

    def watch(self, callback: Callable[[], None]) -> Unwatch:
        """Call ``callback()`` after every change of the view or of ``etcd_ok``; it must only set a flag
        or an event. Returns the call that stops it."""
        return self._watchers.add(callback)

    async def run(self) -> None:
        """Keep the key and the view, until cancelled or ``leave``; survives etcd outages."""
        await self._holder.run()

    async def leave(self) -> None:
        """Stop, and delete this replica's key: revoking its lease does (one etcd call, so at most the
        client's timeout). etcd unreachable only logs: the lease expires, and the key with it."""
        lease_id = await self._holder.stop()
        if lease_id:
            await revoke_quietly(self._client, lease_id, self._name)
        else:  # never granted a lease, so never put the key; make sure anyway
            try:
                await self._client.delete(self._key)
            except EtcdError as exc:
                log.warning("%s: could not delete the key on leaving: %s", self._name, exc)
        self._update(lambda view: view.pop(self._replica_id, None) is not None)

    # -- under one lease -------------------------------------------------------------------------------

    async def _serve(self, lease_id: int) -> None:
        backoff = Backoff(self._clock)
        while True:
            try:
                revision = await self._sync(lease_id)
                backoff.reset()
                await self._follow(revision)
                continue  # our key was deleted: put it back at once
            except EtcdError as exc:  # unreachable, or the watch broke or was canceled: read again
                if lease_gone(exc):
                    raise  # the lease's holder ends the term at once
                self._report(False)
                log.info("%s: %s", self._name, exc)
            await backoff.wait()

    async def _sync(self, lease_id: int) -> int:
        """Read every member, put our key if it is not there as it should be; the revision to watch after."""
        kvs, revision = await self._client.get_prefix(self._prefix)
        self._report(True)
        mine = next((kv for kv in kvs if kv.key == self._key), None)
        if mine is None or mine.lease != lease_id or mine.value != self._value:
            await self._client.put(self._key, self._value, lease=lease_id)  # the watch will show it
        self._update(lambda view: self._replace(view, kvs))
        return revision

    async def _follow(self, revision: int) -> None:
        """Apply the watch's events; return when our own key is deleted."""
        stream = self._client.watch(self._prefix, prefix=True, start_revision=revision + 1)
        async with contextlib.aclosing(stream):
            async for events in stream:
                self._report(True)
                self._update(functools.partial(self._apply, events=events))
                deleted = any(e.kind == "delete" and e.kv.key == self._key for e in events)
                if deleted and self._replica_id not in self._members:
                    return

    def _member(self, kv: KeyValue) -> Member:
        return Member(replica_id=kv.key[len(self._prefix) :], value=kv.value)

    def _replace(self, view: dict[str, Member], kvs: list[KeyValue]) -> bool:
        fresh = {member.replica_id: member for member in map(self._member, kvs)}
        if fresh == view:
            return False
        view.clear()
        view.update(fresh)
        return True

    def _apply(self, view: dict[str, Member], events: list[WatchEvent]) -> bool:
        changed = False
        for event in events:
            member = self._member(event.kv)
            if event.kind == "delete":
                changed |= view.pop(member.replica_id, None) is not None
            elif view.get(member.replica_id) != member:
                view[member.replica_id] = member
                changed = True
        return changed

    # -- state and notification ------------------------------------------------------------------------

    def _update(self, change: Callable[[dict[str, Member]], bool]) -> None:
        if change(self._members):
            self._watchers.notify()

    def _lease_lost(self, reason: str) -> None:
        log.warning("%s: lease lost (%s); the key goes back once etcd answers", self._name, reason)

    def _report(self, ok: bool) -> None:
        if ok != self._etcd_ok:
            self._etcd_ok = ok
            self._watchers.notify()
