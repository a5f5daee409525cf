"""Replicas of one orchestrator on a real etcd, for these tests: the fixtures, and what waits on them.

Every replica runs in the test's process on real sockets; a scripted agent holds a session with each
replica, as a real agent does (docs/agent.md), so every replica knows the same instances.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.etcd_support import EtcdServer, running_etcd
from tests.helpers import eventually
from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config
from vllm_disagg.config import ReplicaConfig
from vllm_disagg.orchestrator.app import CONTROL_KEY, REPLICATION_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import InstanceInfo

Replicas = Callable[..., Awaitable[list[OrchestratorServer]]]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd server of one member (fails, not skips, when the binary is missing)."""
    yield from running_etcd(tmp_path / "etcd")


@pytest.fixture
async def replicas(etcd: EtcdServer) -> AsyncIterator[Replicas]:
    started: list[OrchestratorServer] = []

    async def start(n: int = 3, **overrides: Any) -> list[OrchestratorServer]:
        """``n`` replicas of cluster "test"; the list is the fixture's own: a test that closes one
        removes it, and the rest are closed at the end."""
        for i in range(n):
            replica = ReplicaConfig(etcd=(etcd.url,), cluster="test", replica_id=f"r{i}", lease_ttl_s=2)
            started.append(
                await start_orchestrator(orch_config(replica=replica, **overrides), shutdown_timeout_s=1.0)
            )
        return started

    try:
        yield start
    finally:
        for server in started:
            await server.close()


def leaders(servers: list[OrchestratorServer]) -> list[OrchestratorServer]:
    return [s for s in servers if s.app[CONTROL_KEY].leadership.is_leader]


async def one_leader(servers: list[OrchestratorServer]) -> OrchestratorServer:
    """The one replica that leads, once every replica agrees on it and sees every other."""

    def agreed() -> OrchestratorServer | None:
        leading = leaders(servers)
        if len(leading) != 1:
            return None
        leader_id = leading[0].app[REPLICATION_KEY].replica_id
        views = [s.app[CONTROL_KEY].leadership.view.leader_id for s in servers]
        members = [len(s.app[REPLICATION_KEY].cards()) for s in servers]
        agreed = views == [leader_id] * len(servers) and members == [len(servers)] * len(servers)
        return leading[0] if agreed else None

    return await eventually(agreed, timeout=30, what="one leader every replica knows")


class Session(FakeAgent):
    """One of an agent's sessions (one per replica): the drain flag is the agent's, shared by all of
    them, as in a real agent (``agent/shared.py``)."""

    def __init__(self, *args: Any, shared: dict[str, bool], **kwargs: Any) -> None:
        self._shared = shared
        super().__init__(*args, **kwargs)

    @property
    def draining(self) -> bool:
        return self._shared["draining"]

    @draining.setter
    def draining(self, value: bool) -> None:
        self._shared["draining"] = value


async def join_everywhere(
    servers: list[OrchestratorServer], agent_id: str, url: str, revision: str = ""
) -> list[FakeAgent]:
    """A decode instance's agent sessions, one per replica (as a real agent holds them), each ready."""
    info = InstanceInfo(url=url, role="decode", model=MODEL, engine="sim", revision=revision)
    shared = {"draining": False}
    agents: list[FakeAgent] = [
        Session(s.zmq_endpoint, agent_id, url, "decode", info=info, shared=shared) for s in servers
    ]
    for agent in agents:
        await agent.join()

    def ready() -> bool:
        return all((v := s.registry.get(agent_id)) is not None and v.state == "ready" for s in servers)

    await eventually(ready, what=f"{agent_id} ready on every replica")
    return agents
