"""The cluster fixture of this folder: built per test, everything it started killed afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.replicas.cluster import ReplicaCluster
from tests.etcd_support import EtcdMissing


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[ReplicaCluster]:
    """Three replicas on a real etcd, three agents with simulated engines; ready (one leader agreed,
    every instance ready on every replica)."""
    try:
        running = ReplicaCluster(tmp_path)
    except EtcdMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        await running.start()
        yield running
    finally:
        running.close()
