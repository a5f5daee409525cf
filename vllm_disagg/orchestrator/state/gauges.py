"""The registry's instances as Prometheus gauges, read from a snapshot at scrape time (nothing stored).

``OrchestratorMetrics`` (``orchestrator/metrics.py``) exports them beside the gateway's metrics; every
gauge is documented in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from vllm_disagg.orchestrator.state.compat import IncompatiblePairs
from vllm_disagg.orchestrator.state.link_rates import gbps
from vllm_disagg.orchestrator.state.registry import RegistrySnapshot

_BREAKER_VALUE = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class InstanceCollector(Collector):
    """Per-instance gauges, read from the registry at scrape time."""

    def __init__(
        self,
        snapshot: Callable[[], RegistrySnapshot],
        kv_blocks: Callable[[str], int] | None,
        pool_blocks: Callable[[str], int] | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._kv_blocks = kv_blocks
        self._pool_blocks = pool_blocks
        self._pairs = IncompatiblePairs()  # recounted when the membership changes, not per scrape

    def describe(self) -> list[Metric]:
        # Empty: stops prometheus_client from calling collect() at registration.
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        up = GaugeMetricFamily(
            "vllm_disagg_instance_up",
            "1 while the instance has a live session (state is not dead), labelled with its state",
            labels=["instance", "role", "state"],
        )
        in_flight = _gauge("in_flight", "Gateway requests outstanding on the instance")
        breaker = _gauge("breaker_state", "The instance's circuit breaker: 0 closed, 1 half-open, 2 open")
        running = _gauge("num_running", "Requests running in the engine (last heartbeat)")
        waiting = _gauge("num_waiting", "Requests waiting in the engine's queue (last heartbeat)")
        kv = _gauge("kv_cache_usage", "Engine KV cache usage, 0..1 (last heartbeat)")
        ttft = _gauge("ttft_seconds", "Engine mean time to first token over the agent's window")
        tpot = _gauge("tpot_seconds", "Engine mean time per output token over the agent's window")
        blocks = GaugeMetricFamily(
            "vllm_disagg_kv_index_blocks",
            "Blocks of the instance's prefix cache the orchestrator's KV index holds",
            labels=["instance"],
        )
        pool = GaugeMetricFamily(
            "vllm_disagg_kv_pool_index_blocks",
            "Blocks of the instance's agent's KV pool the orchestrator's KV index holds (vllm-disagg)",
            labels=["instance"],
        )
        for v in snap.instances:
            labels = [v.agent_id]
            if self._pool_blocks is not None and v.info.kv_pool_endpoint:
                pool.add_metric(labels, float(self._pool_blocks(v.agent_id)))
            up.add_metric([v.agent_id, v.info.role, v.state], 0.0 if v.state == "dead" else 1.0)
            breaker.add_metric(labels, _BREAKER_VALUE[v.breaker.state])
            in_flight.add_metric(labels, float(snap.in_flight.get(v.agent_id, 0)))
            m = v.metrics
            running.add_metric(labels, float(m.num_running))
            waiting.add_metric(labels, float(m.num_waiting))
            kv.add_metric(labels, m.kv_cache_usage)
            if m.ttft_s is not None:
                ttft.add_metric(labels, m.ttft_s)
            if m.tpot_s is not None:
                tpot.add_metric(labels, m.tpot_s)
            if self._kv_blocks is not None:
                blocks.add_metric(labels, float(self._kv_blocks(v.agent_id)))
        incompatible = GaugeMetricFamily(
            "vllm_disagg_kv_incompatible_pairs",
            "(prefill, decode) pairs of live instances of a model that cannot exchange KV, by reason",
            labels=["model", "reason"],
        )
        for (model, reason), n in sorted(self._pairs.counts(snap).items()):
            incompatible.add_metric([model, reason], float(n))
        yield from (up, in_flight, breaker, running, waiting, kv, ttft, tpot, incompatible, *_links(snap))
        if self._kv_blocks is not None:
            yield blocks
        if self._pool_blocks is not None:
            yield pool


def _links(snap: RegistrySnapshot) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """The P->D links: breakers open, and what each measured one delivers (a forgotten link's series
    goes with it)."""
    blocked = GaugeMetricFamily(
        "vllm_disagg_link_breaker_open",
        "1 for each P->D link whose circuit breaker lets no request through",
        labels=["prefill", "decode"],
    )
    for p, d in sorted(snap.blocked_links):
        blocked.add_metric([p, d], 1.0)
    rates = GaugeMetricFamily(
        "vllm_disagg_kv_link_gbps",
        "Learned KV transfer rate of the P->D link, gigabits per second (measured links only)",
        labels=["prefill", "decode"],
    )
    for (p, d), est in sorted(snap.links.links.items()):
        rates.add_metric([p, d], gbps(est.s_per_byte))
    return blocked, rates


def _gauge(suffix: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"vllm_disagg_instance_{suffix}", doc, labels=["instance"])
