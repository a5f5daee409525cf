"""The ranked path: the flat scheduler's best totals (and so its pick) from a few candidates, as the
cluster changes between decisions; and where it steps aside for the sampled path."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduling_support import METRICS
from vllm_disagg.orchestrator.scheduling.config import default_config
from vllm_disagg.orchestrator.scheduling.explain import ProfileTrace
from vllm_disagg.orchestrator.scheduling.framework import ProfileContext, ProfileName, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.ranked import Rankings
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.link_table import LinkTable
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, Role

SHIPPED = default_config()
FLAT = PluginScheduler(
    dataclasses.replace(
        SHIPPED,
        ranked=False,
        shards=None,
        profiles={n: dataclasses.replace(p, max_candidates=1 << 30) for n, p in SHIPPED.profiles.items()},
    )
)
# Where links are known, the transfer pairing pairs among the 4 best D's and P's: the ranked path then
# finds the 4 best totals; without links, the best.
LINKS = LinkTable(
    typical=MappingProxyType({"any": 8 / 25e9}), bytes_per_token=MappingProxyType({"m": 131072.0})
)
# What an instance reports between decisions: mostly ready; leaving the ready state moves membership.
STATES: tuple[EngineState, ...] = ("ready", "ready", "unhealthy", "starting")


def _cluster(n: int) -> tuple[Registry, list[str]]:
    registry = Registry(heartbeat_timeout_s=1e9)
    ids: list[str] = []
    for i in range(n):
        _join(registry, ids, i)
    return registry, ids


def _join(registry: Registry, ids: list[str], i: int) -> None:
    role: Role = "prefill" if i % 2 else "decode"
    agent_id = f"{role}-{i:02}"
    registry.hello(agent_id, InstanceInfo(url=f"http://h{i}:8000", role=role, model="m"), 0.0)
    registry.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready"), 0.0)
    ids.append(agent_id)


def _best(trace: ProfileTrace, width: int) -> tuple[list[str], set[str]]:
    """The ``width`` best totals (as bits) and who has the best one."""
    totals = sorted(trace.totals, reverse=True)
    top = totals[0] if totals else None
    best = {c.agent_id for c, t in zip(trace.candidates, trace.totals, strict=True) if t == top}
    return [t.hex() for t in totals[:width]], best


def _decode_trace(
    scheduler: PluginScheduler, request: SchedulingRequest, snap: RegistrySnapshot
) -> dict[str, Any]:
    explanation = scheduler.decide(request, snap, 0.0).explanation
    assert explanation is not None
    shown = explanation.to_json()["decode"]
    assert isinstance(shown, dict)
    return shown


@settings(max_examples=60, deadline=None)
@given(st.integers(36, 60), st.data())
def test_the_ranked_profiles_find_what_scoring_every_instance_finds(n: int, data: st.DataObject) -> None:
    registry, ids = _cluster(n)
    if data.draw(st.booleans(), label="links known"):
        registry._use_links(LINKS)  # as learned (until a report brings the registry's own table)
    ranked = PluginScheduler(SHIPPED)
    seq = 1
    for step in range(data.draw(st.integers(1, 8), label="decisions")):
        # Between decisions: some instances report new metrics (some leave the ready state, some come
        # back: membership moves), new ones join, requests start on some and end on others (whose
        # bounds then rise: a ranking that missed it would rank them too low).
        for agent_id in data.draw(
            st.lists(st.sampled_from(ids), max_size=n if step == 0 else 4), label="reports"
        ):
            seq += 1
            state: EngineState = data.draw(st.sampled_from(STATES), label="state")
            registry.heartbeat(
                agent_id, Heartbeat(seq=seq, engine_state=state, metrics=data.draw(METRICS)), 0.0
            )
        for _ in range(data.draw(st.integers(0, 2), label="joined")):
            _join(registry, ids, len(ids))
        for agent_id in data.draw(st.lists(st.sampled_from(ids), max_size=12), label="started"):
            registry.acquire(agent_id)
        flying = sorted(registry.snapshot().in_flight)
        if flying:
            for agent_id in data.draw(
                st.lists(st.sampled_from(flying), max_size=12, unique=True), label="ended"
            ):
                registry.release(agent_id)
        snap = registry.snapshot()
        held = data.draw(st.lists(st.sampled_from(ids), max_size=6, unique=True), label="holders")
        cached = {a: 16 * data.draw(st.integers(0, 40)) for a in held}
        exclude = frozenset(data.draw(st.lists(st.sampled_from(ids), max_size=3), label="failed"))
        request = SchedulingRequest(
            f"r{step}", "m", data.draw(st.integers(0, 700)), False, True, cached, True, exclude=exclude
        )
        population = snap.model_ids["m"]
        width = 4 if snap.links.links or snap.links.typical else 1
        partner = snap.by_id[data.draw(st.sampled_from([i for i in ids if i.startswith("decode")]))]
        sides: tuple[tuple[ProfileName, InstanceView | None], ...] = (("decode", None), ("prefill", partner))
        for profile, with_partner in sides:
            ctx = ProfileContext(request, snap, 0.0, profile, with_partner)
            mine = ranked._profiles[profile].run(ctx, population, exclude)
            flat = FLAT._profiles[profile].run(ctx, population, exclude)
            assert mine.ranked or mine.eligible <= 16, "past maxCandidates it serves"
            assert not mine.sampled
            assert _best(mine, width) == _best(flat, width), f"decision {step}, {profile} profile"
            assert len(mine.candidates) <= len(flat.candidates)


def test_a_request_with_a_target_is_sampled_the_slo_filter_judges_candidates_together() -> None:
    registry, _ = _cluster(40)
    snap = registry.snapshot()
    scheduler = PluginScheduler(SHIPPED)
    plain = SchedulingRequest("r1", "m", 100, False, True)
    with_target = dataclasses.replace(plain, request_id="r2", slo_ttft_s=0.5)
    traces = [_decode_trace(scheduler, r, snap) for r in (plain, with_target)]
    assert (traces[0].get("ranked"), traces[0]["sampled"]) == (True, False)
    assert (traces[1].get("ranked"), traces[1]["sampled"]) == (None, True)


def test_an_older_snapshot_than_the_ranking_follows_is_sampled() -> None:
    registry, ids = _cluster(40)
    old = registry.snapshot()
    registry.acquire(ids[0])
    scheduler = PluginScheduler(SHIPPED)
    request = SchedulingRequest("r1", "m", 100, False, True)
    assert _decode_trace(scheduler, request, registry.snapshot())["ranked"]
    again = _decode_trace(scheduler, request, old)
    assert (again.get("ranked"), again["sampled"]) == (None, True), "a ranking never goes back in time"


def test_a_ranking_follows_who_left_and_joined_its_eligible_instances_without_a_rebuild() -> None:
    registry, ids = _cluster(20)
    rankings = Rankings(lambda agent_id, metrics, flying: float(int(agent_id[-2:]) + flying))
    first = rankings.follow(registry.snapshot(), "m", ids[:10], frozenset(ids[:10]))
    assert first is not None
    registry.acquire(ids[12])  # a change of its own: one the log notes
    # Members move without a note of theirs (a static filter may judge one by the others).
    later = rankings.follow(registry.snapshot(), "m", ids[5:], frozenset(ids[5:]))
    assert later is first, "followed, not built again"
    ranked = [agent_id for _, agent_id in later.best_first()]
    assert sorted(ranked) == sorted(ids[5:])
    assert later.bound(ids[12]) == 13.0
