"""Rollouts and role changes in the simulated cluster: the orchestrator's own control steps on virtual
time, under load. No request may fail because of either; every figure is virtual."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests.unit.cluster_sim.test_cluster import NO_ADMISSION, PROFILE, poisson, run
from vllm_disagg.cluster_sim.cluster import MODEL, Cluster, ClusterSpec
from vllm_disagg.cluster_sim.control import RoleChangePlan, RolloutPlan
from vllm_disagg.config import AdmissionConfig, OrchestratorConfig
from vllm_disagg.orchestrator.planner.config import PlannerConfig

LOAD = poisson(600, 15.0, output=40)  # about 40 s of arrivals


def events(cluster: Cluster, kind: str) -> list[dict[str, Any]]:
    return [{"at_s": e.at_s, **e.fields} for e in cluster.control.events if e.kind == kind]


def test_a_rollout_moves_the_load_to_the_new_revision_and_no_request_fails() -> None:
    spec = ClusterSpec(2, 2, PROFILE, rollout=RolloutPlan(at_s=5.0, join_every_s=2.0), engine_start_s=3.0)
    cluster = run(spec, LOAD)
    rollout = cluster.control.rollouts[MODEL]
    assert (rollout.from_revision, rollout.to_revision, rollout.phase) == ("r1", "r2", "complete")
    assert sorted(rollout.drained) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    said = [(e["what"], e.get("instance")) for e in events(cluster, "rollout")]
    assert said[0] == ("started", None) and said[-1] == ("complete", None)
    drained_at = {e["instance"]: e["at_s"] for e in events(cluster, "rollout") if e["what"] == "drained"}
    # One old instance per new one ready: the first new instances join at 5 s and are ready 3 s later.
    assert min(drained_at.values()) >= 8.0
    complete_at = events(cluster, "rollout")[-1]["at_s"]
    assert all(o.ok for o in cluster.outcomes), [o.error for o in cluster.outcomes if not o.ok][:3]
    after = [o for o in cluster.outcomes if o.arrival_s > complete_at]
    assert after and all(o.decode.endswith("-r2") for o in after), "the new revision takes all the load"
    assert all(cluster.registry.get(i).admin_draining for i in drained_at)  # type: ignore[union-attr]


def test_a_rollback_brings_the_load_back_to_the_old_revision() -> None:
    plan = RolloutPlan(at_s=5.0, join_every_s=1.0, rollback_at_s=15.0)
    cluster = run(ClusterSpec(2, 2, PROFILE, rollout=plan, engine_start_s=2.0), LOAD)
    rollout = cluster.control.rollouts[MODEL]
    assert rollout.phase == "rolled_back" and rollout.drained == ()
    whats = [e["what"] for e in events(cluster, "rollout")]
    assert whats[whats.index("rolling_back") :][-1] == "rolled_back"
    back_at = events(cluster, "rollout")[-1]["at_s"]
    after = [o for o in cluster.outcomes if o.arrival_s > back_at]
    assert after and all(not o.decode.endswith("-r2") for o in after), "back on the old revision"
    assert all(o.ok for o in cluster.outcomes)


def test_a_role_change_by_restart_drains_restarts_the_engine_and_routes_to_it_once_ready() -> None:
    spec = ClusterSpec(
        1, 2, PROFILE, role_changes=(RoleChangePlan(10.0, "decode-1", "prefill"),), role_switch="restart",
        engine_start_s=4.0,
    )  # fmt: skip
    cluster = run(spec, LOAD)
    assert [(e["step"], e["at_s"] - 10.0) for e in events(cluster, "role_restart")] == [
        ("draining", pytest.approx(0.0)),
        ("restarting", pytest.approx(events(cluster, "role_restart")[1]["timeline"]["restarting"], abs=1e-3)),
        ("ready", pytest.approx(events(cluster, "role_restart")[2]["timeline"]["ready"], abs=1e-3)),
    ]
    [done] = events(cluster, "role_change")
    assert (done["outcome"], done["how"], done["by"], done["to"]) == (
        "done",
        "restart",
        "operator",
        "prefill",
    )
    steps = done["timeline"]
    assert steps["drained"] <= steps["restarting"] and steps["ready"] - steps["restarting"] >= 4.0
    assert cluster.registry.get("decode-1").info.role == "prefill"  # type: ignore[union-attr]
    assert all(o.ok for o in cluster.outcomes), "the drain let its requests finish: none failed"
    later = [o for o in cluster.outcomes if o.arrival_s > 10.0 + steps["ready"]]
    assert any(o.prefill == "decode-1" for o in later), "routed to in its new role once ready"


def test_a_role_change_by_routing_is_done_at_once() -> None:
    spec = ClusterSpec(1, 2, PROFILE, role_changes=(RoleChangePlan(10.0, "decode-1", "prefill"),))
    cluster = run(spec, LOAD)
    [done] = events(cluster, "role_change")
    assert (done["outcome"], done["how"], done["at_s"]) == ("done", "routing", 10.0)
    assert events(cluster, "role_restart") == []


def test_a_drain_that_times_out_leaves_its_streams_to_resume_elsewhere() -> None:
    long_streams = poisson(200, 10.0, output=400)
    spec = ClusterSpec(
        1, 2, PROFILE, role_switch="restart",
        # Every stream on an engine, so that the drain has streams to leave (admission would hold some).
        config=OrchestratorConfig(role_drain_timeout_s=0.5, admission=AdmissionConfig(enabled=False)),
        role_changes=(RoleChangePlan(5.0, "decode-0", "prefill"),), engine_start_s=2.0,
    )  # fmt: skip
    cluster = run(spec, long_streams)
    restarting = [e for e in events(cluster, "role_restart") if e["step"] == "restarting"]
    assert restarting and restarting[0].get("left_in_flight", 0) > 0
    assert restarting[0]["timeline"]["drained"] == pytest.approx(0.5)
    assert all(o.ok for o in cluster.outcomes) and sum(o.resumes for o in cluster.outcomes) > 0


def test_a_change_of_an_instance_already_changing_is_refused() -> None:
    plans = (RoleChangePlan(5.0, "decode-0", "prefill"), RoleChangePlan(5.5, "decode-0", "both"))
    spec = ClusterSpec(1, 2, PROFILE, role_changes=plans, role_switch="restart", engine_start_s=5.0)
    cluster = run(spec, LOAD)
    [refused] = events(cluster, "role_change_refused")
    assert (refused["instance"], refused["error"]) == ("decode-0", "a change of it is under way")


def test_the_planners_shifts_go_through_the_same_restart() -> None:
    planner = PlannerConfig(
        dry_run=False, interval_s=1.0, window_s=10.0, ttft_target_s=0.3, tpot_target_s=1.0,
        sustain=2, cooldown_s=10.0, min_samples=10,
    )  # fmt: skip
    trace = poisson(900, 30.0, prompt_blocks=60, output=4, seed=3)  # long prompts: prefill is short
    spec = ClusterSpec(
        1, 3, PROFILE, config=NO_ADMISSION, planner=planner, role_switch="restart", engine_start_s=2.0
    )
    cluster = run(spec, trace)
    changes = events(cluster, "role_change")
    assert cluster.shifts and changes
    assert all((c["by"], c["how"], c["outcome"]) == ("planner", "restart", "done") for c in changes)
    assert len(changes) == len(cluster.shifts)
    assert all(o.ok for o in cluster.outcomes)


def test_the_same_spec_gives_the_same_control_events() -> None:
    spec = ClusterSpec(
        2, 2, PROFILE, rollout=RolloutPlan(at_s=5.0), role_switch="restart",
        role_changes=(RoleChangePlan(3.0, "decode-1", "prefill"),), engine_start_s=2.0,
    )  # fmt: skip
    first, second = run(spec, LOAD), run(replace(spec), LOAD)
    assert first.control.events == second.control.events
