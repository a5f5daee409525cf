"""Gateway workers' state, without processes: a worker's registry replica fed by the hub's ``State``
messages, what it forwards, the hub applying what workers forward, and metrics merged by worker."""

from __future__ import annotations

import dataclasses
import pickle
from types import MappingProxyType
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import parse_prometheus
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.gateway.records import RequestLog
from vllm_disagg.orchestrator.gateway.workers.hub import JournaledKvIndex, WorkerHub
from vllm_disagg.orchestrator.gateway.workers.messages import Call, Counts, State, dump, load
from vllm_disagg.orchestrator.gateway.workers.replica import RegistryReplica
from vllm_disagg.orchestrator.gateway.workers.worker import Worker
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state.event_log import EventLog
from vllm_disagg.orchestrator.state.health import BreakerPolicy
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, KvEvent, MetricsSnapshot, Role

NOW = 100.0


def registry_with(*instances: tuple[str, Role]) -> Registry:
    reg = Registry(heartbeat_timeout_s=5.0, breaker=BreakerPolicy(failures_to_open=1, open_s=1.0))
    for n, (agent_id, role) in enumerate(instances):
        reg.hello(agent_id, InstanceInfo(url=f"http://127.0.0.1:{9000 + n}", role=role, model="m"), NOW)
        reg.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready"), NOW)
    return reg


def hub_for(reg: Registry, kv: JournaledKvIndex | None = None) -> WorkerHub:
    config = OrchestratorConfig(port=0, gateway_workers=2)
    return WorkerHub(config, reg, kv or JournaledKvIndex(), EventLog(lambda: 0.0))


def test_a_replica_fed_the_hubs_states_sees_what_the_registry_sees() -> None:
    reg = registry_with(("p0", "prefill"), ("d0", "decode"))
    hub = hub_for(reg)
    replica = RegistryReplica(1, lambda call: None)
    full = load(dump(hub._state(full=True)))  # as it crosses the link
    assert isinstance(full, State)
    joined = replica.apply(full)
    assert [v.agent_id for v in joined] == ["p0", "d0"]
    first = replica.snapshot()
    assert first.prefill_ids == {"m": ("p0",)} and first.decode_ids == {"m": ("d0",)}

    hub._sent_views = dict(reg.snapshot().by_id)  # what a flush records as sent
    reg.heartbeat("d0", Heartbeat(seq=2, engine_state="unhealthy"), NOW)
    reg.hello("d1", InstanceInfo(url="http://127.0.0.1:9100", role="decode", model="m"), NOW)
    reg.heartbeat("d1", Heartbeat(seq=1, engine_state="ready"), NOW)
    delta = hub._state(full=False)
    assert set(delta.views) == {"d0", "d1"}, "only the views that changed travel"
    crossed = load(dump(delta))
    assert isinstance(crossed, State)
    assert [v.agent_id for v in replica.apply(crossed)] == ["d1"]
    now = replica.snapshot()
    assert now.decode_ids == reg.snapshot().decode_ids == {"m": ("d1",)}
    assert dict(now.by_id) == dict(reg.snapshot().by_id)
    assert first.decode_ids == {"m": ("d0",)} and first.by_id["d0"].state == "ready", "old snapshots keep"


def test_a_replica_counts_its_own_requests_exactly_and_the_others_as_last_told() -> None:
    replica = RegistryReplica(2, lambda call: None)
    base = State(True, 0, {}, (), 1, 1, frozenset(), frozenset(), {})
    replica.apply(dataclasses.replace(base, in_flight={0: {"d0": 3}, 1: {"d0": 1, "d1": 2}, 2: {"d0": 99}}))
    replica.acquire("d0")
    replica.acquire("d0")
    snap = replica.snapshot()
    # Its own count is its own (99 was its stale report, coming back): 3 + 1 from the others, 2 its own.
    assert (snap.in_flight_of("d0"), snap.in_flight_of("d1")) == (6, 2)
    replica.release("d0")
    assert replica.snapshot().in_flight_of("d0") == 5
    assert replica.take_counts() == ({"d0": 1}, {"d0": 2})
    assert replica.take_counts() == ({"d0": 1}, {}), "sent counts are told once"


def test_a_replica_forwards_what_changes_state_and_keys_audited_legs_itself() -> None:
    reg = registry_with(("d0", "decode"), ("d1", "decode"))
    calls: list[Call] = []
    replica = RegistryReplica(1, calls.append)
    state = hub_for(reg)._state(full=True)
    replica.apply(dataclasses.replace(state, audited=frozenset({"d1"})))
    assert replica.audit_dispatch("d0", "r1", "p0", 100, NOW) is None, "d0's legs are not audited"
    key = replica.audit_dispatch("d1", "r1", "p0", 100, NOW)
    other = RegistryReplica(2, calls.append)
    other.apply(dataclasses.replace(state, audited=frozenset({"d1"})))
    assert key is not None and key >= 1 << 48
    assert key != other.audit_dispatch("d1", "r2", "p0", 100, NOW), "two workers never share a key"
    replica.audit_done("d1", key, NOW + 1, answered=True)
    replica.leg_failed("d0", NOW, "p0", instance_fault=False)
    replica.leg_succeeded("d1", "p0")
    assert calls == [
        Call("audit_dispatch", ("d1", "r1", "p0", 100, NOW, key)),
        Call("audit_dispatch", ("d1", "r2", "p0", 100, NOW, calls[1].args[5])),
        Call("audit_done", ("d1", key, NOW + 1), {"answered": True}),
        Call("leg_failed", ("d0", NOW, "p0"), {"instance_fault": False}),
        Call("leg_succeeded", ("d1", "p0")),
    ]


def test_the_hub_applies_forwarded_calls_to_the_registry_and_refuses_any_other() -> None:
    reg = registry_with(("d0", "decode"))
    hub = hub_for(reg)
    hub._handle(b"w1", Call("leg_failed", ("d0", NOW, None), {"instance_fault": True}))
    view = reg.get("d0")
    assert view is not None and view.breaker.state == "open", "the worker's failed leg opened the breaker"
    hub._handle(b"w1", Call("goodbye", ("d0", "not a worker's business")))
    assert reg.is_live("d0"), "only breaker, probe and audit calls are taken"


def test_a_half_open_breakers_probe_from_a_worker_is_the_registrys_probe() -> None:
    reg = registry_with(("d0", "decode"))
    reg.leg_failed("d0", NOW)  # open for 1 s
    reg.expire(NOW + 1.5)  # past the open period: half-open
    view = reg.get("d0")
    assert view is not None and view.breaker.state == "half_open"
    hub = hub_for(reg)
    calls: list[Call] = []
    replica = RegistryReplica(1, calls.append)
    replica.apply(hub._state(full=True))
    replica.acquire("d0")
    for call in calls:
        hub._handle(b"w1", call)
    assert reg.get("d0").breaker.probing  # type: ignore[union-attr]
    replica.release("d0")
    for call in calls[1:]:
        hub._handle(b"w1", call)
    assert [c.name for c in calls] == ["probe_sent", "probe_ended"]
    assert not reg.get("d0").breaker.probing  # type: ignore[union-attr]


def test_worker_counts_reach_the_registrys_snapshot_and_sent_totals() -> None:
    reg = registry_with(("d0", "decode"))
    hub = hub_for(reg)
    hub._workers[1] = hub_worker(1)
    reg.acquire("d0")
    hub._handle(b"w1", Counts(1, {"d0": 4}, {"d0": 5}))
    assert reg.snapshot().in_flight_of("d0") == 5 and reg.requests_total("d0") == 6
    hub._handle(b"w1", Counts(1, {}, {}))
    assert reg.snapshot().in_flight_of("d0") == 1


def hub_worker(index: int) -> Any:
    from vllm_disagg.orchestrator.gateway.workers import hub as hub_module

    class _Done:
        pid = 0

        def poll(self) -> int:
            return 0

    return hub_module._Worker(index, _Done())  # type: ignore[arg-type]


def test_the_kv_index_journal_replays_into_a_workers_index_and_a_joiner_gets_the_whole_index() -> None:
    kv = JournaledKvIndex()
    reg = registry_with(("p0", "prefill"))
    hub = hub_for(reg, kv)
    tokens = list(range(64))
    kv.apply("p0", [KvEvent("stored", [1, 2], None, tokens[:32], 16)])
    joiner = pickle.loads(pickle.dumps(kv.plain()))
    assert not hasattr(joiner, "journal") and joiner.cached_tokens(tokens) == {"p0": 32}
    kv.apply("p0", [KvEvent("stored", [3], 2, tokens[32:48], 16)])
    kv.drop("p0")
    delta = hub._state(full=False)
    assert [(kind, agent) for kind, agent, _ in delta.kv] == [
        ("apply", "p0"),
        ("apply", "p0"),
        ("drop", "p0"),
    ]
    assert kv.journal == [], "each write travels once"


def test_metrics_of_every_gateway_process_merge_into_one_family_each_labelled_by_worker() -> None:
    reg = registry_with(("d0", "decode"))
    ours, theirs = OrchestratorMetrics(reg.snapshot), OrchestratorMetrics(reg.snapshot, instances=False)
    ours.request_done("completions", "disaggregated", 200, 0.1, 0.09, 0.01, 0.02)
    for _ in range(2):
        theirs.request_done("completions", "disaggregated", 200, 0.1, 0.09, 0.01, 0.02)
    text = ours.render([(1, pickle.loads(pickle.dumps(theirs.families())))]).decode()
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), "one family per name"
    samples = parse_prometheus(text)
    key = "vllm_disagg_requests_total"
    by_worker = {dict(labels)["worker"]: v for (name, labels), v in samples.items() if name == key}
    assert by_worker == {"0": 1.0, "1": 2.0}
    up = [labels for (name, labels), _ in samples.items() if name == "vllm_disagg_instance_up"]
    assert up and all("worker" not in dict(labels) for labels in up), "instance gauges are the registry's"


def test_weights_changed_through_the_admin_api_travel_with_the_next_state_once() -> None:
    reg = registry_with(("d0", "decode"))
    weights = {"decode": {"queue-scorer": 1.0}}
    config = OrchestratorConfig(port=0, gateway_workers=2)
    hub = WorkerHub(config, reg, JournaledKvIndex(), EventLog(lambda: 0.0), lambda: weights)
    assert hub._state(full=True).weights == weights, "a joining worker gets them"
    assert hub._state(full=False).weights == weights
    assert hub._state(full=False).weights is None, "unchanged: not sent again"
    weights = {"decode": {"queue-scorer": 3.0}}
    assert hub._state(full=False).weights == {"decode": {"queue-scorer": 3.0}}


def test_read_only_mappings_in_records_and_views_cross_the_link_as_read_only_mappings() -> None:
    sent = {"timeline": MappingProxyType({"scheduled": 0.001}), "nested": [MappingProxyType({})]}
    got = load(dump(sent))
    assert got == {"timeline": {"scheduled": 0.001}, "nested": [{}]}
    assert isinstance(got, dict) and isinstance(got["timeline"], MappingProxyType)


def test_a_lost_state_message_makes_the_worker_ask_once_for_the_whole_state() -> None:
    replica = RegistryReplica(1, lambda call: None)
    delta = State(False, 0, {}, (), 1, 1, frozenset(), frozenset(), {})
    full = dataclasses.replace(delta, full=True, seq=5)
    assert replica.in_order(dataclasses.replace(delta, seq=1)) == "skip", "nothing before the whole state"
    assert replica.in_order(full) == "apply"
    assert [replica.in_order(dataclasses.replace(delta, seq=n)) for n in (6, 7, 9, 10, 11)] == [
        "apply", "apply", "gap", "skip", "skip",
    ]  # fmt: skip
    assert replica.in_order(dataclasses.replace(full, seq=11)) == "apply"
    assert replica.in_order(dataclasses.replace(delta, seq=12)) == "apply"


def test_a_kv_audit_note_for_a_record_kept_elsewhere_is_passed_on() -> None:
    log = RequestLog(10)
    passed: list[tuple[str, str]] = []
    log.note_elsewhere = lambda request_id, note: passed.append((request_id, note))
    log.note_kv_check("served-by-a-worker", "decode instance 'd0' computed 128 tokens it was handed")
    assert passed == [("served-by-a-worker", "decode instance 'd0' computed 128 tokens it was handed")]


@pytest.mark.parametrize("link", ["tcp://127.0.0.1:5000", "inproc://link", ""])
def test_a_worker_takes_its_pickled_link_only_over_a_local_ipc_socket(link: str) -> None:
    """The link's frames are pickles: never on a socket that could leave the host."""
    with pytest.raises(ValueError, match="must be an ipc:// socket"):
        Worker(link, 1)


def test_a_workers_kv_send_reaches_the_registry_and_the_learned_links_come_back() -> None:
    reg = registry_with(("p0", "prefill"), ("d0", "decode"))
    hub = hub_for(reg)
    calls: list[Call] = []
    replica = RegistryReplica(1, calls.append)
    replica.apply(load(dump(hub._state(full=True))))  # type: ignore[arg-type]
    hub._sent_views = dict(reg.snapshot().by_id)
    counters = MetricsSnapshot(scraped_at=1.0, kv_in_bytes=0.0, kv_in_seconds=0.0)
    reg.heartbeat("d0", Heartbeat(seq=2, engine_state="ready", metrics=counters), NOW)
    replica.kv_sent("p0", "d0", 1000, NOW)
    assert calls == [Call("kv_sent", ("p0", "d0", 1000, NOW))]
    hub._handle(b"w1", calls[0])
    counters = MetricsSnapshot(scraped_at=2.0, kv_in_bytes=1e9, kv_in_seconds=0.1)
    reg.heartbeat("d0", Heartbeat(seq=3, engine_state="ready", metrics=counters), NOW + 1)
    assert ("p0", "d0") in reg.snapshot().links.links
    delta = load(dump(hub._state(full=False)))
    assert isinstance(delta, State) and delta.links is not None
    replica.apply(delta)
    assert replica.snapshot().links.links == reg.snapshot().links.links
    assert hub._state(full=False).links is None, "an unchanged table does not travel again"
