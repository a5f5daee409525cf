"""An agent's whole KV data plane, started and stopped as one: the node's pool, the local link its
engine's connector uses, the agent-to-agent transfers, and the reports of the pool's contents."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.agent.kv.arena import Capacity
from vllm_disagg.agent.kv.disk import disk_bytes
from vllm_disagg.agent.kv.hit_rate import WindowedRate
from vllm_disagg.agent.kv.local import local_endpoint
from vllm_disagg.agent.kv.node import DiskConfig, PoolNode
from vllm_disagg.agent.kv.pool import BlockKey
from vllm_disagg.agent.kv.report import changed_events, pool_snapshot
from vllm_disagg.agent.kv.service import PoolService
from vllm_disagg.agent.kv.transfer import KvTransfer
from vllm_disagg.agent.kv_forwarder import KvEventForwarder
from vllm_disagg.agent.vllm_command import kv_pool_port
from vllm_disagg.config import AgentConfig
from vllm_disagg.protocol.curve import load_keypair
from vllm_disagg.protocol.messages import MEDIUM_DISK, MEDIUM_POOL, MetricsSnapshot


@dataclass
class KvPool:
    node: PoolNode
    service: PoolService
    transfer: KvTransfer
    hit_rate: WindowedRate  # of the engine's asks, over the agent's metrics window

    @classmethod
    async def start(cls, cfg: AgentConfig) -> KvPool:
        """Open the local link and the transfer port; the pool itself opens when the engine says its
        KV geometry."""

        disk = (
            DiskConfig(Path(cfg.kv_disk_dir), disk_bytes(cfg.kv_disk_capacity)) if cfg.kv_disk_dir else None
        )
        node = PoolNode(f"vllm-disagg-pool-{cfg.agent_id}", Capacity.parse(cfg.kv_pool_capacity), disk=disk)
        service = PoolService(node)
        await service.start(local_endpoint(cfg.agent_id))
        keys = load_keypair(cfg.curve_secret_key_file) if cfg.curve_secret_key_file else None
        transfer = KvTransfer(node, host=cfg.engine_host, port=kv_pool_port(cfg), keys=keys)
        await transfer.start()
        return cls(node, service, transfer, WindowedRate(cfg.metrics_window_s, time.monotonic))

    def report_to(self, forwarder: KvEventForwarder) -> None:
        """Send the pool's changes with the engine's KV events, and its whole state at each resync."""

        def changed(stored: list[BlockKey], removed: list[BlockKey], medium: str = MEDIUM_POOL) -> None:
            events = changed_events(self.node, stored, removed, medium)
            if events:
                forwarder.forward(events)

        self.node.listeners.append(changed)
        self.node.disk_listeners.append(lambda stored, removed: changed(stored, removed, MEDIUM_DISK))
        forwarder.snapshots.append(lambda: pool_snapshot(self.node))

    def metrics(self, scraped: Callable[[], MetricsSnapshot]) -> Callable[[], MetricsSnapshot]:
        """The heartbeat's metrics: the scraped engine's, with the KV this pool fetched from others' and
        the share of the engine's asks it held."""

        def metrics() -> MetricsSnapshot:
            rate = self.hit_rate.rate(self.service.asked, self.service.found)
            return dataclasses.replace(scraped(), kv_in_links=self.transfer.received(), kv_pool_hit_rate=rate)

        return metrics

    async def close(self) -> None:
        await self.transfer.close()
        await self.service.close()  # and the pool: its shared memory goes with it
