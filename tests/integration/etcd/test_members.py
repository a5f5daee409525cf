"""Replica membership on a real etcd: members appear, leave, vanish with their lease, and come back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from tests.etcd_support import EtcdServer
from tests.helpers import eventually
from tests.integration.etcd.conftest import ClientFactory
from vllm_disagg import jsonutil
from vllm_disagg.clock import SystemClock
from vllm_disagg.etcd.client import EtcdClient
from vllm_disagg.etcd.members import Member, Members

PREFIX = "/vllm-disagg/test/members/"
WAIT_S = 30.0  # generous: a loaded 2-core machine, and leases that must expire first


def url_of(replica_id: str) -> bytes:
    return jsonutil.dumps({"url": f"http://{replica_id}"})


class Group:
    """Members under one prefix, each with its own client, and a flag their callbacks set."""

    def __init__(self, make_client: ClientFactory, count: int, ttl_s: int) -> None:
        self.members = {
            f"r{i}": Members(
                make_client(), PREFIX, f"r{i}", url_of(f"r{i}"), ttl_s=ttl_s, clock=SystemClock()
            )
            for i in range(count)
        }
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.changed = asyncio.Event()
        for members in self.members.values():
            members.watch(self.changed.set)

    def start(self) -> None:
        for replica_id, members in self.members.items():
            self.tasks[replica_id] = asyncio.create_task(members.run())

    async def crash(self, replica_id: str) -> None:
        """Cancel its task without leaving: its key stays until its lease goes."""
        task = self.tasks.pop(replica_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def until_all_see(self, expected: set[str], *, among: set[str] | None = None) -> None:
        """Wait, on the change callbacks, until every running member's view is exactly ``expected``."""
        viewers = [self.members[r] for r in (among or set(self.tasks))]

        def agreed() -> bool:
            return all(set(m.members()) == expected for m in viewers)

        async with asyncio.timeout(WAIT_S):
            while not agreed():
                self.changed.clear()
                await self.changed.wait()

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


@pytest.fixture
async def group(make_client: ClientFactory) -> AsyncIterator[Callable[[int, int], Group]]:
    made: list[Group] = []

    def make(count: int, ttl_s: int) -> Group:
        made.append(Group(make_client, count, ttl_s))
        return made[-1]

    try:
        yield make
    finally:
        for one in made:
            await one.stop()


async def test_three_members_appear_in_every_view(group: Callable[[int, int], Group]) -> None:
    members = group(3, 5)
    members.start()
    await members.until_all_see({"r0", "r1", "r2"})
    assert members.members["r1"].members()["r2"] == Member("r2", url_of("r2"))
    assert all(m.etcd_ok for m in members.members.values())


async def test_a_member_that_leaves_is_gone_at_once(
    group: Callable[[int, int], Group], etcd_client: EtcdClient
) -> None:
    members = group(3, 30)  # a TTL far longer than the test: leaving must not wait for it
    members.start()
    await members.until_all_see({"r0", "r1", "r2"})
    await members.members["r2"].leave()
    await members.tasks.pop("r2")  # its run ends
    await members.until_all_see({"r0", "r1"})
    assert await etcd_client.get(PREFIX + "r2") is None
    assert "r2" not in members.members["r2"].members()


async def test_a_killed_member_is_gone_when_its_lease_is(
    group: Callable[[int, int], Group], etcd_client: EtcdClient
) -> None:
    members = group(3, 30)
    members.start()
    await members.until_all_see({"r0", "r1", "r2"})
    await members.crash("r1")
    kv = await etcd_client.get(PREFIX + "r1")
    assert kv is not None and kv.lease != 0  # it stays while its lease lives
    await etcd_client.revoke(kv.lease)  # as its expiry would, sooner
    await members.until_all_see({"r0", "r2"})


async def test_a_member_whose_lease_was_lost_puts_its_key_back(
    group: Callable[[int, int], Group], etcd_client: EtcdClient
) -> None:
    members = group(2, 30)
    members.start()
    await members.until_all_see({"r0", "r1"})
    before = await etcd_client.get(PREFIX + "r0")
    assert before is not None
    await etcd_client.revoke(before.lease)

    async def back() -> bool:
        after = await etcd_client.get(PREFIX + "r0")
        return after is not None and after.lease not in (0, before.lease)

    await eventually(back, timeout=WAIT_S, what="r0's key back on a new lease")
    await members.until_all_see({"r0", "r1"})


async def test_a_deleted_member_key_is_put_back(
    group: Callable[[int, int], Group], etcd_client: EtcdClient
) -> None:
    members = group(2, 30)
    members.start()
    await members.until_all_see({"r0", "r1"})
    assert await etcd_client.delete(PREFIX + "r0") == 1

    async def back() -> bool:
        # The views may not have seen the delete yet, so they alone cannot say the key was put back.
        return await etcd_client.get(PREFIX + "r0") is not None

    await eventually(back, timeout=WAIT_S, what="r0's key put back")
    await members.until_all_see({"r0", "r1"})


async def test_the_view_resyncs_after_etcd_restarts(
    etcd: EtcdServer, group: Callable[[int, int], Group]
) -> None:
    members = group(2, 3)
    members.start()
    await members.until_all_see({"r0", "r1"})
    await members.crash("r1")
    etcd.kill()
    await members.until_all_see({"r0", "r1"})  # as last seen, while etcd is down
    await etcd.restart_async()
    await members.until_all_see({"r0"})  # r1's lease expires after the restart; the watch is new
    assert members.members["r0"].etcd_ok
