"""The step-down deadline, and a lease kept alive on a fake clock against an in-memory etcd."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.etcd.fake_etcd import FakeEtcd
from vllm_disagg.clock import FakeClock
from vllm_disagg.etcd.lease import (
    MIN_TTL_S,
    Backoff,
    KeptLease,
    LeaseHolder,
    LeaseTimer,
    step_down_margin,
)


@pytest.mark.parametrize(
    ("ttl_s", "margin"),
    [(2, 0.5), (3, 0.75), (4, 1.0), (10, 2.5), (60, 15.0)],
    ids=["minimum-ttl-half-a-second", "3s", "4s", "10s-a-quarter", "60s-a-quarter"],
)
def test_the_margin_is_half_a_second_or_a_quarter_of_the_ttl(ttl_s: int, margin: float) -> None:
    assert step_down_margin(ttl_s) == margin
    assert margin < ttl_s * 2 / 3  # a keepalive every third of the TTL renews before the deadline


def test_the_deadline_counts_from_when_the_renewal_was_sent() -> None:
    timer = LeaseTimer(8)
    assert not timer.holds(0.0)  # nothing granted yet
    timer.renewed(100.0)
    assert (timer.expires_at, timer.safe_until) == (108.0, 106.0)
    assert timer.holds(105.999) and not timer.holds(106.0)


def test_a_late_answer_to_an_older_keepalive_never_moves_the_deadline_back() -> None:
    timer = LeaseTimer(8)
    timer.renewed(110.0)
    timer.renewed(104.0)
    assert timer.expires_at == 118.0


def test_etcd_answering_a_shorter_ttl_than_asked_shortens_the_deadline() -> None:
    timer = LeaseTimer(8)
    timer.renewed(100.0, ttl_s=5)
    assert timer.expires_at == 105.0
    timer.renewed(101.0, ttl_s=20)  # a longer one than asked counts as asked
    assert timer.expires_at == 109.0


def test_a_ttl_below_etcds_minimum_is_refused(clock: FakeClock) -> None:
    etcd = FakeEtcd(clock)
    with pytest.raises(ValueError, match="at least 2 s"):
        LeaseHolder(
            etcd, MIN_TTL_S - 1, clock, work=_idle, on_lost=lambda _: None, report=lambda _: None, name="t"
        )


async def test_backoff_doubles_up_to_its_cap_and_resets(clock: FakeClock) -> None:
    backoff = Backoff(clock, first=0.1, cap=0.5)

    async def timed() -> float:
        start = clock.monotonic()
        await backoff.wait()
        return round(clock.monotonic() - start, 6)

    waits = []
    for step in range(6):
        if step == 5:
            backoff.reset()
        task = asyncio.ensure_future(timed())
        await clock.run_for(1.0)
        waits.append(await task)
    assert waits == [0.1, 0.2, 0.4, 0.5, 0.5, 0.1]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=100.0)


async def _idle(lease_id: int) -> None:
    await asyncio.Event().wait()


class Held:
    """A KeptLease held over idle work: what it reported, and when and why it was lost."""

    def __init__(self, etcd: FakeEtcd, clock: FakeClock, ttl_s: int) -> None:
        self.clock = clock
        self.reports: list[bool] = []
        self.losses: list[tuple[float, str]] = []
        self.lease = KeptLease(etcd, ttl_s, clock, report=self.reports.append)
        self.task: asyncio.Task[str] | None = None

    async def start(self) -> None:
        await self.lease.grant()
        work = _idle(self.lease.lease_id)
        self.task = asyncio.ensure_future(self.lease.hold(work, self._lost))
        await self.clock.settle()

    def _lost(self, reason: str) -> None:
        self.losses.append((self.clock.monotonic(), reason))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def test_keepalives_every_third_of_the_ttl_keep_the_lease(clock: FakeClock) -> None:
    etcd = FakeEtcd(clock)
    held = Held(etcd, clock, ttl_s=6)
    await held.start()
    await clock.run_for(60.0)
    keepalives = [at for what, at in etcd.calls if what == "keepalive"]
    assert keepalives == [100.0 + 2.0 * k for k in range(1, 31)]
    assert held.losses == [] and held.lease.timer.expires_at == 160.0 + 6.0
    await held.stop()


async def test_a_grant_answered_late_is_renewed_at_once_not_lost_before_its_first_keepalive(
    clock: FakeClock,
) -> None:
    """etcd just restarted answers the grant 4.3 s after it was asked: of the 4.5 s of trust (a 6 s TTL less
    its margin) 0.2 s are left, less than the 2 s to the next keepalive, so that keepalive goes at once."""
    etcd = FakeEtcd(clock, timeout_s=10.0)
    held = Held(etcd, clock, ttl_s=6)
    etcd.freeze()
    starting = asyncio.ensure_future(held.start())
    await clock.run_for(4.3)
    etcd.thaw()
    await clock.settle()
    await starting
    await clock.run_for(10.0)
    assert held.losses == [], "the lease was renewed before the trust the late grant left ran out"
    keepalives = [at for what, at in etcd.calls if what == "keepalive"]
    assert keepalives[0] == pytest.approx(104.3), "the first keepalive went as soon as the grant came"
    await held.stop()


async def test_an_unanswered_lease_is_lost_at_its_deadline_not_before(clock: FakeClock) -> None:
    etcd = FakeEtcd(clock)
    held = Held(etcd, clock, ttl_s=6)
    await held.start()
    await clock.run_for(2.0)  # one keepalive, sent and answered at 102
    etcd.freeze()
    await clock.run_for(6.0 - 1.5 - 0.001)
    assert held.losses == []
    await clock.run_for(0.002)
    assert held.losses == [(102.0 + 6.0 - 1.5, "no keepalive succeeded for 4.5 s")]
    assert held.task is not None and await held.task == "no keepalive succeeded for 4.5 s"
    assert held.lease.lost is not None
    assert False in held.reports  # the keepalives that timed out meanwhile
    await held.stop()


async def test_a_keepalive_answering_ttl_zero_loses_the_lease_at_once(clock: FakeClock) -> None:
    etcd = FakeEtcd(clock)
    held = Held(etcd, clock, ttl_s=6)
    await held.start()
    etcd.forget_lease(held.lease.lease_id)
    await clock.run_for(3.0)
    assert held.losses == [(102.0, "etcd says the lease is gone")]  # the next keepalive, not the deadline
    await held.stop()


async def test_a_brief_outage_within_the_margin_keeps_the_lease(clock: FakeClock) -> None:
    etcd = FakeEtcd(clock, timeout_s=1.0)
    held = Held(etcd, clock, ttl_s=6)
    await held.start()
    etcd.freeze()  # the keepalive at 102 times out at 103; the retry at 104 waits
    await clock.run_for(3.5)
    etcd.thaw()  # ... and is answered now, before the deadline at 104.5
    await clock.run_for(20.0)
    assert held.losses == []
    assert held.reports[-1] is True and False in held.reports
    await held.stop()


async def test_the_holder_takes_a_new_lease_after_a_loss(clock: FakeClock) -> None:
    etcd = FakeEtcd(clock)
    leases: list[int] = []
    losses: list[str] = []

    async def work(lease_id: int) -> None:
        leases.append(lease_id)
        await asyncio.Event().wait()

    holder = LeaseHolder(etcd, 6, clock, work=work, on_lost=losses.append, report=lambda _: None, name="t")
    task = asyncio.ensure_future(holder.run())
    await clock.settle()
    etcd.forget_lease(leases[0])
    await clock.run_for(3.0)
    assert losses == ["etcd says the lease is gone"] and len(leases) == 2 and leases[1] != leases[0]
    assert holder.holds()
    assert await holder.stop() == leases[1]
    await task  # ``stop`` ends ``run``
    assert holder.stopped
