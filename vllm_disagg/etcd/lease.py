"""A lease kept alive, and how long its holder may trust it: the step-down deadline.

etcd counts a lease's TTL from when it handles a grant or a keepalive, which is after we sent it. So the
lease cannot expire in etcd before ``sent_at + ttl`` of the last grant or keepalive that succeeded
(``LeaseTimer.expires_at``), whatever happened since: answers lost, etcd frozen, the network cut. Whoever
holds something on the lease (the leader's key) stops trusting it a margin earlier, at ``safe_until``,
unless a newer keepalive succeeded by then; etcd cannot hand the key to anyone else before
``expires_at``, so a holder that honours ``safe_until`` never overlaps with the next.

``LeaseHolder`` is the loop that Election and Members share: grant a lease, run their work under it while
it holds, and after a loss (etcd said the lease is gone, or ``safe_until`` passed) revoke what is left of
it and start again with a new one, backing off while etcd does not answer; ``Watchers`` are their change
callbacks. All waiting is on the injected clock, so the timing is tested on ``FakeClock``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

from vllm_disagg.clock import Clock
from vllm_disagg.etcd.client import EtcdClient, EtcdError, EtcdUnavailable
from vllm_disagg.etcd.gateway import GRPC_NOT_FOUND

log = logging.getLogger(__name__)

# etcd's smallest lease TTL with its default timings (1.5 election timeouts, rounded up to whole seconds):
# a grant below it gets it instead. Asking less would make our deadlines wrong-footed, so it is refused.
MIN_TTL_S = 2


def step_down_margin(ttl_s: float) -> float:
    """How long before the earliest possible expiry a holder stops trusting its lease.

    It covers what can delay the holder's own notice: an event loop late to wake the timer (a loaded
    host, a long callback; we measure lags of a few hundred milliseconds on busy 2-core machines), and
    work already under way that still needs to see the change; clock rates differ by parts per million,
    which is nothing next to it. Half a second at least; a quarter of the TTL for longer TTLs, which are
    chosen where pauses are longer. It stays below two thirds of the TTL, so a keepalive sent every
    third of the TTL renews well before the deadline.
    """
    return max(0.5, ttl_s / 4)


def lease_gone(exc: EtcdError) -> bool:
    """Whether etcd refused a write because its lease no longer exists ("requested lease not found")."""
    return exc.code == GRPC_NOT_FOUND and not isinstance(exc, EtcdUnavailable)


class LeaseTimer:
    """When a lease can expire in etcd at the earliest, and until when its holder may trust it."""

    def __init__(self, ttl_s: int) -> None:
        self.ttl_s = ttl_s
        self.margin_s = step_down_margin(ttl_s)
        self.expires_at = -math.inf  # no grant or keepalive has succeeded yet

    def renewed(self, sent_at: float, ttl_s: float | None = None) -> None:
        """A grant or keepalive sent at ``sent_at`` (monotonic) succeeded, with ``ttl_s`` (default: the
        TTL asked for; etcd's answer when smaller); a late answer never moves the deadline back."""
        ttl = self.ttl_s if ttl_s is None else min(ttl_s, self.ttl_s)
        self.expires_at = max(self.expires_at, sent_at + ttl)

    @property
    def safe_until(self) -> float:
        """The step-down deadline: ``expires_at`` less the margin."""
        return self.expires_at - self.margin_s

    def holds(self, now: float) -> bool:
        """Whether the lease may still be trusted at ``now``."""
        return now < self.safe_until


class Backoff:
    """Growing waits between failed attempts: ``first`` doubling up to ``cap``, on the clock."""

    def __init__(self, clock: Clock, *, first: float = 0.1, cap: float = 1.0) -> None:
        self._clock = clock
        self._first = first
        self._cap = cap
        self._next = first

    def reset(self) -> None:
        """An attempt succeeded: the next wait is the first again."""
        self._next = self._first

    async def wait(self) -> None:
        """Wait the current step, then grow it."""
        delay, self._next = self._next, min(self._cap, self._next * 2)
        await self._clock.sleep(delay)


class KeptLease:
    """One lease: granted, renewed every third of its TTL, and lost when a keepalive says it is gone or
    ``safe_until`` passes without a renewal."""

    def __init__(
        self, client: EtcdClient, ttl_s: int, clock: Clock, *, report: Callable[[bool], None]
    ) -> None:
        self._client = client
        self._clock = clock
        self._report = report  # whether each etcd call succeeded
        self.timer = LeaseTimer(ttl_s)
        self.lease_id = 0
        self.lost: str | None = None  # why the lease was lost; None while it holds

    async def grant(self) -> int:
        """Ask etcd for the lease; its id. Its TTL counts from the request's sending."""
        sent_at = self._clock.monotonic()
        self.lease_id = await self._client.grant(self.timer.ttl_s)
        self.timer.renewed(sent_at)
        return self.lease_id

    async def hold(self, work: Coroutine[Any, Any, None], on_lost: Callable[[str], None]) -> str:
        """Run ``work`` while the lease holds. When it is lost, call ``on_lost(reason)`` at once (before
        anything is cancelled), cancel ``work`` and return the reason. ``work`` returning or raising
        ends the hold too: an EtcdError saying the lease is gone (``lease_gone``) is a loss, any other
        exception propagates, and a return says ``"work ended"``."""
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def lose(reason: str) -> None:
            if not lost.done():
                on_lost(reason)
                self.lost = reason
                lost.set_result(reason)

        tasks: list[asyncio.Future[None]] = [
            asyncio.ensure_future(work),
            asyncio.ensure_future(self._keep_alive(lose)),
            asyncio.ensure_future(self._expire(lose)),
        ]
        try:
            waits: list[asyncio.Future[Any]] = [lost, *tasks]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if lost.done():
            return lost.result()
        for task in tasks:
            error = None if task.cancelled() else task.exception()
            if isinstance(error, EtcdError) and lease_gone(error):  # a write on the lease was refused
                lose(f"etcd says the lease is gone: {error}")
                return lost.result()
            if error is not None:
                raise error
        return "work ended"

    async def _keep_alive(self, lose: Callable[[str], None]) -> None:
        interval = self.timer.ttl_s / 3
        # A grant answered late (etcd just restarted, say) may leave less trust than one interval: the
        # first keepalive then goes at once, or the lease would be given up before it was ever renewed.
        now = self._clock.monotonic()
        next_at = now if self.timer.safe_until - now < interval else now + interval
        while True:
            await self._clock.sleep(next_at - self._clock.monotonic())
            sent_at = self._clock.monotonic()
            try:
                ttl = await self._client.keepalive(self.lease_id)
            except EtcdError as exc:  # unreachable or erring: try again soon, until the deadline says lost
                self._report(False)
                log.warning("etcd lease %x: keepalive failed: %s", self.lease_id, exc)
                next_at = self._clock.monotonic() + interval / 2
                continue
            self._report(True)
            if ttl <= 0:
                lose("etcd says the lease is gone")
                return
            self.timer.renewed(sent_at, ttl)
            next_at = sent_at + interval

    async def _expire(self, lose: Callable[[str], None]) -> None:
        """Sleep until ``safe_until`` (which renewals keep moving on); then the lease is lost."""
        while (left := self.timer.safe_until - self._clock.monotonic()) > 0:
            await self._clock.sleep(left)
        lose(f"no keepalive succeeded for {self.timer.ttl_s - self.timer.margin_s:g} s")


class LeaseHolder:
    """Run ``work(lease_id)`` under a kept lease, again and again with a new lease after each loss, until
    stopped; Election and Members are built on it."""

    def __init__(
        self,
        client: EtcdClient,
        ttl_s: int,
        clock: Clock,
        *,
        work: Callable[[int], Coroutine[Any, Any, None]],
        on_lost: Callable[[str], None],
        report: Callable[[bool], None],
        name: str,
    ) -> None:
        if ttl_s < MIN_TTL_S:
            raise ValueError(
                f"an etcd lease TTL must be at least {MIN_TTL_S} s (etcd's minimum), not {ttl_s}"
            )
        self._client = client
        self._ttl_s = ttl_s
        self._clock = clock
        self._work = work
        self._on_lost = on_lost
        self._report = report
        self._name = name
        self._stopped = False
        self._term: asyncio.Task[None] | None = None
        self._unrevoked: list[int] = []  # lost leases etcd could not be told of yet (``_forget``)
        self.lease: KeptLease | None = None  # the lease of the current term, None before the first grant

    @property
    def stopped(self) -> bool:
        """``stop`` was called."""
        return self._stopped

    def holds(self) -> bool:
        """Whether the current lease may be trusted now (granted, and before its ``safe_until``)."""
        lease = self.lease
        if lease is None or lease.lease_id == 0 or lease.lost is not None:
            return False
        return lease.timer.holds(self._clock.monotonic())

    async def run(self) -> None:
        """Terms until ``stop`` (then it returns) or cancellation."""
        backoff = Backoff(self._clock, cap=max(0.5, self._ttl_s / 3))
        while not self._stopped:
            self._term = asyncio.create_task(self._one_term(backoff))
            try:
                await self._term
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopped and (task is None or not task.cancelling()):
                    return  # ``stop`` cancelled the term, not someone us
                raise
            if not self._stopped:
                await backoff.wait()

    async def stop(self) -> int:
        """End the current term and run no more; the id of the lease it held (0: none), for the caller
        to revoke or keep."""
        self._stopped = True
        lease_id = self.lease.lease_id if self.lease is not None else 0
        term = self._term
        if term is not None and not term.done():
            term.cancel()
            await asyncio.wait([term])
        return lease_id

    async def _one_term(self, backoff: Backoff) -> None:
        lease = KeptLease(self._client, self._ttl_s, self._clock, report=self._report)
        try:
            await lease.grant()
        except EtcdError as exc:
            self._report(False)
            log.warning("%s: etcd lease grant failed: %s", self._name, exc)
            return
        self._report(True)
        self.lease = lease
        backoff.reset()
        await self._revoke_unrevoked()
        reason = await lease.hold(self._work(lease.lease_id), self._on_lost)
        log.warning("%s: lost etcd lease %x: %s", self._name, lease.lease_id, reason)
        await self._forget(lease.lease_id)

    async def _forget(self, lease_id: int) -> None:
        """Revoke a lease we stopped trusting: whatever still hangs on it goes now, not at its expiry.
        One that cannot be revoked now (etcd away) is revoked once etcd answers again: a restarted etcd
        gives every lease a fresh TTL, and a leader key on it would name a leader that does not lead."""
        try:
            await self._client.revoke(lease_id)
        except EtcdError as exc:
            self._report(False)
            self._unrevoked.append(lease_id)
            log.info("%s: could not revoke lost lease %x yet: %s", self._name, lease_id, exc)

    async def _revoke_unrevoked(self) -> None:
        """Revoke the lost leases etcd could not be told of before (see ``_forget``)."""
        left = []
        for lease_id in self._unrevoked:
            try:
                await self._client.revoke(lease_id)
            except EtcdError:
                left.append(lease_id)
        self._unrevoked = left


Unwatch = Callable[[], None]


class Watchers:
    """Callbacks told of every change; each must only set a flag or an event, and must not raise."""

    def __init__(self) -> None:
        self._callbacks: tuple[Callable[[], None], ...] = ()

    def add(self, callback: Callable[[], None]) -> Unwatch:
        """Call ``callback()`` after every change; returns the call that stops it."""
        self._callbacks += (callback,)

        def unwatch() -> None:
            self._callbacks = tuple(c for c in self._callbacks if c is not callback)

        return unwatch

    def notify(self) -> None:
        """Tell every callback."""
        for callback in self._callbacks:
            callback()


async def revoke_quietly(client: EtcdClient, lease_id: int, name: str) -> None:
    """Revoke ``lease_id`` (0: nothing) on a clean shutdown; etcd unreachable only logs (it expires)."""
    if lease_id == 0:
        return
    try:
        await client.revoke(lease_id)
    except EtcdError as exc:
        log.warning("%s: could not revoke etcd lease %x (it will expire): %s", name, lease_id, exc)
