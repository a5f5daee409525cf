"""Election's decisions on a fake clock against an in-memory etcd: when a leader steps down, and that
it campaigns again into a new epoch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.unit.etcd.fake_etcd import FakeEtcd
from vllm_disagg.clock import FakeClock
from vllm_disagg.etcd.election import Election, Leader, decode_claim, encode_claim

KEY = "leader"
TTL_S = 6  # keepalives every 2 s; the margin is 1.5 s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=100.0, wall_offset=0.0)


@pytest.fixture
def etcd(clock: FakeClock) -> FakeEtcd:
    return FakeEtcd(clock)


class Watched:
    """One election, and (time, is_leader, epoch) at each of its change callbacks."""

    def __init__(self, election: Election, clock: FakeClock) -> None:
        self.election = election
        self.samples: list[tuple[float, bool, int]] = []
        election.watch(lambda: self.samples.append((clock.monotonic(), election.is_leader, election.epoch)))

    def step_downs(self) -> list[float]:
        return [
            at
            for (at, leading, _), (_, was, _) in zip(self.samples[1:], self.samples, strict=False)
            if was and not leading
        ]


@pytest.fixture
async def elect(etcd: FakeEtcd, clock: FakeClock) -> AsyncIterator[Watched]:
    election = Election(etcd, KEY, "r0", b'{"url": "http://r0"}', ttl_s=TTL_S, clock=clock)
    watched = Watched(election, clock)
    task = asyncio.ensure_future(election.run())
    await clock.settle()
    try:
        yield watched
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_claim_round_trips_and_a_foreign_value_has_no_replica_id() -> None:
    assert decode_claim(encode_claim("r7", b'{"url": "x"}')) == ("r7", b'{"url": "x"}')
    assert decode_claim(b"plain") == ("", b"plain")
    assert decode_claim(b'{"replica_id": 3}') == ("", b'{"replica_id": 3}')


async def test_a_lone_replica_leads_with_the_keys_create_revision_as_epoch(
    elect: Watched, etcd: FakeEtcd
) -> None:
    election = elect.election
    kv = etcd.keys[KEY]
    assert election.is_leader and election.epoch == kv.create_revision
    assert election.leader == Leader("r0", b'{"url": "http://r0"}', kv.create_revision, since=100.0)
    assert election.etcd_ok


async def test_a_cut_off_leader_steps_down_at_its_deadline_before_the_lease_can_expire(
    elect: Watched, etcd: FakeEtcd, clock: FakeClock
) -> None:
    election = elect.election
    await clock.run_for(4.0)  # keepalives at 102 and 104 answered
    first_epoch = election.epoch
    assert election.lease_deadline() == 110.0
    etcd.freeze()
    await clock.run_for(110.0 - 1.5 - clock.monotonic() - 0.001)
    assert election.is_leader
    await clock.run_for(0.002)
    assert not election.is_leader and election.epoch == 0 and election.leader is None
    assert elect.step_downs() == [108.5]  # lease_deadline - margin, on the dot
    etcd.thaw()
    await clock.run_for(5.0)
    assert election.is_leader and election.epoch > first_epoch  # a new term


async def test_is_leader_reads_false_past_the_deadline_even_before_the_timer_runs(
    elect: Watched, etcd: FakeEtcd, clock: FakeClock
) -> None:
    etcd.freeze()
    clock.advance(10.0)  # time moves, but no task has run yet
    assert not elect.election.is_leader and elect.election.epoch == 0


async def test_a_lease_etcd_forgot_ends_the_term_at_the_next_keepalive(
    elect: Watched, etcd: FakeEtcd, clock: FakeClock
) -> None:
    first_epoch = elect.election.epoch
    etcd.forget_lease(etcd.keys[KEY].lease)
    await clock.run_for(2.0)
    assert elect.step_downs() == [102.0]
    await clock.run_for(1.0)
    assert elect.election.epoch > first_epoch  # the stale key went with the revoke; a new term began


async def test_its_key_deleted_the_leader_steps_down_and_campaigns_again(
    elect: Watched, etcd: FakeEtcd, clock: FakeClock
) -> None:
    first_epoch = elect.election.epoch
    await etcd.delete(KEY)
    await clock.settle()
    assert elect.step_downs() == [100.0]
    assert elect.election.is_leader and elect.election.epoch > first_epoch


async def test_its_key_taken_by_another_lease_the_leader_steps_down(
    elect: Watched, etcd: FakeEtcd, clock: FakeClock
) -> None:
    other = await etcd.grant(TTL_S)
    await etcd.put(KEY, encode_claim("intruder", b"{}"), lease=other)
    await clock.settle()
    election = elect.election
    assert not election.is_leader
    assert election.leader is not None and election.leader.replica_id == "intruder"


async def test_a_follower_takes_over_when_the_leader_resigns(etcd: FakeEtcd, clock: FakeClock) -> None:
    first = Election(etcd, KEY, "r0", b"{}", ttl_s=TTL_S, clock=clock)
    second = Election(etcd, KEY, "r1", b"{}", ttl_s=TTL_S, clock=clock)
    tasks = [asyncio.ensure_future(first.run())]
    await clock.settle()
    tasks.append(asyncio.ensure_future(second.run()))
    await clock.settle()
    assert first.is_leader and not second.is_leader
    assert second.leader is not None and second.leader.replica_id == "r0"
    await first.resign()
    await clock.settle()
    assert not first.is_leader and second.is_leader and second.epoch > 0
    assert tasks[0].done()  # resigning ends ``run``
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert not second.is_leader  # a replica that stopped running does not lead
