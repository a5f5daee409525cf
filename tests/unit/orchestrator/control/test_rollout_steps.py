"""A rollout's decisions, one operator's situation per row: what drains, when it is complete, what a
pause, a resume and a rollback do, and when a rollout cannot start."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from tests.unit.orchestrator.control.control_support import MODEL, Inst, snapshot_of
from vllm_disagg.errors import RequestError, RolloutConflict, RolloutInvalid, RolloutNotFound
from vllm_disagg.orchestrator.control import rollout_steps as steps
from vllm_disagg.orchestrator.control.rollout_steps import (
    Admit,
    Drain,
    Effect,
    Phase,
    Publish,
    RolloutState,
    Settle,
)

OLD_P, OLD_D = Inst("p-r1", "prefill"), Inst("d-r1", "decode")
NEW_P, NEW_D = Inst("p-r2", "prefill", "r2"), Inst("d-r2", "decode", "r2")
NEW_D2 = Inst("d2-r2", "decode", "r2")


def said(effects: Sequence[Effect]) -> list[str]:
    """Effects as an operator would read them."""
    out = []
    for e in effects:
        if isinstance(e, Drain):
            out.append(f"{'drain' if e.draining else 'undrain'} {e.agent_id}")
        elif isinstance(e, Publish):
            out.append(f"event {e.what}" + (f" {e.instance}" if e.instance else "") + f" ({e.phase})")
        elif isinstance(e, Settle):
            out.append(f"settle {e.revision}")
        elif isinstance(e, Admit):
            out.append(f"admit {e.old}+{e.new}")
    return out


def rolling(
    phase: Phase = "rolling", drained: tuple[str, ...] = (), held: tuple[str, ...] = ()
) -> RolloutState:
    return RolloutState(MODEL, "r1", "r2", 0.0, phase, drained, held)


# --- rolling forward ----------------------------------------------------------------------------------

STEPS = [
    pytest.param(
        rolling(), [OLD_P, OLD_D], [], "rolling", [],
        id="no new instance yet: nothing drains",
    ),
    pytest.param(
        rolling(), [OLD_P, OLD_D, replace(NEW_D, engine="starting")], [], "rolling", [],
        id="a new instance still starting drains nothing",
    ),
    pytest.param(
        rolling(), [OLD_P, OLD_D, NEW_D], ["d-r1"], "rolling",
        ["drain d-r1", "event drained d-r1 (rolling)"],
        id="a new decode instance ready: one old decode instance drains, the old prefill serves on",
    ),
    pytest.param(
        rolling(), [OLD_P, Inst("d1-r1", in_flight=3), Inst("d2-r1"), NEW_D], ["d2-r1"], "rolling",
        ["drain d2-r1", "event drained d2-r1 (rolling)"],
        id="the least busy old instance of the role drains first",
    ),
    pytest.param(
        rolling(), [OLD_P, OLD_D, NEW_P, NEW_D], ["d-r1", "p-r1"], "rolling",
        ["drain d-r1", "event drained d-r1 (rolling)", "drain p-r1", "event drained p-r1 (rolling)"],
        id="as many new instances ready as old ones: every old instance drains, role by role",
    ),
    pytest.param(
        rolling(),
        [Inst("p1-r1", "prefill"), Inst("p2-r1", "prefill"), OLD_D, NEW_P, NEW_D, NEW_D2],
        ["d-r1", "p1-r1", "p2-r1"], "rolling",
        ["drain d-r1", "event drained d-r1 (rolling)", "drain p1-r1", "event drained p1-r1 (rolling)",
         "drain p2-r1", "event drained p2-r1 (rolling)"],
        id="once the new revision is as big as the old, every old one drains, even in a role with fewer new",
    ),
    pytest.param(
        rolling(drained=("d-r1",)), [OLD_P, replace(OLD_D, drained=True), NEW_D], [], "rolling", [],
        id="an old instance drained already is not drained again",
    ),
    pytest.param(
        rolling(), [OLD_P, replace(OLD_D, drained=True), Inst("d2-r1"), NEW_D], [], "rolling", [],
        id="an old instance an operator drained counts as one gone",
    ),
    pytest.param(
        rolling(drained=("d-r1",)), [OLD_P, replace(OLD_D, drained=True), replace(NEW_D, dead=True)], [],
        "rolling", [],
        id="the new instance died: nothing more drains and nothing is undrained (the operator rolls back)",
    ),
    pytest.param(
        rolling(drained=("d-r1", "p-r1")),
        [replace(OLD_P, drained=True), replace(OLD_D, drained=True, in_flight=2), NEW_P, NEW_D], [],
        "rolling", [],
        id="every old instance drained but one still busy: not complete yet",
    ),
    pytest.param(
        rolling(drained=("d-r1", "p-r1")),
        [replace(OLD_P, drained=True), replace(OLD_D, drained=True), NEW_P, NEW_D], [], "complete",
        ["settle r2", "event complete (complete)"],
        id="every old instance drained and idle: complete, and Hellos are held to the new revision",
    ),
    pytest.param(
        rolling(drained=("d-r1", "p-r1")),
        [replace(OLD_P, drained=True), replace(OLD_D, drained=True), replace(NEW_D, engine="unhealthy")], [],
        "rolling", [],
        id="old ones drained and idle but no new instance ready: not complete",
    ),
    pytest.param(
        rolling(drained=("d-r1",)), [replace(OLD_D, drained=True), replace(OLD_P, dead=True), NEW_D], [],
        "complete", ["settle r2", "event complete (complete)"],
        id="a dead old instance is not waited for",
    ),
    pytest.param(
        rolling(),
        [OLD_P, OLD_D, NEW_D, Inst("other-d", model="other"), Inst("other-d2", revision="r2", model="other")],
        ["d-r1"], "rolling", ["drain d-r1", "event drained d-r1 (rolling)"],
        id="another model's instances are not touched",
    ),
    pytest.param(
        rolling("paused"), [OLD_P, OLD_D, NEW_P, NEW_D], [], "paused", [],
        id="a paused rollout drains nothing however many new instances are ready",
    ),
    pytest.param(
        rolling("complete", drained=("d-r1",)), [replace(OLD_D, drained=True), NEW_D], [], "complete", [],
        id="a complete rollout does nothing more",
    ),
    pytest.param(
        rolling("rolling_back"), [OLD_P, OLD_D, NEW_P, NEW_D], ["d-r2", "p-r2"], "rolling_back",
        ["drain d-r2", "event drained d-r2 (rolling_back)",
         "drain p-r2", "event drained p-r2 (rolling_back)"],
        id="rolling back: the new instances drain as the old ones are ready again",
    ),
    pytest.param(
        rolling("rolling_back"), [replace(OLD_P, engine="starting"), OLD_D, NEW_P, NEW_D], ["d-r2"],
        "rolling_back", ["drain d-r2", "event drained d-r2 (rolling_back)"],
        id="rolling back: a role whose old instance is not ready again keeps its new one",
    ),
    pytest.param(
        rolling("rolling_back", held=("d-r2", "p-r2")),
        [OLD_P, OLD_D, replace(NEW_P, drained=True), replace(NEW_D, drained=True)], [], "rolled_back",
        ["settle r1", "event rolled_back (rolled_back)"],
        id="rolled back once every new instance is drained and idle: Hellos held to the old revision",
    ),
    pytest.param(
        rolling("rolled_back", held=("d-r2",)), [OLD_D, replace(NEW_D, drained=True)], [], "rolled_back", [],
        id="a rolled-back rollout does nothing more",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("state", "cluster", "drains", "phase", "effects"), STEPS)
def test_a_step(
    state: RolloutState, cluster: list[Inst], drains: list[str], phase: Phase, effects: list[str]
) -> None:
    step = steps.step(state, snapshot_of(*cluster))
    assert said(step.effects) == effects
    assert step.state.phase == phase
    moved = step.state.held if state.phase == "rolling_back" else step.state.drained
    before = state.held if state.phase == "rolling_back" else state.drained
    assert list(moved) == [*before, *drains], "what it drained is remembered, in order"


def test_a_step_is_a_function_of_its_inputs() -> None:
    state, snap = rolling(), snapshot_of(OLD_P, OLD_D, NEW_D)
    assert steps.step(state, snap) == steps.step(state, snap)
    assert state == rolling(), "the state given is left as it was"


# --- the operator's actions ---------------------------------------------------------------------------

ACTIONS = [
    pytest.param("pause", rolling(), "paused", ["event paused (paused)"], id="pause a rolling rollout"),
    pytest.param(
        "resume", rolling("paused"), "rolling", ["event resumed (rolling)"], id="resume a paused one"
    ),
    pytest.param(
        "rollback", rolling(drained=("d-r1", "p-r1")), "rolling_back",
        ["undrain d-r1", "undrain p-r1", "event rolling_back (rolling_back)"],
        id="roll back a rolling rollout: the old instances it drained are undrained at once",
    ),
    pytest.param(
        "rollback", rolling("paused", drained=("d-r1",)), "rolling_back",
        ["undrain d-r1", "event rolling_back (rolling_back)"], id="roll back a paused one",
    ),
    pytest.param(
        "rollback", rolling("complete", drained=("d-r1", "p-r1")), "rolling_back",
        ["undrain d-r1", "undrain p-r1", "event rolling_back (rolling_back)"],
        id="roll back a complete one (the old instances are still registered)",
    ),
    pytest.param(
        "rollback", rolling(drained=("gone-r1", "d-r1")), "rolling_back",
        ["undrain d-r1", "event rolling_back (rolling_back)"],
        id="roll back after an old instance was removed: only those still registered are undrained",
    ),
    pytest.param("pause", rolling("paused"), RolloutConflict, [], id="pause twice: conflict"),
    pytest.param("pause", rolling("complete"), RolloutConflict, [], id="pause a complete rollout: conflict"),
    pytest.param("resume", rolling(), RolloutConflict, [], id="resume a rolling rollout: conflict"),
    pytest.param("rollback", rolling("rolling_back"), RolloutConflict, [], id="roll back twice: conflict"),
    pytest.param(
        "rollback", rolling("rolled_back"), RolloutConflict, [], id="roll back a rolled-back one: conflict"
    ),
]  # fmt: skip


@pytest.mark.parametrize(("action", "state", "outcome", "effects"), ACTIONS)
def test_an_operators_action(
    action: str, state: RolloutState, outcome: Phase | type[RequestError], effects: list[str]
) -> None:
    snap = snapshot_of(replace(OLD_P, drained=True), replace(OLD_D, drained=True), NEW_P, NEW_D)
    act: Callable[[], steps.Step] = {
        "pause": lambda: steps.pause(state),
        "resume": lambda: steps.resume(state),
        "rollback": lambda: steps.rollback(state, snap),
    }[action]
    if isinstance(outcome, type):
        with pytest.raises(outcome, match=f"is {state.phase}"):
            act()
        return
    step = act()
    assert (step.state.phase, said(step.effects)) == (outcome, effects)
    if action == "rollback":
        assert step.state.drained == (), "nothing it drained is drained any more"


# --- starting -----------------------------------------------------------------------------------------

BEGIN = [
    pytest.param(None, "r2", [OLD_P, OLD_D], {}, ("m", "r1"), id="the one model served, named or not"),
    pytest.param("m", "r2", [OLD_P, OLD_D], {}, ("m", "r1"), id="the model named"),
    pytest.param(
        "m", "r2", [OLD_P, OLD_D, replace(NEW_D, engine="starting")], {"m": rolling("rolled_back")},
        ("m", "r1"), id="again after a rollback, the new revision's instances still there",
    ),
    pytest.param(
        "m", "r3", [OLD_D, NEW_D], {"m": rolling("complete")}, RolloutConflict,
        id="two revisions serve (the last one's old instances not shut down) and a third is asked: conflict",
    ),
    pytest.param(
        "m", "r2", [OLD_D, replace(NEW_D, drained=True)], {"m": rolling("rolled_back")}, ("m", "r1"),
        id="two revisions serve, one of them the target: from the other",
    ),
    pytest.param(
        None, "r2", [OLD_D, Inst("x", model="other")], {}, RolloutInvalid, id="two models, none named"
    ),
    pytest.param("nope", "r2", [OLD_D], {}, RolloutNotFound, id="a model nobody serves"),
    pytest.param(
        "m", "r2", [replace(OLD_D, dead=True)], {}, RolloutNotFound, id="a model only dead instances serve"
    ),
    pytest.param("m", "r2", [OLD_D], {"m": rolling()}, RolloutConflict, id="a rollout under way: conflict"),
    pytest.param(
        "m", "r3", [OLD_D], {"m": rolling("paused")}, RolloutConflict, id="a paused one is under way too"
    ),
    pytest.param("m", "r1", [OLD_D], {}, RolloutConflict, id="served by that revision already: conflict"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "to", "cluster", "rollouts", "outcome"), BEGIN)
def test_starting_a_rollout(
    model: str | None,
    to: str,
    cluster: list[Inst],
    rollouts: dict[str, RolloutState],
    outcome: tuple[str, str] | type[RequestError],
) -> None:
    snap = snapshot_of(*cluster)
    if isinstance(outcome, type):
        with pytest.raises(outcome):
            steps.begin(snap, model, to, rollouts, 5.0)
        return
    step = steps.begin(snap, model, to, rollouts, 5.0)
    name, old = outcome
    assert step.state == RolloutState(name, old, to, 5.0)
    assert said(step.effects) == [f"admit {old}+{to}", "event started (rolling)"]


def test_the_admin_view_lists_both_revisions_live_instances() -> None:
    snap = snapshot_of(replace(OLD_D, drained=True, in_flight=2), replace(OLD_P, dead=True), NEW_D)
    view = rolling(drained=("d-r1",)).to_json(snap)
    assert view["old"] == [{"agent_id": "d-r1", "role": "decode", "state": "draining", "in_flight": 2}]
    assert view["new"] == [{"agent_id": "d-r2", "role": "decode", "state": "ready", "in_flight": 0}]
    assert (view["from"], view["to"], view["phase"], view["drained"]) == ("r1", "r2", "rolling", ["d-r1"])
