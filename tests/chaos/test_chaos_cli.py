"""``vllm-disagg chaos`` end to end, in-process through ``main(argv)``: a real 2P2D cluster of simulated
engines (orchestrator, agents, engines as processes on loopback) under streaming load for 25 s, an
engine or an agent SIGKILLed every 5 s, every response checked byte for byte; and a 1P1D cluster behind
three orchestrator replicas on a local etcd (``--replicas 3``), a replica or an engine SIGKILLed."""

from __future__ import annotations

import contextlib
import io
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.up_support import engine_pids
from tests.helpers import eventually_sync
from vllm_disagg.chaos.killer import alive
from vllm_disagg.cli.commands import main

# Seed 5 draws an agent, then an engine: both kinds of fault within the first two.
CHAOS = [
    "chaos", "--prefill", "2", "--decode", "2", "--concurrency", "16", "--kill-every", "5",
    "--duration", "25", "--seed", "5", "--json",
]  # fmt: skip
QUIET = [
    "chaos",
    "--prefill",
    "1",
    "--decode",
    "1",
    "--concurrency",
    "8",
    "--kill-every",
    "0",
    "--duration",
    "5",
]
# Seed 2 draws a replica first, then engines: a replica kill (and its recovery) within the run.
REPLICATED = [
    "chaos", "--prefill", "2", "--decode", "2", "--replicas", "3", "--kinds", "replica,engine",
    "--concurrency", "12", "--kill-every", "5", "--duration", "16", "--seed", "2", "--json",
]  # fmt: skip
FIELDS = {"sent", "completed", "failed", "garbled", "resumed", "fell_back", "retried", "duration_s", "rps"}


@dataclass(frozen=True)
class Run:
    """One finished ``vllm-disagg chaos`` run: its exit code and its JSON report."""

    code: int
    report: dict[str, Any]


def run_chaos(argv: list[str]) -> Run:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return Run(code, json.loads(out.getvalue()))


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    log = tmp_path_factory.mktemp("chaos") / "cluster.log"
    yield run_chaos([*CHAOS, "--log-file", str(log)])


def test_the_report_has_every_field_and_every_request_is_accounted_for(chaos: Run) -> None:
    r = chaos.report
    assert r.keys() >= FIELDS and {"faults", "examples"} <= r.keys()
    assert all(isinstance(r[k], int) for k in FIELDS - {"duration_s", "rps"})
    assert r["sent"] > 0 and r["completed"] > 0
    assert r["sent"] == r["completed"] + r["failed"] + r["garbled"]
    assert r["abandoned"] == 0  # nothing interrupted the run
    assert min(r["resumed"], r["fell_back"], r["retried"]) >= 0
    assert r["duration_s"] >= 25 and r["rps"] > 0
    assert chaos.code == (0 if r["failed"] == r["garbled"] == 0 else 1)
    assert "agent prefill-0" in Path(r["log_file"]).read_text()  # the cluster wrote where it was told


def test_faults_were_injected_on_schedule_and_every_victim_was_replaced(chaos: Run) -> None:
    faults = chaos.report["faults"]
    # Ticks at 5, 10, 15 and 20 s; one may find every instance still recovering on a loaded machine.
    assert len(faults) + chaos.report["skipped_faults"] >= 4 and len(faults) >= 3, faults
    assert {f["kind"] for f in faults} == {"engine", "agent"}
    assert {f["target"] for f in faults} <= {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert [f["at_s"] for f in faults] == sorted(f["at_s"] for f in faults) and faults[0]["at_s"] >= 5
    for f in faults:
        assert f["error"] == "" and f["recovered_s"] is not None, f
        assert f["new_pid"] not in (None, f["pid"]), f  # a new process took the victim's place


def test_every_failure_comes_with_an_example(chaos: Run) -> None:
    r = chaos.report
    for kind in ("failed", "garbled"):
        examples = r["examples"][kind]
        assert len(examples) == min(r[kind], 5)
        for ex in examples:
            assert ex["request_id"].startswith("chaos-") and ex["reason"], ex
            assert ex["path"] in ("/v1/completions", "/v1/chat/completions")


def test_nothing_outlives_the_run(chaos: Run) -> None:
    ports = chaos.report["config"]["engine_ports"]
    eventually_sync(lambda: not engine_pids(ports), timeout=30, what="no agent or engine left")
    for f in chaos.report["faults"]:
        assert not alive(f["pid"]) and not (f["new_pid"] and alive(f["new_pid"]))


def test_no_request_fails_or_is_garbled_while_engines_and_agents_are_killed(chaos: Run) -> None:
    r = chaos.report
    assert (r["failed"], r["garbled"]) == (0, 0), r["examples"]


def test_the_kv_audit_judges_decode_legs_under_chaos_and_raises_no_false_alarm(chaos: Run) -> None:
    # The simulated engines never compute a prompt they were handed (a failed pull answers 500): every
    # verdict would be a false alarm, from kills, restarts and counters that start again.
    r = chaos.report
    assert r["kv_audited"] > 0 and r["recomputed"] == 0


def test_without_faults_every_response_is_byte_exact_and_the_exit_code_is_0(tmp_path: Path) -> None:
    run = run_chaos([*QUIET, "--json", "--log-file", str(tmp_path / "cluster.log")])
    r = run.report
    assert r["faults"] == [] and r["sent"] > 0
    assert (r["completed"], r["failed"], r["garbled"]) == (r["sent"], 0, 0), r["examples"]
    assert run.code == 0


def test_with_replicas_killed_too_no_request_on_a_live_replica_fails_and_none_is_garbled(
    tmp_path: Path,
) -> None:
    run = run_chaos([*REPLICATED, "--log-file", str(tmp_path / "cluster.log")])
    r = run.report
    assert r["replicas"] == 3 and len(r["config"]["gateways"]) == 3 and r["sent"] > 0
    killed = [f for f in r["faults"] if f["kind"] == "replica"]
    assert killed and {f["target"] for f in killed} <= {"r0", "r1", "r2"}, r["faults"]
    for f in killed:
        assert f["error"] == "" and f["recovered_s"] is not None and f["new_pid"] not in (None, f["pid"]), f
    assert r["failed"] == r["failed_on_killed_replicas"] + r["failed_on_live_replicas"]
    assert (r["failed_on_live_replicas"], r["garbled"]) == (0, 0), r["examples"]
    assert run.code == 0
    # The load went to every replica, and the killed ones served again after their recovery.
    assert set(r["per_replica"]) == {"r0", "r1", "r2"}
    assert all(counts.get("completed", 0) > 0 for counts in r["per_replica"].values()), r["per_replica"]
    eventually_sync(
        lambda: not engine_pids(r["config"]["engine_ports"]), timeout=30, what="no agent or engine left"
    )
    assert not any(alive(f["new_pid"]) for f in killed)
    listeners = [r["config"]["etcd"], *r["config"]["gateways"]]  # etcd and every replica stopped too
    eventually_sync(lambda: not any(map(_listening, listeners)), timeout=30, what="nothing listening")


def _listening(url: str) -> bool:
    """Whether something accepts connections at ``url``'s port on loopback (a closed port refuses them;
    binding it could fail for a while after, on its connections in TIME_WAIT)."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) == 0
