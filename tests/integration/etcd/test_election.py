"""Leader election on a real etcd: one leader at a time, epochs that only grow, a fast handover on
resignation, a slow one (the lease's expiry) on a crash, and a leader that steps down before its lease
can expire when etcd stops answering.

Every test samples, on every change callback of every replica, which replicas say they lead: never two.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from tests.etcd_support import EtcdServer
from tests.integration.etcd.conftest import ClientFactory
from vllm_disagg import jsonutil
from vllm_disagg.clock import SystemClock
from vllm_disagg.etcd.client import EtcdClient
from vllm_disagg.etcd.election import Election, decode_claim
from vllm_disagg.etcd.lease import step_down_margin

KEY = "/vllm-disagg/test/leader"
WAIT_S = 30.0  # generous: a loaded 2-core machine, and leases that must expire first


@dataclass
class StepDown:
    """A replica stopped leading: when (monotonic), its lease's earliest expiry then, and its epoch."""

    replica_id: str
    at: float
    lease_deadline: float
    epoch: int


class Replicas:
    """Elections on one key, each with its own client, and what their change callbacks saw."""

    def __init__(self, make_client: ClientFactory, count: int, ttl_s: int) -> None:
        self.ttl_s = ttl_s
        self.elections = {
            f"r{i}": Election(
                make_client(),
                KEY,
                f"r{i}",
                jsonutil.dumps({"url": f"http://r{i}"}),
                ttl_s=ttl_s,
                clock=SystemClock(),
            )
            for i in range(count)
        }
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.overlaps: list[list[str]] = []  # more than one leader at one sample: must stay empty
        self.step_downs: list[StepDown] = []
        self.took_over: dict[int, float] = {}  # epoch -> when its leader first said it leads
        self._leading: dict[str, int] = {}
        self.changed = asyncio.Event()
        for replica_id, election in self.elections.items():
            election.watch(functools.partial(self._sample, replica_id))

    def _sample(self, replica_id: str) -> None:
        now = time.monotonic()
        leaders = sorted(r for r, e in self.elections.items() if e.is_leader)
        if len(leaders) > 1:
            self.overlaps.append(leaders)
        election = self.elections[replica_id]
        was = self._leading.get(replica_id, 0)
        if was and not election.is_leader:
            self.step_downs.append(StepDown(replica_id, now, election.lease_deadline(), was))
            self._leading[replica_id] = 0
        elif election.is_leader and not was:
            self._leading[replica_id] = election.epoch
            self.took_over.setdefault(election.epoch, now)
        self.changed.set()

    def start(self, *replica_ids: str) -> None:
        for replica_id in replica_ids or tuple(self.elections):
            self.tasks[replica_id] = asyncio.create_task(self.elections[replica_id].run())

    async def crash(self, replica_id: str) -> None:
        """Cancel its task without resigning: what SIGKILL leaves in etcd (the key, until it expires)."""
        task = self.tasks.pop(replica_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def leaders(self) -> list[Election]:
        return [e for e in self.elections.values() if e.is_leader]

    async def until(self, condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
        """Wait, on the replicas' change callbacks, until ``condition()`` holds."""
        async with asyncio.timeout(timeout):
            while not condition():
                self.changed.clear()
                await self.changed.wait()
        assert condition(), what

    async def one_leader(self, *, above: int = 0) -> Election:
        """Wait until exactly one replica leads with an epoch above ``above``, and every running replica
        sees it as the leader; that one."""

        def settled() -> bool:
            leaders = self.leaders()
            if len(leaders) != 1 or leaders[0].epoch <= above:
                return False
            epoch = leaders[0].epoch
            running = [self.elections[r] for r, task in self.tasks.items() if not task.done()]
            return all(e.leader is not None and e.leader.epoch == epoch for e in running)

        await self.until(settled, f"one leader above epoch {above}")
        return self.leaders()[0]

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


@pytest.fixture
async def replicas(make_client: ClientFactory) -> AsyncIterator[Callable[[int, int], Replicas]]:
    made: list[Replicas] = []

    def make(count: int, ttl_s: int) -> Replicas:
        made.append(Replicas(make_client, count, ttl_s))
        return made[-1]

    try:
        yield make
    finally:
        for group in made:
            await group.stop()
        assert all(not group.overlaps for group in made), [group.overlaps for group in made]


async def test_exactly_one_leads_and_every_replica_sees_it(replicas: Callable[[int, int], Replicas]) -> None:
    group = replicas(3, 5)
    group.start()
    leader = await group.one_leader()
    seen = {
        e.leader and (e.leader.replica_id, e.leader.epoch, e.leader.value) for e in group.elections.values()
    }
    assert len(seen) == 1  # ``since`` is when each replica saw the term begin
    info = leader.leader
    assert info is not None and info.epoch == leader.epoch
    assert group.elections[info.replica_id] is leader
    assert jsonutil.loads(info.value) == {"url": f"http://{info.replica_id}"}
    assert all(e.etcd_ok for e in group.elections.values())
    assert sum(e.epoch != 0 for e in group.elections.values()) == 1


async def test_resigning_hands_over_at_once_with_a_larger_epoch(
    replicas: Callable[[int, int], Replicas],
) -> None:
    group = replicas(3, 30)  # a TTL far longer than any handover below may take
    group.start()
    epochs = []
    leader = await group.one_leader()
    for _ in range(2):
        epochs.append(leader.epoch)
        resigned_at = time.monotonic()
        await leader.resign()
        assert not leader.is_leader and leader.epoch == 0
        leader = await group.one_leader(above=epochs[-1])
        assert time.monotonic() - resigned_at < group.ttl_s / 2  # not the lease's expiry
    epochs.append(leader.epoch)
    assert epochs == sorted(set(epochs))
    assert [s.epoch for s in group.step_downs] == epochs[:2]


async def test_a_crashed_leader_is_replaced_only_after_its_lease_expired(
    replicas: Callable[[int, int], Replicas], etcd_client: EtcdClient
) -> None:
    group = replicas(3, 3)
    group.start()
    old = await group.one_leader()
    old_id = next(r for r, e in group.elections.items() if e is old)
    expires_at = old.lease_deadline()
    await group.crash(old_id)
    still = await etcd_client.get(KEY)
    assert still is not None and decode_claim(still.value)[0] == old_id  # the key outlives its owner
    new = await group.one_leader(above=still.create_revision)
    assert group.took_over[new.epoch] >= expires_at  # etcd cannot expire the lease before this


async def test_a_leader_cut_off_from_etcd_steps_down_before_its_lease_can_expire(
    etcd: EtcdServer, replicas: Callable[[int, int], Replicas]
) -> None:
    group = replicas(3, 3)
    group.start()
    old = await group.one_leader()
    old_epoch = old.epoch
    etcd.pause()
    try:
        # Waited for as its watchers heard it: ``is_leader`` reads False from the step-down time on,
        # before the timer's task has run and told anyone (as late as a loaded machine makes it).
        await group.until(lambda: bool(group.step_downs), "the leader stepped down")
    finally:
        etcd.resume()
    assert not old.is_leader
    (down,) = group.step_downs
    assert down.epoch == old_epoch
    assert down.at < down.lease_deadline  # the heart of it: before etcd could expire the lease
    assert down.at >= down.lease_deadline - step_down_margin(group.ttl_s) - 0.05  # and not for nothing
    new = await group.one_leader(above=old_epoch)
    assert new.epoch > old_epoch


async def test_a_deleted_leader_key_means_a_new_term(
    replicas: Callable[[int, int], Replicas], etcd_client: EtcdClient
) -> None:
    group = replicas(2, 5)
    group.start()
    old = await group.one_leader()
    old_epoch = old.epoch
    assert await etcd_client.delete(KEY) == 1  # an operator's hand, or a bug elsewhere
    new = await group.one_leader(above=old_epoch)
    assert [s.epoch for s in group.step_downs] == [old_epoch]
    assert new.epoch > old_epoch


async def test_a_lone_replica_leads_again_after_etcd_restarts(
    etcd: EtcdServer, replicas: Callable[[int, int], Replicas]
) -> None:
    group = replicas(1, 3)
    group.start()
    old = await group.one_leader()
    old_epoch = old.epoch
    etcd.kill()
    await group.until(lambda: not old.is_leader and not old.etcd_ok, "the leader stepped down")
    await etcd.restart_async()
    new = await group.one_leader(above=old_epoch)
    assert new is old and new.epoch > old_epoch
