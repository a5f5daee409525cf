"""Fixtures for the etcd layer's tests: a real etcd server per test, and clients of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from tests.etcd_support import EtcdServer, running_etcd
from vllm_disagg.etcd.client import EtcdClient

ClientFactory = Callable[..., EtcdClient]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd member on free loopback ports, its data under the test's tmp dir; killed at the end."""
    yield from running_etcd(tmp_path / "etcd")


@pytest.fixture
async def etcd_client(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    """A client of ``etcd``."""
    client = EtcdClient([etcd.url])
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def make_client(etcd: EtcdServer) -> AsyncIterator[ClientFactory]:
    """More clients (one per replica, as in production): ``make_client()`` for ``etcd``, or with given
    endpoints and options; all closed at the end."""
    made: list[EtcdClient] = []

    def make(endpoints: list[str] | None = None, **kwargs: float) -> EtcdClient:
        client = EtcdClient(endpoints or [etcd.url], **kwargs)
        made.append(client)
        return client

    try:
        yield make
    finally:
        for client in made:
            await client.close()
