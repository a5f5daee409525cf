"""The agent's KV pool as its heartbeat sees it: the scraped metrics, with what the pool fetched in."""

from __future__ import annotations

import pytest

from vllm_disagg.agent.kv.agent_pool import KvPool
from vllm_disagg.agent.kv.arena import Capacity
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.service import PoolService
from vllm_disagg.agent.kv.transfer import KvTransfer
from vllm_disagg.protocol.messages import KvLinkCount, MetricsSnapshot


def test_the_heartbeat_metrics_are_the_scraped_ones_with_the_pools_links_at_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = PoolNode("unused", Capacity(1, "blocks"))
    pool = KvPool(node, PoolService(node), KvTransfer(node))
    links: list[KvLinkCount] = []
    monkeypatch.setattr(pool.transfer, "received", lambda: list(links))
    scraped = MetricsSnapshot(num_running=3, kv_in_bytes=10.0, kv_in_seconds=0.5)
    metrics = pool.metrics(lambda: scraped)

    assert metrics() == scraped, "nothing fetched yet"
    links.append(KvLinkCount("tcp://10.0.0.1:7000", nbytes=4096, seconds=0.01, transfers=1))
    assert metrics().kv_in_links == links, "read anew for each heartbeat"
    assert (metrics().num_running, metrics().kv_in_bytes) == (3, 10.0)
