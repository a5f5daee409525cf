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
    assert busy["ttft_ms"]["p90"] > quiet["ttft_ms"]["p90"]


def test_compare_prints_one_row_per_policy_and_writes_the_plots(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plots = tmp_path / "plots"
    assert main([*SMALL, "--compare", "--rate", "20", "--plots", str(plots), "--progress"]) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("| ") and " 20 " in line]
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
    assert run["failed"] == 0
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
