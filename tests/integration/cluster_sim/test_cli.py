"""``vllm-disagg sim`` in-process on tiny traces: the JSON, the comparison table and its plots, a file
trace scaled to a rate, and flags that cannot work exiting 2 with a message that says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_disagg import jsonutil
from vllm_disagg.cli.commands import main
from vllm_disagg.cluster_sim.mooncake import dump_mooncake
from vllm_disagg.cluster_sim.policies import POLICIES
from vllm_disagg.cluster_sim.traces import SYNTHETIC
from vllm_disagg.orchestrator.admission.policy import SHED_REASONS

SMALL = ["sim", "--synthetic", "prefix", "--prefill", "2", "--decode", "2", "--requests", "200"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*SMALL, *argv, "--json"]) == 0
    doc: dict[str, Any] = jsonutil.loads(capsys.readouterr().out)
    return doc


def test_json_reports_goodput_attainment_and_latencies_of_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--rate", "20", "--policy", "ours")
    [run] = doc["runs"]
    assert (run["policy"], run["rate"], run["requests"], run["failed"]) == ("ours", 20.0, 200, 0)
    assert 0 < run["goodput"] <= 200 / run["duration_s"]
    assert run["goodput"] == pytest.approx(run["met"] / run["duration_s"])
    assert run["attainment"] == pytest.approx(run["met"] / 200)
    assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["p99"]
    assert 0 < run["tpot_ms"]["p50"] <= run["tpot_ms"]["p90"] <= run["tpot_ms"]["p99"]
    assert 0 < run["prefix_hit_rate"] < 1  # documents are shared: some prompt tokens are cache hits
    assert run["events"] > 0 and run["wall_s"] >= 0
    assert (run["shifts"], run["retries"], run["resumes"], run["fallbacks"]) == (0, 0, 0, 0)
    assert sum(1 for _ in run["attainment_over_time"]) > 1
    assert doc["cluster"] == {"prefill": 2, "decode": 2, "profile": "h100-llama3-8b"}
    assert doc["traces"][0]["requests"] == 200


def test_an_overloaded_cluster_has_lower_attainment_than_a_quiet_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    quiet = run_json(capsys, "--rate", "5", "--profile", "sim")["runs"][0]
    busy = run_json(capsys, "--rate", "200", "--profile", "sim")["runs"][0]
    assert busy["attainment"] < quiet["attainment"]
    # Admission (on, as in the orchestrator) refuses what the engines cannot take in time, so the
    # engines' queues, and the TTFT of what they serve, stay bounded; without it they grow.
    assert busy["shed"] > quiet["shed"]
    unguarded = run_json(capsys, "--rate", "200", "--profile", "sim", "--admission", "off")["runs"][0]
    assert unguarded["shed"] == 0 and unguarded["attainment"] < quiet["attainment"]
    assert unguarded["ttft_ms"]["p90"] > quiet["ttft_ms"]["p90"]


def test_compare_prints_one_row_per_policy_and_writes_the_plots(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plots = tmp_path / "plots"
    assert main([*SMALL, "--compare", "--rate", "20", "--plots", str(plots), "--progress"]) == 0
    captured = capsys.readouterr()
    main_table = captured.out.split("\n\n")[0]  # a table by class and tenant may follow
    rows = [line for line in main_table.splitlines() if line.startswith("| ") and " 20 " in line]
    assert [row.split("|")[1].strip() for row in rows] == list(POLICIES)
    assert "100%" in captured.err  # the progress bar, asked for though stderr is not a TTY
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["attainment-over-time-20.png", "goodput-vs-rate.png"]
    for name in names:
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_at_several_rates_and_rounds_reports_medians(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--compare", "--policy", "ours", "round-robin", "--rates", "10", "40", "--rounds", "2"]
    doc = run_json(capsys, *argv, "--requests", "60")
    assert len(doc["runs"]) == 2 * 2 * 2
    medians = [(m["policy"], m["rate"], m["seeds"]) for m in doc["medians"]]
    assert medians == [
        ("ours", 10.0, [0, 1]),
        ("round-robin", 10.0, [0, 1]),
        ("ours", 40.0, [0, 1]),
        ("round-robin", 40.0, [0, 1]),
    ]


def test_a_file_trace_is_replayed_at_the_rate_asked_for(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"
    dump_mooncake(SYNTHETIC["prefix"](rate_per_s=2.0, n_requests=100), path)
    argv = ["sim", "--trace", str(path), "--length-scale", str(16 / 512), "--prefill", "1", "--decode", "2"]
    assert main([*argv, "--rate", "25", "--policy", "random", "--json"]) == 0
    doc = jsonutil.loads(capsys.readouterr().out)
    [run] = doc["runs"]
    assert (run["rate"], run["requests"]) == (25.0, 100)
    assert run["duration_s"] == pytest.approx(100 / 25)  # sped up 12.5x: requests over duration is 25


def test_faults_cause_retries_or_resumes(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--rate", "20", "--policy", "round-robin", "--fault", "engine:decode-0@3+2")
    [run] = doc["runs"]
    assert run["retries"] + run["resumes"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--policy", "fastest"], "invalid choice: 'fastest'", id="unknown-policy"),
        pytest.param(["--fault", "engine:decode-0"], "--fault: 'engine:decode-0' is not", id="fault-no-time"),
        pytest.param(["--fault", "fire:decode-0@3"], "--fault: 'fire:decode-0@3' is not", id="fault-kind"),
        pytest.param(["--fault", "engine:decode-0@3x2"], "only a slow-link fault", id="fault-slowdown"),
        pytest.param(["--rate", "0"], "--rate: must be > 0", id="zero-rate"),
        pytest.param(["--rollout", "soon"], "--rollout: 'soon' is not AT[+EVERY]", id="rollout-no-time"),
        pytest.param(
            ["--role-change", "decode-0=leader@3"], "--role-change: 'decode-0=leader@3' is not", id="bad-role"
        ),
        pytest.param(["--role-switch", "magic"], "invalid choice: 'magic'", id="role-switch"),
        pytest.param(["--priority-mix", "0.5:0"], "the shares add up to 0.5, not 1", id="mix-short"),
        pytest.param(["--tenants", "a:0:1"], "a's weight must be a number > 0", id="tenant-weight"),
        pytest.param(["--tenant-weight", "a=0"], "--tenant-weight: expected TENANT=WEIGHT", id="weight"),
        pytest.param(["--admission", "maybe"], "invalid choice: 'maybe'", id="admission"),
    ],
)
def test_flags_argparse_refuses_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["sim", "--trace", "/nonexistent/trace.jsonl", "--prefill", "1", "--decode", "1"],
            "cannot read the trace '/nonexistent/trace.jsonl'",
            id="missing-trace-file",
        ),
        pytest.param(
            [*SMALL, "--fault", "node:decode-9@1"], "no instance 'decode-9'", id="fault-unknown-instance"
        ),
        pytest.param([*SMALL, "--rates", "1", "2"], "--rates needs --compare", id="rates-without-compare"),
        pytest.param(
            [*SMALL, "--role-change", "decode-9=prefill@1"],
            "no instance 'decode-9'",
            id="role-change-unknown",
        ),
        pytest.param([*SMALL, "--rollback", "5"], "--rollback needs a --rollout", id="rollback-alone"),
        pytest.param(
            [*SMALL, "--rollout", "5", "--rollback", "4"],
            "--rollout that starts before it",
            id="rollback-first",
        ),
        pytest.param([*SMALL, "--plots", "x"], "--plots needs --compare", id="plots-without-compare"),
        pytest.param([*SMALL, "--time-scale", "2"], "apply to a --trace file", id="time-scale-on-synthetic"),
        pytest.param(
            [*SMALL, "--planner-config", "/nonexistent/planner.yaml"],
            "cannot read the planner config",
            id="missing-planner-config",
        ),
    ],
)
def test_configurations_that_cannot_work_exit_2_before_running(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "vllm-disagg sim: configuration error:" in captured.err and message in captured.err
    assert captured.out == ""


def test_a_planner_config_that_is_a_dry_run_is_pointed_out(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "planner.yaml"
    config.write_text("apiVersion: vllm-disagg/v1alpha1\nkind: PlannerConfig\ndryRun: true\n")
    assert main([*SMALL, "--requests", "30", "--planner-config", str(config), "--json"]) == 0
    captured = capsys.readouterr()
    doc = jsonutil.loads(captured.out)
    assert doc["planner"]["dryRun"] is True and doc["runs"][0]["shifts"] == 0
    assert "moves no instance" in captured.err


def test_an_operators_rollout_and_role_change_run_on_virtual_time_and_are_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "--rate",
        "20",
        "--rollout",
        "2+1",
        "--role-change",
        "decode-1=prefill@1",
        "--role-switch",
        "restart",
    ]
    doc = run_json(capsys, *argv, "--engine-start-s", "1")
    [run] = doc["runs"]
    # The rollout and the restart fail no request: any that did not finish was refused by admission
    # (while capacity was down) before an engine saw it.
    assert run["failed"] == run["shed"]
    control = run["control"]
    rollout = [(e["what"], e.get("instance")) for e in control if e["kind"] == "rollout"]
    assert rollout[0] == ("started", None) and rollout[-1] == ("complete", None)
    assert len([i for what, i in rollout if what == "drained"]) == 4
    [change] = [e for e in control if e["kind"] == "role_change"]
    assert (change["instance"], change["how"], change["outcome"]) == ("decode-1", "restart", "done")
    assert [e["step"] for e in control if e["kind"] == "role_restart"] == ["draining", "restarting", "ready"]

    assert main([*SMALL, *argv, "--engine-start-s", "1"]) == 0
    out = capsys.readouterr().out
    assert "ours @ 20 req/s, seed 0: rollouts and role changes" in out
    assert "rollout of sim-model 'r1' -> 'r2': complete" in out
    assert "decode-1 decode -> prefill (operator): done by restart" in out


CLASSES = ["--priority-mix", "0.2:-1,0.6:0,0.2:1", "--tenants", "a:1:0.75,b:1:0.25"]


def test_priorities_and_tenants_are_reported_with_what_admission_refused_and_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = run_json(capsys, "--rate", "200", "--profile", "sim", *CLASSES, "--tenant-weight", "a=3")
    [run] = doc["runs"]
    # --tenant-weight wins over the weight --tenants gives.
    assert doc["admission"]["enabled"] is True and doc["admission"]["tenant_weights"] == {"a": 3.0, "b": 1.0}
    assert [c["priority"] for c in run["by_priority"]] == [-1, 0, 1]
    assert [c["tenant"] for c in run["by_tenant"]] == ["a", "b"]
    for classes in (run["by_priority"], run["by_tenant"]):
        assert sum(c["requests"] for c in classes) == run["requests"] == 200
        assert sum(c["shed"] for c in classes) == run["shed"]
    assert run["shed"] > 0 and set(run["shed_by_reason"]) <= set(SHED_REASONS)
    assert sum(run["shed_by_reason"].values()) == run["shed"]
    assert run["admission_checks"] > 0
    top, _, sheddable = run["by_priority"]
    assert top["attainment"] > sheddable["attainment"]
    assert sheddable["shed_by_reason"].get("sheddable", 0) > 0

    assert main([*SMALL, "--rate", "200", "--profile", "sim", *CLASSES]) == 0
    out = capsys.readouterr().out
    rows = [
        line for line in out.split("by priority class and tenant")[1].splitlines() if line.startswith("| ")
    ]
    assert [row.split("|")[3].strip() for row in rows[2:]] == [
        "all", "priority -1", "priority 0", "priority 1", "tenant a", "tenant b",
    ]  # fmt: skip


def test_admission_off_sends_every_request_to_an_engine(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--rate", "200", "--profile", "sim", *CLASSES, "--admission", "off")
    [run] = doc["runs"]
    assert doc["admission"]["enabled"] is False
    assert (run["shed"], run["shed_by_reason"], run["admission_checks"]) == (0, {}, 0)
    assert run["failed"] == 0


def test_requests_without_targets_wait_for_room_at_most_the_longest_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--rate", "200", "--profile", "sim", "--no-request-slo", "--admission-max-wait-s", "0.5"]
    [run] = run_json(capsys, *argv)["runs"]
    # No target, so never out of reach: what is refused waited the longest wait, and no more.
    assert run["shed_by_reason"].get("queue_timeout", 0) > 0
    assert "deadline_unreachable" not in run["shed_by_reason"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--tenant-weight", "a=1", "--tenant-weight", "a=2"], "names a tenant twice", id="twice"
        ),
        pytest.param(["--admission-max-queue", "0"], "admission.max_queue must be > 0", id="max-queue"),
    ],
)
def test_admission_configurations_that_cannot_work_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([*SMALL, *argv]) == 2
    assert message in capsys.readouterr().err
