"""The agent's KV pool as its heartbeat sees it: the scraped metrics, with what the pool fetched in."""

from __future__ import annotations

import pytest

from vllm_disagg.agent.kv.agent_pool import KvPool
from vllm_disagg.agent.kv.arena import Capacity
from vllm_disagg.agent.kv.hit_rate import WindowedRate
from vllm_disagg.agent.kv.node import PoolNode
from vllm_disagg.agent.kv.service import PoolService
from vllm_disagg.agent.kv.transfer import KvTransfer
from vllm_disagg.protocol.messages import KvLinkCount, MetricsSnapshot


def test_the_heartbeat_metrics_are_the_scraped_ones_with_the_pools_links_at_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node = PoolNode("unused", Capacity(1, "blocks"))
    pool = KvPool(node, PoolService(node), KvTransfer(node), WindowedRate(10.0, lambda: 0.0))
    links: list[KvLinkCount] = []
    monkeypatch.setattr(pool.transfer, "received", lambda: list(links))
    scraped = MetricsSnapshot(num_running=3, kv_in_bytes=10.0, kv_in_seconds=0.5)
    metrics = pool.metrics(lambda: scraped)

    assert metrics() == scraped, "nothing fetched yet"
    links.append(KvLinkCount("tcp://10.0.0.1:7000", nbytes=4096, seconds=0.01, transfers=1))
    assert metrics().kv_in_links == links, "read anew for each heartbeat"
    assert (metrics().num_running, metrics().kv_in_bytes) == (3, 10.0)


def test_the_heartbeat_says_the_share_of_the_engines_asks_the_pool_held_over_the_window() -> None:
    node = PoolNode("unused", Capacity(1, "blocks"))
    now = [0.0]
    service = PoolService(node)
    pool = KvPool(node, service, KvTransfer(node), WindowedRate(10.0, lambda: now[0]))
    metrics = pool.metrics(MetricsSnapshot)
    assert metrics().kv_pool_hit_rate is None  # nothing asked yet
    service.asked, service.found = 8, 6
    now[0] = 1.0
    assert metrics().kv_pool_hit_rate == 0.75
    now[0] = 12.0  # the first asks leave the window
    service.asked, service.found = 12, 6
    assert metrics().kv_pool_hit_rate == 0.0  # of the 4 asked since 1.0, none held
    now[0] = 30.0
    assert metrics().kv_pool_hit_rate is None  # nothing asked in the last 10 s


def test_a_window_whose_counters_start_over_reports_nothing_until_asked_again() -> None:
    now = [0.0]
    rate = WindowedRate(10.0, lambda: now[0])
    assert rate.rate(100, 90) is None
    now[0] = 1.0
    assert rate.rate(4, 4) is None  # a new pool service: its counts are not less than before
    now[0] = 2.0
    assert rate.rate(8, 6) == 0.5
