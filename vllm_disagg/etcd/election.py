"""Leader election on one etcd key, with fencing epochs.

Each replica campaigns by creating the key, attached to its own lease, only if the key is absent (one
transaction): whoever creates it leads, for as long as its lease lives; the others watch the key and
campaign again when it is deleted (a resignation revokes the leader's lease; a crashed leader's lease
expires). The leader's **epoch** is the key's ``create_revision``: etcd's revisions only grow, and every
term creates the key anew, so each term's epoch is unique and larger than every earlier one. Whatever
the leader does to shared state it fences with its epoch, and a newer epoch wins.

**Step-down rule.** A leader stops leading *before* its lease can expire in etcd. The lease cannot
expire before ``sent_at + ttl`` of its last successful keepalive (etcd counts the TTL from when it
handles the keepalive, which is after we sent it); the leader gives up a margin earlier
(``lease.step_down_margin``), on a timer on the injected clock, unless a newer keepalive succeeded by
then. It also steps down at once when a keepalive answers that the lease is gone, or when the watch shows
its key deleted or held by another lease. ``is_leader`` checks the deadline itself too, so it reads
False past the deadline even before the timer's task has run. After a lease loss the replica revokes
what is left of the old lease and campaigns with a new one once etcd answers: a new term, a new epoch.

The key's value is this module's claim: ``{"replica_id": ..., "value": <the replica's value as text>}``
(readable with ``etcdctl get``); a value that is not one reads as a leader with an empty replica id.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from vllm_disagg import jsonutil
from vllm_disagg.clock import Clock
from vllm_disagg.etcd.client import EtcdClient, EtcdError, KeyValue
from vllm_disagg.etcd.lease import Backoff, LeaseHolder, Unwatch, Watchers, lease_gone, revoke_quietly

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads: the replica, the value it campaigned with, its term's epoch, and the wall time the term
    began as this replica saw it."""

    replica_id: str
    value: bytes
    epoch: int
    since: float


def encode_claim(replica_id: str, value: bytes) -> bytes:
    """The leader key's value: the replica's id and its value (UTF-8 text, JSON as a rule)."""
    return jsonutil.dumps({"replica_id": replica_id, "value": value.decode("utf-8")})


def decode_claim(raw: bytes) -> tuple[str, bytes]:
    """(replica id, value) of a claim; anything else is ("", the raw bytes)."""
    try:
        claim = jsonutil.loads(raw)
    except ValueError:
        return "", raw
    if not isinstance(claim, dict):
        return "", raw
    replica_id, value = claim.get("replica_id"), claim.get("value")
    if isinstance(replica_id, str) and isinstance(value, str):
        return replica_id, value.encode("utf-8")
    return "", raw


class Election:
    """Campaign for leadership of `key` with value `value` (this replica's description, JSON bytes)."""

    def __init__(
        self, client: EtcdClient, key: str, replica_id: str, value: bytes, *, ttl_s: int, clock: Clock
    ) -> None:
        self._client = client
        self._key = key
        self._replica_id = replica_id
        self._claim = encode_claim(replica_id, value)  # raises for a value that is not UTF-8 text
        self._clock = clock
        self._name = f"election {key!r} ({replica_id})"
        self._holder = LeaseHolder(
            client,
            ttl_s,
            clock,
            work=self._campaign,
            on_lost=self._lease_lost,
            report=self._report,
            name=self._name,
        )
        self._epoch = 0  # the epoch this replica leads in; 0 when it does not
        self._leader: Leader | None = None
        self._etcd_ok = False
        self._watchers = Watchers()

    @property
    def is_leader(self) -> bool:
        """Whether this replica leads now: it holds the key, and its lease is before its step-down time."""
        return self._epoch != 0 and self._holder.holds()

    @property
    def epoch(self) -> int:
        """This replica's fencing epoch while it leads; 0 when it does not."""
        return self._epoch if self.is_leader else 0

    @property
    def leader(self) -> Leader | None:
        """Who leads, as last seen; None when unknown (not yet read, or the lease lost to an outage)."""
        return self._leader

    @property
    def etcd_ok(self) -> bool:
        """Whether the last etcd call succeeded."""
        return self._etcd_ok

    def lease_deadline(self) -> float:
        """The earliest monotonic time the current lease can expire in etcd: the last successful grant's
        or keepalive's sending + TTL (-inf before the first grant). Leadership ends before it."""
        lease = self._holder.lease
        return lease.timer.expires_at if lease is not None else float("-inf")

    def watch(self, callback: Callable[[], None]) -> Unwatch:
        """Call ``callback()`` after every change of ``is_leader``, ``leader`` or ``etcd_ok``; it must only
        set a flag or an event. Returns the call that stops it."""
        return self._watchers.add(callback)

    async def run(self) -> None:
        """Campaign, lead or follow, and campaign again, until cancelled or ``resign``; survives etcd
        outages (backing off on the clock)."""
        try:
            await self._holder.run()
        finally:
            self._change(epoch=0, leader=None)

    async def resign(self) -> None:
        """Stop leading and campaigning: revoking the lease deletes the key if it is ours, so a follower
        takes over at once rather than after the TTL. etcd unreachable only logs: the lease expires."""
        self._change(epoch=0)  # first stop leading; only then let anyone else
        lease_id = await self._holder.stop()
        await revoke_quietly(self._client, lease_id, self._name)
        self._change(epoch=0, leader=None)

    # -- the campaign, under one lease -----------------------------------------------------------------

    async def _campaign(self, lease_id: int) -> None:
        backoff = Backoff(self._clock)
        while True:
            try:
                kv = await self._claim_or_read(lease_id)
                self._observe(kv, lease_id)
                backoff.reset()
                await self._follow(kv, lease_id)
                continue  # the key was deleted: campaign again at once
            except EtcdError as exc:  # unreachable, or the watch broke or was canceled: read again
                if lease_gone(exc):
                    raise  # the lease's holder ends the term at once
                self._report(False)
                log.info("%s: %s", self._name, exc)
            await backoff.wait()

    async def _claim_or_read(self, lease_id: int) -> KeyValue:
        """Create the key with our lease if it is absent, else read who holds it."""
        while True:
            created = await self._client.create(self._key, self._claim, lease=lease_id)
            self._report(True)
            if created is not None:
                return created
            current = await self._client.get(self._key)
            if current is not None:
                return current  # (ours too when an earlier create succeeded but its answer was lost)

    async def _follow(self, kv: KeyValue, lease_id: int) -> None:
        """Watch the key from its last change on; return when it is deleted."""
        stream = self._client.watch(self._key, start_revision=kv.mod_revision + 1)
        async with contextlib.aclosing(stream):
            async for events in stream:
                self._report(True)
                for event in events:
                    if event.kind == "delete":
                        self._change(epoch=0, leader=None)
                        return
                    self._observe(event.kv, lease_id)

    def _observe(self, kv: KeyValue, lease_id: int) -> None:
        """Who holds the key now: this replica (the key is on its lease) or another."""
        replica_id, value = decode_claim(kv.value)
        ours = kv.lease == lease_id and not self._holder.stopped
        old = self._leader
        since = old.since if old is not None and old.epoch == kv.create_revision else self._clock.wall()
        leader = Leader(replica_id=replica_id, value=value, epoch=kv.create_revision, since=since)
        self._change(epoch=kv.create_revision if ours else 0, leader=leader)

    # -- state and notification ------------------------------------------------------------------------

    def _lease_lost(self, reason: str) -> None:
        """Called the moment the lease is lost: not leading, and who leads is unknown until etcd answers."""
        if self._epoch:
            log.warning("%s: stepping down from epoch %d: %s", self._name, self._epoch, reason)
        self._change(epoch=0, leader=None)

    def _report(self, ok: bool) -> None:
        if ok != self._etcd_ok:
            before = self._state()
            self._etcd_ok = ok
            self._notify_if_changed(before)

    _KEEP = Leader("", b"", -1, 0.0)  # "leave the leader as it is" for ``_change``

    def _change(self, *, epoch: int, leader: Leader | None = _KEEP) -> None:
        before = self._state()
        self._epoch = epoch
        if leader is not self._KEEP:
            self._leader = leader
        if epoch and not before[0]:
            log.info("%s: leading, epoch %d", self._name, epoch)
        self._notify_if_changed(before)

    def _state(self) -> tuple[bool, Leader | None, bool]:
        return self.is_leader, self._leader, self._etcd_ok

    def _notify_if_changed(self, before: tuple[bool, Leader | None, bool]) -> None:
        if self._state() != before:
            self._watchers.notify()
