"""``up``'s supervision: the restart policy as tables, and the supervisor on a fake clock with stand-in
children (no process, no sleep: the test decides when a child exits and how far time moves)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from vllm_disagg.cli.supervise import (
    Child,
    ChildSpec,
    CrashHistory,
    Note,
    RestartPolicy,
    StartFailed,
    Supervisor,
    Verdict,
    after_exit,
    exit_line,
)
from vllm_disagg.cli.up import add_arguments, policy_from_args
from vllm_disagg.clock import FakeClock
from vllm_disagg.errors import ConfigError

POLICY = RestartPolicy()  # 0.5 s doubling to 10 s, reset after 30 s up, 5 crashes in 60 s give up


# --- the policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (0, "it stopped on its own"),
        (2, "a configuration error"),
        (3, "refused by the orchestrator"),
    ],
    ids=["exit-0-stopped-on-its-own", "exit-2-configuration-error", "exit-3-refused-agent"],
)
def test_exits_that_a_restart_would_not_help_are_left_alone(code: int, reason: str) -> None:
    history = CrashHistory(crashes=(100.0,), streak=1, restarts=1)
    verdict = after_exit(POLICY, history, code, up_s=1.0, now=101.0)
    assert verdict.action == "leave" and reason in verdict.reason
    assert verdict.history == history, "leaving is not a crash"


@pytest.mark.parametrize("code", [-9, -11, -15, 1, 137, 255], ids=lambda c: f"code-{c}")
def test_a_signal_or_any_other_code_is_a_crash_restarted_after_the_first_backoff(code: int) -> None:
    verdict = after_exit(POLICY, CrashHistory(), code, up_s=5.0, now=1000.0)
    assert (verdict.action, verdict.delay_s) == ("restart", 0.5)
    assert verdict.history == CrashHistory(crashes=(1000.0,), streak=1, restarts=1)


# (seconds up before each crash, the action and delay each crash gets); crashes follow each other at
# once (up_s after the previous restart), so ``now`` is the sum of the backoffs and the times up.
TIMELINES = [
    pytest.param(
        [1, 1, 1, 1, 1],
        [("restart", 0.5), ("restart", 1.0), ("restart", 2.0), ("restart", 4.0), ("give_up", 0.0)],
        id="crashing-at-start-doubles-the-backoff-and-the-fifth-crash-in-60s-gives-up",
    ),
    pytest.param(
        [1, 1, 40, 1],
        [("restart", 0.5), ("restart", 1.0), ("restart", 0.5), ("restart", 1.0)],
        id="up-30s-or-more-starts-the-backoff-again",
    ),
    pytest.param(
        [20, 20, 20, 20, 20, 20],
        [
            ("restart", 0.5),
            ("restart", 1.0),
            ("restart", 2.0),
            ("restart", 4.0),
            ("restart", 8.0),
            ("restart", 10.0),
        ],
        id="crashing-every-20s-is-never-5-in-60s-and-the-backoff-stops-at-10s",
    ),
    pytest.param(
        [1, 1, 1, 1, 55, 1],
        [
            ("restart", 0.5),
            ("restart", 1.0),
            ("restart", 2.0),
            ("restart", 4.0),
            ("restart", 0.5),
            ("restart", 1.0),
        ],
        id="crashes-older-than-the-window-do-not-count",
    ),
]


@pytest.mark.parametrize(("ups", "want"), TIMELINES)
def test_a_child_crashing_again_and_again(ups: list[float], want: list[tuple[str, float]]) -> None:
    clock = FakeClock()
    history = CrashHistory()
    got = []
    for up_s in ups:
        clock.advance(up_s)
        verdict = after_exit(POLICY, history, -9, up_s=up_s, now=clock.monotonic())
        got.append((verdict.action, verdict.delay_s))
        history = verdict.history
        clock.advance(verdict.delay_s)
    assert got == want
    restarts = sum(action == "restart" for action, _ in want)
    assert history.restarts == restarts


@pytest.mark.parametrize(
    ("policy", "crashes", "reason"),
    [
        (RestartPolicy(max_crashes=1), 1, "crashed once in 60 s"),
        (RestartPolicy(max_crashes=3, window_s=30), 3, "crashed 3 times in 30 s"),
        (POLICY, 5, "crashed 5 times in 60 s"),
    ],
    ids=["max-crashes-1-never-restarts", "3-in-30s", "the-default-5-in-60s"],
)
def test_giving_up_says_how_many_crashes_in_how_long(
    policy: RestartPolicy, crashes: int, reason: str
) -> None:
    history = CrashHistory()
    verdicts = []
    for n in range(crashes):
        verdict = after_exit(policy, history, 1, up_s=0.1, now=1000.0 + n)
        verdicts.append(verdict.action)
        history = verdict.history
    assert verdicts == ["restart"] * (crashes - 1) + ["give_up"]
    assert verdict.reason == reason


@pytest.mark.parametrize(
    ("verdict", "code", "line"),
    [
        (
            Verdict("restart", CrashHistory(restarts=1), delay_s=0.5),
            -9,
            "agent decode-0 exited (code -9); restarting in 0.5 s (restart 1)",
        ),
        (
            Verdict("give_up", CrashHistory(restarts=4), reason="crashed 5 times in 60 s"),
            1,
            "agent decode-0 crashed 5 times in 60 s (last: code 1); giving up: its instance leaves routing",
        ),
        (
            Verdict("leave", CrashHistory(), reason="refused by the orchestrator"),
            3,
            "agent decode-0 exited (code 3): refused by the orchestrator; not restarting: its instance "
            "leaves routing",
        ),
    ],
    ids=["restart", "give-up", "leave"],
)
def test_each_decision_is_one_line(verdict: Verdict, code: int, line: str) -> None:
    assert exit_line("agent decode-0", code, verdict, "its instance leaves routing") == line


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_crashes": 0}, "--max-crashes must be at least 1"),
        ({"window_s": 0.0}, "--crash-window-s must be > 0"),
        ({"backoff_s": 0.0}, "restart backoff"),
        ({"backoff_s": 20.0}, "restart backoff"),
    ],
    ids=["no-crash-allowed", "no-window", "no-backoff", "backoff-above-its-cap"],
)
def test_a_policy_that_cannot_work_is_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], RestartPolicy()),
        (["--max-crashes", "3", "--crash-window-s", "20"], RestartPolicy(max_crashes=3, window_s=20.0)),
        (["--max-crashes", "1"], RestartPolicy(max_crashes=1)),
        (["--restart-backoff-s", "3"], RestartPolicy(backoff_s=3.0)),
        (["--restart-backoff-s", "20"], RestartPolicy(backoff_s=20.0, backoff_max_s=20.0)),
    ],
    ids=["defaults", "operator-values", "never-restart", "first-restart-later", "backoff-past-the-cap"],
)
def test_up_flags_set_the_policy(argv: list[str], want: RestartPolicy) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert policy_from_args(parser.parse_args(argv)) == want


# --- the supervisor, on a fake clock ------------------------------------------------------------


class FakeChild:
    """A stand-in process: it exits when the test says."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def exit(self, code: int) -> None:
        if not self._exited.done():
            self.returncode = code
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


@dataclass
class FakeLauncher:
    """Starts ``FakeChild``s and records what it was asked; a stop makes children exit 0."""

    started: list[tuple[str, int]] = field(default_factory=list)
    stopped: list[list[str]] = field(default_factory=list)
    reaped: list[int] = field(default_factory=list)
    children: dict[str, FakeChild] = field(default_factory=dict)
    _names: dict[int, str] = field(default_factory=dict)

    async def start(self, spec: ChildSpec) -> Child:
        child = FakeChild(pid=1000 + len(self.started))
        self.started.append((spec.name, child.pid))
        self.children[spec.name] = child
        self._names[child.pid] = spec.name
        return child

    async def stop(self, children: Sequence[Child], grace_s: float) -> None:
        self.stopped.append([self._names[c.pid] for c in children])
        for child in children:
            assert isinstance(child, FakeChild)
            child.exit(0)

    async def reap(self, child: Child) -> None:
        self.reaped.append(child.pid)


@dataclass
class Harness:
    supervisor: Supervisor
    launcher: FakeLauncher
    clock: FakeClock
    lines: list[tuple[str, bool]]
    notes: list[Note]
    cleanups: list[str]

    def starts(self, name: str) -> int:
        return sum(n == name for n, _ in self.launcher.started)


def harness(policy: RestartPolicy = POLICY) -> Harness:
    clock, launcher = FakeClock(), FakeLauncher()
    cleanups: list[str] = []

    def cleanup_of(name: str) -> ChildSpec:
        async def cleanup() -> None:
            cleanups.append(name)

        leaves = "its instance leaves routing"
        return ChildSpec(f"agent {name}", ("agent", name), stage=1, consequence=leaves, cleanup=cleanup)

    specs = [
        ChildSpec("orchestrator", ("orchestrator",), essential=True, consequence="stopping the cluster"),
        cleanup_of("prefill-0"),
        cleanup_of("decode-0"),
    ]
    return harness_of(specs, policy, clock, launcher, cleanups)


def harness_of(
    specs: list[ChildSpec],
    policy: RestartPolicy = POLICY,
    clock: FakeClock | None = None,
    launcher: FakeLauncher | None = None,
    cleanups: list[str] | None = None,
) -> Harness:
    clock, launcher = clock or FakeClock(), launcher or FakeLauncher()
    lines: list[tuple[str, bool]] = []
    notes: list[Note] = []
    supervisor = Supervisor(
        specs,
        policy,
        launcher=launcher,
        clock=clock,
        say=lambda line, error: lines.append((line, error)),
        note=notes.append,
    )
    return Harness(supervisor, launcher, clock, lines, notes, [] if cleanups is None else cleanups)


async def test_children_start_orchestrator_first_and_stop_agents_first_with_no_restart() -> None:
    h = harness()
    await h.supervisor.start()
    assert [name for name, _ in h.launcher.started] == ["orchestrator", "agent prefill-0", "agent decode-0"]
    await h.supervisor.stop()
    assert h.launcher.stopped == [["agent prefill-0", "agent decode-0"], ["orchestrator"]]
    await h.clock.run_for(60)
    assert h.lines == [] and h.notes == [] and len(h.launcher.started) == 3, "a stop is not a crash"
    assert not h.supervisor.ended.is_set()


async def test_a_killed_agent_is_restarted_after_the_backoff_with_its_engine_cleared_first() -> None:
    h = harness()
    await h.supervisor.start()
    first = h.launcher.children["agent decode-0"].pid
    h.launcher.children["agent decode-0"].exit(-9)
    await h.clock.run_for(0.49)
    assert h.lines == [("agent decode-0 exited (code -9); restarting in 0.5 s (restart 1)", False)]
    assert h.launcher.reaped == [first], "what it left in its group goes first"
    assert h.cleanups == ["decode-0"], "its engine is ended before the restart"
    assert h.starts("agent decode-0") == 1, "not before the backoff"
    await h.clock.run_for(0.01)
    assert h.starts("agent decode-0") == 2
    assert h.supervisor.pid("agent decode-0") != first and h.supervisor.restarts("agent decode-0") == 1
    assert h.notes == [Note("agent decode-0", "restarted", "exited (code -9); restarted after 0.5 s", -9, 1)]
    await h.supervisor.stop()
    assert not h.supervisor.left


async def test_a_crash_loop_gives_up_on_the_agent_and_the_cluster_keeps_running() -> None:
    h = harness(RestartPolicy(max_crashes=3, window_s=30))
    await h.supervisor.start()
    for _ in range(3):
        h.launcher.children["agent decode-0"].exit(1)
        await h.clock.run_for(5)
    assert [line for line, _ in h.lines] == [
        "agent decode-0 exited (code 1); restarting in 0.5 s (restart 1)",
        "agent decode-0 exited (code 1); restarting in 1 s (restart 2)",
        "agent decode-0 crashed 3 times in 30 s (last: code 1); giving up: its instance leaves routing",
    ]
    assert h.lines[-1][1], "giving up is said as an error"
    assert h.starts("agent decode-0") == 3
    assert h.notes[-1] == Note(
        "agent decode-0", "gave_up", "crashed 3 times in 30 s; gave up: its instance leaves routing", 1, 2
    )
    assert list(h.supervisor.left) == ["agent decode-0"]
    assert not h.supervisor.ended.is_set(), "an agent is not the cluster"
    await h.supervisor.stop()


async def test_giving_up_on_the_orchestrator_ends_the_supervisor_with_the_reason() -> None:
    h = harness(RestartPolicy(max_crashes=2))
    await h.supervisor.start()
    h.launcher.children["orchestrator"].exit(-9)
    await h.clock.run_for(1)
    assert h.starts("orchestrator") == 2
    h.launcher.children["orchestrator"].exit(-9)
    await h.clock.run_for(1)
    assert h.supervisor.ended.is_set() and h.supervisor.end_code == 1
    assert h.supervisor.end_reason == (
        "orchestrator crashed 2 times in 60 s (last: code -9); giving up: stopping the cluster"
    )
    assert [n.action for n in h.notes] == ["restarted"], "nobody is left to note the end to"
    await h.supervisor.stop()


@pytest.mark.parametrize(
    ("name", "code", "ended", "notes"),
    [
        ("agent decode-0", 0, False, []),
        ("agent decode-0", 3, False, ["gave_up"]),
        ("orchestrator", 0, True, []),
    ],
    ids=[
        "agent-shut-down-is-left",
        "agent-refused-is-left-and-noted",
        "orchestrator-stopped-ends-up-cleanly",
    ],
)
async def test_a_child_that_ends_on_purpose_is_not_restarted(
    name: str, code: int, ended: bool, notes: list[str]
) -> None:
    h = harness()
    await h.supervisor.start()
    h.launcher.children[name].exit(code)
    await h.clock.run_for(60)
    assert h.starts(name) == 1
    assert len(h.lines) == 1 and "not restarting" in h.lines[0][0]
    assert [n.action for n in h.notes] == notes
    assert h.supervisor.ended.is_set() == ended
    if ended:
        assert h.supervisor.end_code == 0
    await h.supervisor.stop()


async def test_a_stop_during_the_backoff_cancels_the_restart() -> None:
    h = harness()
    await h.supervisor.start()
    h.launcher.children["agent prefill-0"].exit(-9)
    await h.clock.run_for(0.2)
    await h.supervisor.stop()
    await h.clock.run_for(10)
    assert h.starts("agent prefill-0") == 1
    assert h.notes == []


def test_child_names_are_unique() -> None:
    spec = ChildSpec("agent a", ("x",))
    with pytest.raises(ValueError, match="unique"):
        Supervisor([spec, spec], POLICY)


# --- replicas: essential children of one group ---------------------------------------------------


def replicas_harness(policy: RestartPolicy = POLICY, ready: list[str] | None = None) -> Harness:
    """An etcd (stage -1, waited for), two orchestrator replicas (one group) and an agent."""

    async def etcd_ready(child: Child) -> None:
        assert ready is not None
        ready.append(f"etcd ready; started so far: {len(launcher.started)}")

    launcher = FakeLauncher()
    replica = {
        "essential": True,
        "group": "orchestrator replicas",
        "consequence": "the other replicas serve on",
        "last_consequence": "no replica left: stopping the cluster",
    }
    specs = [
        ChildSpec("etcd", ("etcd",), stage=-1, ready=etcd_ready if ready is not None else None),
        ChildSpec("orchestrator replica-0", ("orchestrator", "0"), **replica),  # type: ignore[arg-type]
        ChildSpec("orchestrator replica-1", ("orchestrator", "1"), **replica),  # type: ignore[arg-type]
        ChildSpec("agent decode-0", ("agent",), stage=1),
    ]
    return harness_of(specs, policy, launcher=launcher)


async def test_giving_up_on_one_replica_leaves_the_cluster_to_the_others_and_on_the_last_ends_it() -> None:
    h = replicas_harness(RestartPolicy(max_crashes=1))
    await h.supervisor.start()
    h.launcher.children["orchestrator replica-1"].exit(-9)
    await h.clock.run_for(1)
    assert h.lines == [
        (
            "orchestrator replica-1 crashed once in 60 s (last: code -9); giving up: the other replicas "
            "serve on",
            True,
        )
    ]
    assert not h.supervisor.ended.is_set(), "replica-0 still serves"
    assert [(n.process, n.action) for n in h.notes] == [("orchestrator replica-1", "gave_up")], (
        "noted: a replica is left to take the note"
    )
    h.launcher.children["orchestrator replica-0"].exit(-9)
    await h.clock.run_for(1)
    assert h.supervisor.ended.is_set() and h.supervisor.end_code == 1
    assert h.supervisor.end_reason == (
        "orchestrator replica-0 crashed once in 60 s (last: code -9); giving up: no replica left: "
        "stopping the cluster"
    )
    assert len(h.notes) == 1, "nobody is left to note the end to"
    await h.supervisor.stop()


async def test_a_replica_restarting_still_counts_and_the_last_stopping_on_its_own_ends_cleanly() -> None:
    h = replicas_harness()
    await h.supervisor.start()
    h.launcher.children["orchestrator replica-0"].exit(-9)  # restarted after 0.5 s
    h.launcher.children["orchestrator replica-1"].exit(0)  # stopped on its own: left
    await h.clock.run_for(0.1)
    assert not h.supervisor.ended.is_set(), "replica-0 is only waiting for its restart"
    await h.clock.run_for(1)
    assert h.starts("orchestrator replica-0") == 2
    h.launcher.children["orchestrator replica-0"].exit(0)
    await h.clock.run_for(1)
    assert h.supervisor.ended.is_set() and h.supervisor.end_code == 0
    assert h.supervisor.end_reason.endswith("not restarting: no replica left: stopping the cluster")
    await h.supervisor.stop()


async def test_a_child_with_a_readiness_check_is_ready_before_the_next_stage_starts_and_stops_last() -> None:
    ready: list[str] = []
    h = replicas_harness(ready=ready)
    await h.supervisor.start()
    assert ready == ["etcd ready; started so far: 1"], "nothing else started before it was ready"
    assert next(name for name, _ in h.launcher.started) == "etcd"
    await h.supervisor.stop()
    assert h.launcher.stopped == [
        ["agent decode-0"],
        ["orchestrator replica-0", "orchestrator replica-1"],
        ["etcd"],
    ]


async def test_a_failed_readiness_check_fails_the_start_and_starts_nothing_more() -> None:
    async def never(child: Child) -> None:
        raise StartFailed("etcd at http://127.0.0.1:2379 not healthy within 60 s")

    specs = [
        ChildSpec("etcd", ("etcd",), stage=-1, ready=never),
        ChildSpec("orchestrator replica-0", ("orchestrator",), essential=True, group="replicas"),
    ]
    h = harness_of(specs)
    with pytest.raises(StartFailed, match="not healthy"):
        await h.supervisor.start()
    assert [name for name, _ in h.launcher.started] == ["etcd"]
    await h.supervisor.stop()
    assert h.launcher.stopped == [[], ["etcd"]]
