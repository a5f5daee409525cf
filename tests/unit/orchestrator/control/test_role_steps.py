"""A role change's decisions, one operator's story per row: what the agent answers and what the
registry shows, in order, and everything the change did. Instance ``d0`` serves decode and is asked
to serve prefill at t=0; the drain may take 10 s, the restart 60 s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from tests.unit.orchestrator.control.control_support import Inst, snapshot_of
from vllm_disagg.orchestrator.control import role_steps as steps
from vllm_disagg.orchestrator.control.role_steps import (
    Answer,
    Ask,
    Done,
    Effect,
    EngineRestarting,
    Fail,
    Limits,
    MoveRole,
    Phase,
    Publish,
    RoleState,
    SetDrain,
)
from vllm_disagg.protocol.messages import RESTART_REQUIRED

LIMITS = Limits(drain_timeout_s=10.0, restart_timeout_s=60.0)
D0 = Inst("d0", "decode")

YES = Answer(True)
RESTART = Answer(False, RESTART_REQUIRED, "the engine was launched kv_consumer")
REFUSED = Answer(False, "unsupported", "attached engines keep their role")
UNREACHABLE = Answer(False, error="instance 'd0' did not acknowledge set_role within 5s", delivered=False)

# What happens, in order: the agent answers, or the registry is looked at (``d0`` as the row says).
Input = tuple[float, Answer | Inst]


def said(effects: Sequence[Effect]) -> list[str]:
    """Effects as an operator would read them."""
    out = []
    for e in effects:
        if isinstance(e, Ask):
            out.append(f"ask {e.role}" + (" restart" if e.restart else ""))
        elif isinstance(e, SetDrain):
            out.append("drain" if e.draining else "undrain")
        elif isinstance(e, MoveRole):
            out.append(f"move to {e.role}")
        elif isinstance(e, EngineRestarting):
            out.append(f"engine {e.reason}")
        elif isinstance(e, Publish):
            timeline = " ".join(f"{k}={v:g}" for k, v in e.timeline)
            extra = (f" left={e.left_in_flight}" if e.left_in_flight else "") + (
                f" error={e.error}" if e.error else ""
            )
            out.append(f"event {e.step} [{timeline}]{extra}")
        elif isinstance(e, Done):
            out.append(f"done {e.how}")
        elif isinstance(e, Fail):
            out.append(f"fail {e.failure}: {e.message}")
    return out


def run(inputs: Sequence[Input], start: Inst = D0) -> tuple[RoleState, list[str]]:
    """Begin the change, feed it ``inputs``: its last state and every effect it had."""
    step = steps.begin(snapshot_of(start).by_id["d0"], "prefill", 0.0, LIMITS)
    effects = list(step.effects)
    for at, what in inputs:
        if isinstance(what, Answer):
            step = steps.answered(step.state, what, at)
        else:
            step = steps.step(step.state, snapshot_of(what), at)
        effects += step.effects
    return step.state, said(effects)


ASKED = ["ask prefill"]
DRAINING = [*ASKED, "drain", "event draining []"]

STORIES = [
    pytest.param(
        [(0.1, YES)], "done", [*ASKED, "move to prefill", "done routing"],
        id="an engine that serves both roles: moved by routing alone, nothing drained",
    ),
    pytest.param(
        [(0.1, REFUSED)], "failed",
        [*ASKED, "fail refused: d0 cannot serve as prefill: attached engines keep their role"],
        id="the agent refuses: nothing changes",
    ),
    pytest.param(
        [(5.0, UNREACHABLE)], "failed",
        [*ASKED, "fail agent: instance 'd0' did not acknowledge set_role within 5s"],
        id="the agent does not answer: the control plane's error, nothing changes",
    ),
    pytest.param(
        [(0.1, RESTART), (0.2, replace(D0, drained=True, in_flight=2))], "draining", DRAINING,
        id="restart required: drained, and it waits while requests are on it",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True))], "asking_restart",
        [*DRAINING, "ask prefill restart"],
        id="the last request ended: asked to restart at once",
    ),
    pytest.param(
        [(0.1, RESTART), (10.1, replace(D0, drained=True, in_flight=2))], "asking_restart",
        [*DRAINING, "ask prefill restart"],
        id="the drain timed out with requests on it: they fail over and the restart goes on",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True, dead=True))], "failed",
        [*DRAINING, "event failed [drained=3] error=d0 is gone during its role change", "undrain",
         "fail gone: d0 is gone during its role change"],
        id="it died while draining: the change fails and the drain is put back",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, sessions=2))], "failed",
        [*DRAINING, "event failed [drained=3] error=d0 started a new session during its role change",
         "undrain", "fail gone: d0 started a new session during its role change"],
        id="its agent started over while draining: the change fails",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, YES)], "restarting",
        [*DRAINING, "ask prefill restart", "engine restarting as prefill", "move to prefill",
         "event restarting [drained=3 restarting=3.5]"],
        id="the agent restarts its engine: not routed to, moved to its new pool, waiting for ready",
    ),
    pytest.param(
        [(0.1, RESTART), (10.1, replace(D0, drained=True, in_flight=1)), (10.5, YES)], "restarting",
        [*DRAINING, "ask prefill restart", "engine restarting as prefill", "move to prefill",
         "event restarting [drained=10.1 restarting=10.5] left=1"],
        id="the restart's event says how many requests the drain left to fail over",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, REFUSED)], "failed",
        [*DRAINING, "ask prefill restart",
         "event failed [drained=3] error=d0 cannot serve as prefill: attached engines keep their role",
         "undrain", "fail refused: d0 cannot serve as prefill: attached engines keep their role"],
        id="the agent refuses the restart: the drain is put back",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (8.0, UNREACHABLE)], "failed",
        [*DRAINING, "ask prefill restart",
         "event failed [drained=3] error=instance 'd0' did not acknowledge set_role within 5s", "undrain",
         "fail agent: instance 'd0' did not acknowledge set_role within 5s"],
        id="the restart command is not acknowledged: the drain is put back",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, YES),
         (20.0, replace(D0, role="prefill", drained=True, engine="starting"))], "restarting",
        [*DRAINING, "ask prefill restart", "engine restarting as prefill", "move to prefill",
         "event restarting [drained=3 restarting=3.5]"],
        id="the new engine is still starting: it waits",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, YES),
         (40.0, replace(D0, role="prefill", drained=True))], "done",
        [*DRAINING, "ask prefill restart", "engine restarting as prefill", "move to prefill",
         "event restarting [drained=3 restarting=3.5]", "undrain",
         "event ready [drained=3 restarting=3.5 ready=40]", "done restart"],
        id="the new engine is ready: undrained, routed to in its new role",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, YES),
         (63.5, replace(D0, role="prefill", drained=True, engine="starting"))], "failed",
        [*DRAINING, "ask prefill restart", "engine restarting as prefill", "move to prefill",
         "event restarting [drained=3 restarting=3.5]",
         "event failed [drained=3 restarting=3.5] error=d0 restarted as prefill but its engine was not "
         "ready within 60 s (it is routed to once it is)", "undrain",
         "fail timed_out: d0 restarted as prefill but its engine was not ready within 60 s (it is routed to "
         "once it is)"],
        id="the new engine is not ready in time: timed out, undrained (routed to once ready)",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, YES),
         (30.0, replace(D0, role="prefill", dead=True))], "failed",
        [*DRAINING, "ask prefill restart", "engine restarting as prefill", "move to prefill",
         "event restarting [drained=3 restarting=3.5]",
         "event failed [drained=3 restarting=3.5] error=d0 is gone during its role change", "undrain",
         "fail gone: d0 is gone during its role change"],
        id="it died while restarting: the change fails",
    ),
    pytest.param(
        [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, YES), (30.0, Inst("other"))], "failed",
        [*DRAINING, "ask prefill restart", "engine restarting as prefill", "move to prefill",
         "event restarting [drained=3 restarting=3.5]",
         "event failed [drained=3 restarting=3.5] error=d0 is gone during its role change", "undrain",
         "fail gone: d0 is gone during its role change"],
        id="an operator removed it while restarting: the change fails",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("inputs", "phase", "effects"), STORIES)
def test_a_role_change(inputs: list[Input], phase: Phase, effects: list[str]) -> None:
    state, did = run(inputs)
    assert did == effects
    assert state.phase == phase


def test_an_instance_already_in_the_role_changes_nothing() -> None:
    step = steps.begin(snapshot_of(D0).by_id["d0"], "decode", 0.0, LIMITS)
    assert (step.state.phase, said(step.effects)) == ("done", ["done none"])


@pytest.mark.parametrize(
    ("inputs", "ends_with"),
    [
        pytest.param(
            [
                (0.1, RESTART),
                (3.0, replace(D0, drained=True)),
                (3.5, YES),
                (40.0, replace(D0, role="prefill")),
            ],
            ["drain", "event ready [drained=3 restarting=3.5 ready=40]", "done restart"],
            id="an operator had drained it: drained again once ready",
        ),
        pytest.param(
            [(0.1, RESTART), (3.0, replace(D0, dead=True))],
            ["drain", "fail gone: d0 is gone during its role change"],
            id="an operator had drained it: still drained after a failure",
        ),
    ],
)
def test_an_operators_drain_from_before_the_change_is_put_back(
    inputs: list[Input], ends_with: list[str]
) -> None:
    _, did = run(inputs, start=replace(D0, drained=True))
    assert did[-len(ends_with) :] == ends_with


@pytest.mark.parametrize(
    ("inputs", "effects"),
    [
        pytest.param([], [], id="while asking: nothing was drained, nothing to undo"),
        pytest.param([(0.1, RESTART)], ["undrain"], id="while draining: the drain is put back"),
        pytest.param(
            [(0.1, RESTART), (3.0, replace(D0, drained=True)), (3.5, YES)],
            ["undrain"],
            id="while restarting: the drain is put back (the engine comes up in its new role)",
        ),
    ],
)
def test_a_change_abandoned_puts_back_the_drain_it_made(inputs: list[Input], effects: list[str]) -> None:
    state, _ = run(inputs)
    cancelled = steps.cancel(state)
    assert said(cancelled.effects) == effects


@pytest.mark.parametrize(
    ("inputs", "deadline"),
    [
        pytest.param([], None, id="asking: no timer"),
        pytest.param([(0.5, RESTART)], 10.5, id="draining: the drain timeout from the agent's answer"),
        pytest.param(
            [(0.5, RESTART), (2.0, replace(D0, drained=True)), (2.5, YES)],
            62.5,
            id="restarting: the restart timeout from the agent's yes",
        ),
        pytest.param([(0.5, YES)], None, id="done: no timer"),
    ],
)
def test_the_deadline_a_driver_wakes_at(inputs: list[Input], deadline: float | None) -> None:
    state, _ = run(inputs)
    assert state.deadline == deadline


def test_an_answer_nobody_waits_for_changes_nothing() -> None:
    state, _ = run([(0.1, RESTART)])
    assert steps.answered(state, YES, 1.0) == steps.Step(state)


def test_looking_while_an_answer_is_awaited_changes_nothing() -> None:
    state, _ = run([])
    assert steps.step(state, snapshot_of(D0), 1.0) == steps.Step(state)
