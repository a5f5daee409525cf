"""The plugin scheduler with the shipped config: profiles, decider, pinning, sampling, explanations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.errors import BadRequest, ModelNotFound, NoCapacity
from vllm_disagg.orchestrator.scheduling.config import default_config_text, load_config
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.fused import weighted_sum
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import RegistrySnapshot
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, MetricsSnapshot, Role

NOW = 1000.0
SCHEDULER = PluginScheduler()
# The shipped config where the ranked path steps aside: the sampling tests' (test_ranked.py has its).
SAMPLED_TEXT = default_config_text().replace("ranked: true", "ranked: false")


@dataclass(frozen=True)
class Inst:
    """One instance of a table row: id, role, and how it looks to the scheduler."""

    id: str
    role: Role
    model: str = "m"
    state: str = "ready"  # ready | starting | draining | dead
    in_flight: int = 0
    queue: int = 0  # engine running + waiting
    block_size: int = 16
    kv_connector: str = ""
    revision: str = ""
    kv_usage: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)


def snapshot(*instances: Inst, registry: Registry | None = None) -> RegistrySnapshot:
    reg = registry or Registry(heartbeat_timeout_s=1.0)
    for i in instances:
        reg.hello(
            i.id,
            InstanceInfo(
                url=f"http://{i.id}:8000",
                role=i.role,
                model=i.model,
                block_size=i.block_size,
                kv_connector=i.kv_connector,
                revision=i.revision,
            ),
            NOW,
        )
        engine: EngineState = "starting" if i.state == "starting" else "ready"
        reg.heartbeat(
            i.id,
            Heartbeat(
                seq=1,
                engine_state=engine,
                draining=i.state == "draining",
                metrics=MetricsSnapshot(num_running=i.queue, kv_cache_usage=i.kv_usage),
            ),
            NOW,
        )
        if i.state == "dead":
            reg.goodbye(i.id)
        for _ in range(i.in_flight):
            reg.acquire(i.id)
    return reg.snapshot()


def decide(
    snap: RegistrySnapshot,
    model: str = "m",
    request_id: str = "r1",
    *,
    cached: Mapping[str, int] | None = None,
    prompt_len: int = 10,
    pin: str | None = None,
    scheduler: PluginScheduler = SCHEDULER,
) -> Decision:
    request = SchedulingRequest(
        request_id=request_id,
        model=model,
        prompt_len=prompt_len,
        is_chat=False,
        stream=False,
        cached_tokens=cached or {},
        tokenized=cached is not None,
        pinned_prefill=pin,
    )
    return scheduler.decide(request, snap, NOW)


def explain(decision: Decision) -> dict[str, Any]:
    assert decision.explanation is not None
    return decision.explanation.to_json()


@pytest.mark.parametrize(
    ("instances", "mode", "prefill", "decode"),
    [
        pytest.param(
            [Inst("p", "prefill"), Inst("d", "decode")], "disaggregated", "p", "d", id="1p1d-disaggregates"
        ),
        pytest.param([Inst("d", "decode")], "colocated", None, "d", id="no-prefill-instance-runs-colocated"),
        pytest.param(
            [Inst("p", "prefill", state="starting"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-not-ready-runs-colocated",
        ),
        pytest.param(
            [Inst("p", "prefill", state="draining"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="draining-prefill-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", state="dead"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="dead-prefill-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", model="other"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-of-another-model-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", block_size=32), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-with-another-block-size-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", kv_connector="NixlConnector"), Inst("d", "decode")],
            "colocated",
            None,
            "d",
            id="prefill-with-another-kv-connector-is-skipped",
        ),
        pytest.param(
            [Inst("d1", "decode", in_flight=3), Inst("d2", "decode", in_flight=1)],
            "colocated",
            None,
            "d2",
            id="fewest-in-flight-decode-wins",
        ),
        pytest.param(
            [Inst("d1", "decode", in_flight=1, queue=9), Inst("d2", "decode", in_flight=1, queue=2)],
            "colocated",
            None,
            "d2",
            id="in-flight-tie-broken-by-engine-queue",
        ),
        pytest.param(
            [Inst("d1", "decode", in_flight=0, queue=20), Inst("d2", "decode", in_flight=1, queue=0)],
            "colocated",
            None,
            "d2",
            id="engine-queue-and-in-flight-add-up",
        ),
        pytest.param(
            [Inst("d1", "decode", kv_usage=0.97), Inst("d2", "decode", queue=5)],
            "colocated",
            None,
            "d2",
            id="decode-above-the-kv-usage-ceiling-is-skipped",
        ),
        pytest.param(
            [Inst("p", "prefill", revision="v2"), Inst("d", "decode", revision="v1")],
            "colocated",
            None,
            "d",
            id="prefill-of-another-revision-is-never-paired",
        ),
        pytest.param(
            [Inst("p1", "prefill", in_flight=2), Inst("p2", "prefill"), Inst("d", "decode")],
            "disaggregated",
            "p2",
            "d",
            id="fewest-in-flight-prefill-wins",
        ),
        pytest.param(
            [Inst("b", "both", in_flight=1), Inst("d", "decode")],
            "disaggregated",
            "b",
            "d",
            id="role-both-can-prefill",
        ),
        pytest.param(
            [Inst("b", "both")], "colocated", None, "b", id="one-both-instance-never-prefills-for-itself"
        ),
        pytest.param(
            [Inst("p", "prefill"), Inst("d", "decode", state="draining"), Inst("b", "both", in_flight=5)],
            "disaggregated",
            "p",
            "b",
            id="role-both-decodes-when-decode-drains",
        ),
        pytest.param(
            [Inst("p", "prefill"), Inst("d", "decode", model="other"), Inst("d2", "decode")],
            "disaggregated",
            "p",
            "d2",
            id="decode-of-another-model-is-skipped",
        ),
    ],
)
def test_decisions(instances: list[Inst], mode: str, prefill: str | None, decode: str) -> None:
    decision = decide(snapshot(*instances))
    assert (decision.mode, decision.prefill, decision.decode) == (mode, prefill, decode)


@pytest.mark.parametrize(
    ("instances", "error"),
    [
        pytest.param([], ModelNotFound, id="no-instances-at-all-is-unknown-model"),
        pytest.param(
            [Inst("d", "decode", model="other")], ModelNotFound, id="only-other-models-is-unknown-model"
        ),
        pytest.param([Inst("d", "decode", state="dead")], NoCapacity, id="only-dead-decode-is-no-capacity"),
        pytest.param(
            [Inst("d", "decode", state="draining")], NoCapacity, id="only-draining-decode-is-no-capacity"
        ),
        pytest.param(
            [Inst("d", "decode", state="starting")], NoCapacity, id="only-starting-decode-is-no-capacity"
        ),
        pytest.param([Inst("p", "prefill")], NoCapacity, id="prefill-only-cluster-is-no-capacity"),
    ],
)
def test_errors(instances: list[Inst], error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        decide(snapshot(*instances))
    assert "'m'" in str(info.value), "the message names the model"


def test_ties_spread_over_equal_instances_by_request_id() -> None:
    snap = snapshot(*(Inst(f"d{i}", "decode") for i in range(4)))
    picks = Counter(decide(snap, request_id=f"req-{n}").decode for n in range(400))
    assert set(picks) == {"d0", "d1", "d2", "d3"}
    assert min(picks.values()) > 50, picks


def test_the_same_request_gets_the_same_decision() -> None:
    snap = snapshot(
        *(Inst(f"d{i}", "decode") for i in range(4)), Inst("p1", "prefill"), Inst("p2", "prefill")
    )
    assert (
        len(
            {
                (decide(snap, request_id="same").decode, decide(snap, request_id="same").prefill)
                for _ in range(10)
            }
        )
        == 1
    )


def test_explanation_lists_candidates_with_each_plugins_score_and_the_pick() -> None:
    snap = snapshot(
        Inst("p", "prefill", in_flight=2), Inst("d", "decode", queue=4), Inst("x", "decode", state="draining")
    )
    exp = explain(decide(snap))
    assert exp["scheduler"] == "plugins"
    decode = exp["decode"]
    assert decode["pick"] == "d"
    (row,) = decode["candidates"]
    assert row["id"] == "d"
    assert set(row["scores"]) == {"queue-scorer", "kv-usage-scorer", "tpot-scorer", "prefix-scorer"}
    assert row["scores"]["queue-scorer"] < 1.0, "4 requests in the engine lower the queue score"
    assert row["total"] == pytest.approx(sum(row["scores"].values()), abs=1e-5), "all weights are 1"
    assert {"id": "x", "filter": "ready-filter"} in decode["filtered"]
    assert exp["prefill"]["pick"] == "p"
    assert exp["decider"]["mode"] == "disaggregated"


def test_colocated_explanation_says_why() -> None:
    exp = explain(decide(snapshot(Inst("d", "decode"))))
    assert exp["decider"]["mode"] == "colocated"
    assert "no prefill instance is ready" in exp["decider"]["reason"]


def test_prefill_goes_to_the_instance_holding_the_longest_prefix() -> None:
    snap = snapshot(
        Inst("p1", "prefill"), Inst("p2", "prefill", in_flight=1), Inst("p3", "prefill"), Inst("d", "decode")
    )
    decision = decide(snap, cached={"p2": 480, "p3": 64}, prompt_len=512)
    assert decision.prefill == "p2", "most of the prompt cached outweighs one request in flight"
    scores = {r["id"]: r["scores"]["prefix-scorer"] for r in explain(decision)["prefill"]["candidates"]}
    assert scores == {"p1": 0.0, "p2": pytest.approx(480 / 512), "p3": pytest.approx(64 / 512)}


def test_a_busy_prefix_holder_loses_to_idle_instances() -> None:
    snap = snapshot(Inst("p1", "prefill"), Inst("p2", "prefill", in_flight=30, queue=10), Inst("d", "decode"))
    assert decide(snap, cached={"p2": 32}, prompt_len=512).prefill == "p1"


@pytest.mark.parametrize(
    ("pin", "expected_prefill"),
    [
        pytest.param("p2", "p2", id="by-agent-id"),
        pytest.param("http://p2:8000", "p2", id="by-engine-url"),
        pytest.param("http://p2:8000/", "p2", id="by-engine-url-with-slash"),
        pytest.param("p2:8000", "p2", id="by-host-port"),
    ],
)
def test_a_client_may_pin_the_prefill_instance(pin: str, expected_prefill: str) -> None:
    snap = snapshot(Inst("p1", "prefill"), Inst("p2", "prefill", in_flight=9), Inst("d", "decode"))
    decision = decide(snap, pin=pin)
    assert (decision.mode, decision.prefill, decision.decode) == ("disaggregated", expected_prefill, "d")
    assert explain(decision)["pinned_prefill"] == "p2"


def test_pinning_picks_a_decode_instance_compatible_with_the_pinned_prefill() -> None:
    snap = snapshot(
        Inst("p", "prefill", revision="v2"),
        Inst("d1", "decode", revision="v1"),
        Inst("d2", "decode", revision="v2", queue=9),
    )
    assert decide(snap, pin="p").decode == "d2"


@pytest.mark.parametrize(
    ("instances", "pin", "reason"),
    [
        pytest.param([Inst("d", "decode")], "nope", "'nope' is not registered", id="unknown-id"),
        pytest.param([Inst("d", "decode")], "http://10.9.9.9:1", "is not registered", id="unknown-url"),
        pytest.param(
            [Inst("p", "prefill", model="o"), Inst("d", "decode")], "p", "serves model 'o'", id="other-model"
        ),
        pytest.param(
            [Inst("p", "decode"), Inst("d", "decode")],
            "p",
            "role 'decode' and cannot prefill",
            id="decode-role",
        ),
        pytest.param(
            [Inst("p", "prefill", state="draining"), Inst("d", "decode")], "p", "is draining", id="draining"
        ),
        pytest.param([Inst("p", "prefill", state="dead"), Inst("d", "decode")], "p", "is dead", id="dead"),
        pytest.param(
            [Inst("p", "prefill", block_size=32), Inst("d", "decode")],
            "p",
            "no ready decode instance can exchange KV",
            id="no-compatible-decode",
        ),
    ],
)
def test_an_unusable_pin_is_a_bad_request_with_the_reason(
    instances: list[Inst], pin: str, reason: str
) -> None:
    with pytest.raises(BadRequest) as info:
        decide(snapshot(*instances), pin=pin)
    assert info.value.status == 400
    assert reason in str(info.value)
    assert info.value.param == "prefill_endpoint"


def test_many_candidates_are_sampled_but_the_prefix_holder_is_always_scored() -> None:
    config = load_config(SAMPLED_TEXT.replace("maxCandidates: 16", "maxCandidates: 8"), "test")
    scheduler = PluginScheduler(config)
    snap = snapshot(*(Inst(f"p{i:03}", "prefill") for i in range(200)), Inst("d", "decode"))
    picks = Counter[str | None]()
    for n in range(50):
        decision = decide(snap, request_id=f"r{n}", cached={"p123": 320}, prompt_len=400, scheduler=scheduler)
        prefill = explain(decision)["prefill"]
        assert prefill["sampled"] is True and len(prefill["candidates"]) == 8
        assert prefill["eligible"] == 200
        picks[decision.prefill] += 1
    assert picks == {"p123": 50}


_SAMPLING = {
    k: PluginScheduler(load_config(SAMPLED_TEXT.replace("maxCandidates: 16", f"maxCandidates: {k}"), "t"))
    for k in (4, 8)
}


@settings(max_examples=100, deadline=None)
@given(st.integers(10, 30), st.sampled_from([4, 8]), st.data())
def test_sampled_candidates_are_the_longest_prefixes_then_a_window_of_the_rest(
    n: int, k: int, data: st.DataObject
) -> None:
    # Holders are dense here, so the window often starts on one: it is then skipped, never doubled.
    held = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=k))
    cached = {f"p{i:02}": 16 * data.draw(st.integers(1, 20)) for i in held}
    snap = snapshot(*(Inst(f"p{i:02}", "prefill") for i in range(n)), Inst("d", "decode"))
    request_id = data.draw(st.text(min_size=1, max_size=8))
    decision = decide(snap, request_id=request_id, cached=cached, prompt_len=400, scheduler=_SAMPLING[k])
    ids = [row["id"] for row in explain(decision)["prefill"]["candidates"]]
    holders = set(sorted(cached, key=cached.__getitem__, reverse=True)[: k // 2])  # stable: ties in order
    assert len(ids) == len(set(ids)) == k and holders <= set(ids)
    eligible = [f"p{i:02}" for i in range(n)]
    rest = set(ids) - holders
    windows = [
        [i for i in (eligible + eligible)[start : start + k] if i not in holders] for start in range(n)
    ]
    assert any(rest == set(w[: k - len(holders)]) for w in windows), rest


def test_sampling_spreads_load_across_all_eligible_instances() -> None:
    config = load_config(SAMPLED_TEXT.replace("maxCandidates: 16", "maxCandidates: 4"), "test")
    scheduler = PluginScheduler(config)
    snap = snapshot(*(Inst(f"d{i:02}", "decode") for i in range(40)))
    seen = {decide(snap, request_id=f"r{n}", scheduler=scheduler).decode for n in range(400)}
    assert len(seen) >= 30, "a request-seeded window reaches (nearly) every instance"


def test_a_drain_takes_effect_on_the_next_snapshot_despite_the_filter_memo() -> None:
    registry = Registry(heartbeat_timeout_s=1.0)
    snap = snapshot(Inst("d1", "decode"), Inst("d2", "decode", queue=3), registry=registry)
    assert decide(snap).decode == "d1"
    registry.set_admin_drain("d1", True)
    assert decide(registry.snapshot()).decode == "d2"


def test_the_decider_colocates_when_the_decode_instance_holds_almost_all_the_prompt() -> None:
    text = default_config_text().replace("threshold: 0 ", "threshold: 64 ")
    scheduler = PluginScheduler(load_config(text, "test"))
    snap = snapshot(Inst("p", "prefill"), Inst("d", "decode"))
    colocated = decide(snap, cached={"d": 480}, prompt_len=500, scheduler=scheduler)
    assert (colocated.mode, colocated.prefill) == ("colocated", None)
    assert "20 uncached" in explain(colocated)["decider"]["reason"]
    assert decide(snap, cached={"d": 256}, prompt_len=500, scheduler=scheduler).mode == "disaggregated"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["prefill", "decode", "both"]),
            st.sampled_from(["rev-a", "rev-b"]),
            st.sampled_from([16, 32]),
            st.sampled_from(["NixlConnector", "P2pNcclConnector"]),
            st.sampled_from(["ready", "draining", "starting"]),
            st.integers(min_value=0, max_value=3),
        ),
        min_size=1,
        max_size=12,
    ),
    st.text(min_size=1, max_size=8),
)
def test_a_prefill_and_a_decode_instance_that_cannot_exchange_kv_are_never_paired(
    rows: list[tuple[Role, str, int, str, str, int]], request_id: str
) -> None:
    instances = [
        Inst(f"i{n}", role, revision=rev, block_size=bs, kv_connector=conn, state=state, in_flight=load)
        for n, (role, rev, bs, conn, state, load) in enumerate(rows)
    ]
    snap = snapshot(*instances)
    try:
        decision = decide(snap, request_id=request_id)
    except NoCapacity:
        assert not any(i.state == "ready" and i.role != "prefill" for i in instances)
        return
    d = snap.by_id[decision.decode].info
    assert d.role != "prefill" and snap.by_id[decision.decode].state == "ready"
    if decision.prefill is None:
        # Colocated only when no ready prefill-capable instance other than D could take the KV.
        assert not any(
            i.state == "ready"
            and i.role != "decode"
            and i.id != decision.decode
            and (i.revision, i.block_size, i.kv_connector) == (d.revision, d.block_size, d.kv_connector)
            for i in instances
        )
        return
    p = snap.by_id[decision.prefill].info
    assert decision.prefill != decision.decode
    assert (p.model, p.revision, p.block_size, p.kv_connector) == (
        d.model,
        d.revision,
        d.block_size,
        d.kv_connector,
    )


def test_memoized_filters_still_score_with_the_newest_metrics() -> None:
    registry = Registry(heartbeat_timeout_s=1.0)
    snap = snapshot(Inst("d1", "decode"), Inst("d2", "decode", queue=3), registry=registry)
    assert decide(snap).decode == "d1"
    busy = Heartbeat(seq=2, engine_state="ready", metrics=MetricsSnapshot(num_running=20))
    registry.heartbeat("d1", busy, NOW)
    fresh = registry.snapshot()
    assert fresh.membership == snap.membership, "only metrics changed: the filter memo is reused"
    assert decide(fresh).decode == "d2"


def _request(exclude: frozenset[str] = frozenset(), request_id: str = "r1") -> SchedulingRequest:
    return SchedulingRequest(request_id, "m", 10, False, False, exclude=exclude)


@pytest.mark.parametrize(
    ("exclude", "decode"),
    [
        pytest.param(frozenset(), {"d1", "d2"}, id="nothing-excluded-either-decode"),
        pytest.param(frozenset({"d1"}), {"d2"}, id="a-failed-decode-is-never-picked-again"),
    ],
)
def test_instances_that_failed_a_request_are_excluded_from_its_retries(
    exclude: frozenset[str], decode: set[str]
) -> None:
    snap = snapshot(Inst("p1", "prefill"), Inst("p2", "prefill"), Inst("d1", "decode"), Inst("d2", "decode"))
    picks = {SCHEDULER.decide(_request(exclude, f"r{n}"), snap, NOW).decode for n in range(40)}
    assert picks == decode
    retry = SCHEDULER.pick_prefill(_request(frozenset({"p1"})), snap, NOW, "d2")
    assert retry == "p2", "a prefill retry never lands on the instance that failed"
    assert SCHEDULER.pick_prefill(_request(frozenset({"p1", "p2"})), snap, NOW, "d2") is None
    explained = explain(SCHEDULER.decide(_request(frozenset({"d1"})), snap, NOW))
    assert {"id": "d1", "filter": "excluded"} in explained["decode"]["filtered"]


def test_a_decode_retry_keeps_kv_compatibility_with_the_prefill_instance() -> None:
    snap = snapshot(
        Inst("p", "prefill", kv_connector="Nixl"),
        Inst("d-other", "decode", kv_connector="Other"),
        Inst("d-nixl", "decode", kv_connector="Nixl"),
        Inst("d-failed", "decode", kv_connector="Nixl"),
    )
    request = _request(frozenset({"d-failed"}))
    assert SCHEDULER.pick_decode(request, snap, NOW, "p") == "d-nixl"
    only_other = _request(frozenset({"d-failed", "d-nixl"}))
    assert SCHEDULER.pick_decode(only_other, snap, NOW, "p") is None, "no D can take p's KV"
    assert SCHEDULER.pick_decode(only_other, snap, NOW, None) == "d-other", "colocated: any decode"


def test_a_pairing_whose_link_breaker_is_open_is_not_made() -> None:
    registry = Registry(heartbeat_timeout_s=1.0)
    snap = snapshot(Inst("p1", "prefill"), Inst("p2", "prefill"), Inst("d", "decode"), registry=registry)
    for _ in range(3):  # d answered, but could not use p1's KV
        registry.leg_failed("d", NOW, partner="p1", instance_fault=False)
    snap = registry.snapshot()
    assert {decide(snap, request_id=f"r{n}").prefill for n in range(40)} == {"p2"}
    assert registry.get("d") is not None and registry.get("d").state == "ready"  # type: ignore[union-attr]
    registry.leg_failed("d", NOW, partner="p2", instance_fault=False)  # one failure: still usable
    assert {decide(registry.snapshot(), request_id=f"r{n}").prefill for n in range(10)} == {"p2"}


def test_new_weights_change_the_very_next_decision_and_its_explanation() -> None:
    scheduler = PluginScheduler()
    snap = snapshot(
        Inst("p", "prefill"), Inst("queued", "decode", queue=8), Inst("full", "decode", queue=0, kv_usage=0.9)
    )
    assert decide(snap, scheduler=scheduler).decode == "queued", "by default a full KV cache weighs more"
    scheduler.update_weights({"decode": {"kv-usage-scorer": 0.0, "queue-scorer": 5.0}})
    decision = decide(snap, scheduler=scheduler)
    assert decision.decode == "full", "now the queue decides"
    scores = {r["id"]: r for r in explain(decision)["decode"]["candidates"]}["full"]["scores"]
    total = {r["id"]: r for r in explain(decision)["decode"]["candidates"]}["full"]["total"]
    expected = 5 * scores["queue-scorer"] + scores["tpot-scorer"] + scores["prefix-scorer"]
    assert total == pytest.approx(expected, abs=1e-5)
    assert scheduler.weights()["decode"] == {
        "queue-scorer": 5.0, "kv-usage-scorer": 0.0, "tpot-scorer": 1.0, "prefix-scorer": 1.0,
        "topology-scorer": 0.0,
    }  # fmt: skip


SCORE = st.floats(min_value=0.0, max_value=1.0)
WEIGHT = st.sampled_from([0.0, 1.0, 2.0, 0.5]) | st.floats(min_value=-10.0, max_value=10.0)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.lists(WEIGHT, max_size=6), st.integers(min_value=0, max_value=20))
def test_a_profiles_weighted_totals_are_the_weighted_scores_added_in_order(
    data: st.DataObject, weights: list[float], n: int
) -> None:
    columns = [data.draw(st.lists(SCORE, min_size=n, max_size=n)) for _ in weights]
    expected = [0.0] * n
    for weight, column in zip(weights, columns, strict=True):
        if weight:  # as a scorer of weight 0 is never counted
            expected = [total + weight * score for total, score in zip(expected, column, strict=True)]
    got = weighted_sum(weights)(columns, n)
    assert [x.hex() for x in got] == [x.hex() for x in expected], "bit-identical, not merely close"
