"""The registry learns P→D links from the gateway's sends and D's heartbeats (``link_rates``), and its
snapshots carry what it learned."""

from __future__ import annotations

import pytest

from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role

GB = 1e9


def joined(*instances: tuple[str, Role]) -> Registry:
    reg = Registry(heartbeat_timeout_s=60.0)
    for agent_id, role in instances:
        reg.hello(agent_id, InstanceInfo(url="http://127.0.0.1:9", role=role, model="m"), 0.0)
        reg.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready"), 0.0)
    return reg


def beat(reg: Registry, agent_id: str, seq: int, nbytes: float, seconds: float, now: float) -> None:
    metrics = MetricsSnapshot(scraped_at=now, kv_in_bytes=nbytes, kv_in_seconds=seconds)
    reg.heartbeat(agent_id, Heartbeat(seq=seq, engine_state="ready", metrics=metrics), now)


def test_a_send_and_d_s_next_heartbeat_teach_the_snapshot_the_link() -> None:
    reg = joined(("p0", "prefill"), ("d0", "decode"))
    beat(reg, "d0", 2, 0.0, 0.0, 1.0)  # the counters' baseline
    before = reg.snapshot()
    assert not before.links.links and before.links.transfer_s("p0", "d0", "other", "m", 10) is None
    reg.kv_sent("p0", "d0", 1000, 1.5)
    beat(reg, "d0", 3, 2 * GB, 0.2, 2.0)
    snap = reg.snapshot()
    assert snap.version > before.version
    assert snap.links.links[("p0", "d0")].s_per_byte == pytest.approx(1e-10)
    assert snap.links.transfer_s("p0", "d0", "other", "m", 1000) == pytest.approx(0.2)
    assert snap.links is reg.link_rates.table()


def test_a_link_goes_when_an_instance_leaves_and_after_forget_s_unmeasured() -> None:
    reg = joined(("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    beat(reg, "d0", 2, 0.0, 0.0, 1.0)
    reg.kv_sent("p0", "d0", 1000, 1.0)
    reg.kv_sent("p1", "d0", 1000, 1.0)
    beat(reg, "d0", 3, 2 * GB, 0.2, 2.0)
    assert set(reg.snapshot().links.links) == {("p0", "d0"), ("p1", "d0")}
    reg.goodbye("p1")
    assert set(reg.snapshot().links.links) == {("p0", "d0")}
    reg.tick(2.0 + reg.link_rates.forget_s + 1)
    snap = reg.snapshot()
    assert not snap.links.links, "unmeasured too long: priced at its tier's rate, and so probed"
    assert snap.links.typical, "the typical rates stay"
