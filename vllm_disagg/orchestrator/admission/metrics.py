"""The admission queue's metrics (docs/metrics.md, "Admission"), on the orchestrator's registry.

Counts and waits are recorded as they happen; the queue's depth, its oldest wait and the saturated
stage are read from the queue at scrape time (``QueueCollector``), so they are never stale. Labels stay
bounded: tenants through ``classify.TenantLabels``, priorities clamped to -9..9.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_WAIT_BUCKETS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STAGES = ("prefill", "decode")


def priority_label(priority: int) -> str:
    """A priority as a label: -9..9, beyond that clamped (a client may send any integer)."""
    return str(max(-9, min(9, priority)))


class Waiting(Protocol):
    """What the collector reads of a waiting request."""

    model: str
    priority: int
    tenant: str
    arrival: float


class AdmissionMetrics:
    """Admitted, queued, shed and withdrawn counts; waits; and, at scrape time, the queue itself."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._requests = Counter(
            "vllm_disagg_admission_requests",
            "Requests through admission by outcome (queued, admitted, shed, withdrawn), the reason a "
            "shed one was refused for, and the stage that was saturated",
            ["model", "outcome", "reason", "stage", "priority", "tenant"],
            registry=registry,
        )
        self._wait = Histogram(
            "vllm_disagg_admission_wait_seconds",
            "Time admitted requests waited in the gateway's admission queue (0: admitted at once)",
            ["model", "priority", "tenant"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self._children: dict[tuple[str, ...], Any] = {}
        self._waits: dict[tuple[str, ...], Any] = {}

    def count(self, model: str, outcome: str, reason: str, stage: str, priority: int, tenant: str) -> None:
        key = (model, outcome, reason, stage, priority_label(priority), tenant)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._requests.labels(*key)
        child.inc()

    def waited(self, model: str, priority: int, tenant: str, seconds: float) -> None:
        key = (model, priority_label(priority), tenant)
        child = self._waits.get(key)
        if child is None:
            child = self._waits[key] = self._wait.labels(*key)
        child.observe(seconds)


class QueueCollector(Collector):
    """The queue as it is at scrape time: depth by model, priority and tenant; the oldest wait and
    the saturated stage by model."""

    def __init__(
        self,
        waiting: Callable[[], Iterable[Waiting]],
        blocked: Callable[[str], str],
        tenant_label: Callable[[str], str],
        now: Callable[[], float],
    ) -> None:
        self._waiting = waiting
        self._blocked = blocked
        self._tenant_label = tenant_label
        self._now = now

    def describe(self) -> list[Metric]:
        return []  # stops prometheus_client from calling collect() at registration

    def collect(self) -> Iterator[Metric]:
        now = self._now()
        depth: dict[tuple[str, str, str], int] = {}
        oldest: dict[str, float] = {}
        for t in self._waiting():
            key = (t.model, priority_label(t.priority), self._tenant_label(t.tenant))
            depth[key] = depth.get(key, 0) + 1
            oldest[t.model] = max(oldest.get(t.model, 0.0), now - t.arrival)
        depth_family = GaugeMetricFamily(
            "vllm_disagg_admission_queue_depth",
            "Requests waiting in the gateway's admission queue",
            labels=["model", "priority", "tenant"],
        )
        for key, n in sorted(depth.items()):
            depth_family.add_metric(list(key), n)
        oldest_family = GaugeMetricFamily(
            "vllm_disagg_admission_oldest_wait_seconds",
            "How long the longest-waiting request in the admission queue has waited",
            labels=["model"],
        )
        saturated = GaugeMetricFamily(
            "vllm_disagg_admission_saturated",
            "1 while the stage holds the model's admission queue back (its pair has no room)",
            labels=["model", "stage"],
        )
        for model in sorted(oldest):
            oldest_family.add_metric([model], oldest[model])
            blocked = self._blocked(model)
            for stage in STAGES:
                saturated.add_metric([model, stage], 1.0 if blocked == stage else 0.0)
        yield depth_family
        yield oldest_family
        yield saturated
