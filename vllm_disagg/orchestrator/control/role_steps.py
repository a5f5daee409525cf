"""A role change's decisions, pure: its state, the agent's answers, a registry snapshot and the time in;
its next state and what to do out.

The instance's agent is asked first (``Ask``: ``set_role``; it checks that the engine can serve the
role). Then one of two ways:

- **routing** (vLLM ``kv_both`` engines, the simulator: they serve either role as they run): on yes the
  registry moves the instance to the other pool at once (``MoveRole``), its session and its requests
  in flight untouched;
- **restart** (a vLLM launched ``kv_producer`` or ``kv_consumer``): the agent answers
  ``restart_required``, and the change goes **drain → restart → ready**: the instance is drained
  (``SetDrain``: no new requests; those on it finish, for at most the drain timeout, and any left then
  fail over like those of a dead engine), asked again with ``restart``, marked restarting and moved
  to its new pool while its agent restarts the engine with the new role's ``kv_role``, and routed to
  once its new engine says it is ready (within the restart timeout). An operator's drain from before
  the change is put back as it was, whatever the outcome.

It fails, saying why (``Fail``), when the agent refuses (``refused``), when the instance dies or its
agent starts a new session meanwhile (``gone``), when the new engine is not ready in time
(``timed_out``), or when a command cannot be delivered (``agent``: the control plane's own error).
Each restart's steps are ``role_restart`` events (``Publish``) with their timeline: seconds since the
change was asked at which it was drained, restarting and ready.

``roles.RoleChanger`` carries the effects out in the orchestrator, and steps on the registry's changes
and the deadlines; the cluster simulator does the same on virtual time (``cluster_sim/control.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import RESTART_REQUIRED, ROLES, Role

Phase = Literal["asking", "draining", "asking_restart", "restarting", "done", "failed"]
How = Literal["none", "routing", "restart"]
Failure = Literal["refused", "gone", "timed_out", "agent"]
ENDED: frozenset[Phase] = frozenset(("done", "failed"))
_PHASES = ("asking", "draining", "asking_restart", "restarting", "done", "failed")
_DRAINED_BY_IT: frozenset[Phase] = frozenset(("draining", "asking_restart", "restarting"))


@dataclass(frozen=True, slots=True)
class Limits:
    """How long a restart's steps may take."""

    drain_timeout_s: float = 30.0  # requests still on it then fail over
    restart_timeout_s: float = 600.0  # its new engine must be ready within this


@dataclass(frozen=True, slots=True)
class RoleState:
    """One instance's role change."""

    agent_id: str
    old: Role
    new: Role
    started: float  # monotonic: when the change was asked
    session: int  # the session it was asked in: another one means its agent started over
    was_draining: bool  # an operator's drain from before: put back afterwards
    limits: Limits = Limits()
    phase: Phase = "asking"
    how: How = "none"
    deadline: float | None = None  # monotonic: the drain's or the restart's end; None: no timer runs
    timeline: tuple[tuple[str, float], ...] = ()  # (step, seconds since ``started``)
    left_in_flight: int = 0  # requests still on it when the drain timed out (they failed over)

    def record(self, monotonic: float, wall: float) -> dict[str, Any]:
        """What etcd keeps of it (replicas): its times on the wall clock, which every host shares."""

        def on_wall(t: float | None) -> float | None:
            return None if t is None else wall - (monotonic - t)

        return {
            "agent_id": self.agent_id,
            "old": self.old,
            "new": self.new,
            "started": on_wall(self.started),
            "was_draining": self.was_draining,
            "limits": [self.limits.drain_timeout_s, self.limits.restart_timeout_s],
            "phase": self.phase,
            "how": self.how,
            "deadline": on_wall(self.deadline),
            "timeline": [list(t) for t in self.timeline],
            "left_in_flight": self.left_in_flight,
        }

    @classmethod
    def from_record(cls, data: Any, session: int, monotonic: float, wall: float) -> RoleState:
        """``record``'s shape back, on this host's clock, in ``session`` (the instance's here);
        ``ValueError`` naming what is wrong."""
        try:
            deadline = data["deadline"]
            state = cls(
                str(data["agent_id"]),
                data["old"],
                data["new"],
                monotonic - (wall - float(data["started"])),
                session,
                bool(data["was_draining"]),
                Limits(float(data["limits"][0]), float(data["limits"][1])),
                data["phase"],
                data["how"],
                None if deadline is None else monotonic - (wall - float(deadline)),
                tuple((str(step), float(at)) for step, at in data["timeline"]),
                int(data["left_in_flight"]),
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"a recorded role change that cannot be read ({exc}): {data!r:.200}") from None
        if state.phase not in _PHASES or state.old not in ROLES or state.new not in ROLES:
            raise ValueError(
                f"a recorded role change with phase {state.phase!r}, {state.old!r} -> {state.new!r}"
            )
        return state

    def mark(self, step: str, now: float) -> RoleState:
        """The state with ``step`` reached at ``now`` on its timeline."""
        return replace(self, timeline=(*self.timeline, (step, round(now - self.started, 3))))


@dataclass(frozen=True, slots=True)
class Answer:
    """The agent's answer to ``set_role``: its Ack, or why none came (``delivered`` False)."""

    ok: bool
    code: str = ""  # the Ack's code: ``restart_required`` asks for the restart way
    error: str = ""  # the Ack's reason, or the command's failure
    delivered: bool = True


# --- effects ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """Send ``set_role`` (with ``restart``: now restart the engine in it); the answer comes back
    through ``answered``."""

    agent_id: str
    role: Role
    restart: bool = False


@dataclass(frozen=True, slots=True)
class SetDrain:
    """The registry's operator drain flag; routing follows with the next request (nothing, when the
    instance is no longer registered)."""

    agent_id: str
    draining: bool


@dataclass(frozen=True, slots=True)
class MoveRole:
    """The registry serves the instance as ``role`` from the next decision on (same session)."""

    agent_id: str
    role: Role


@dataclass(frozen=True, slots=True)
class EngineRestarting:
    """Its engine is restarting: not routed to until a heartbeat says ready, and what is on it fails
    over (the agent's Ack comes before the heartbeat that would say so)."""

    agent_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Publish:
    """A ``role_restart`` event: the step reached, the timeline so far, and what went wrong."""

    step: str
    timeline: tuple[tuple[str, float], ...]
    left_in_flight: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Done:
    """The instance serves as its new role (``how``)."""

    how: How


@dataclass(frozen=True, slots=True)
class Fail:
    """The change did not happen: ``failure`` picks the error the operator gets, ``message`` says it."""

    failure: Failure
    message: str


Effect = Ask | SetDrain | MoveRole | EngineRestarting | Publish | Done | Fail


@dataclass(frozen=True, slots=True)
class Step:
    """A role change's next state and what to do, in order."""

    state: RoleState
    effects: tuple[Effect, ...] = ()

    @property
    def ask(self) -> Ask | None:
        """The command whose answer the change waits for, if it asked one."""
        return next((e for e in self.effects if isinstance(e, Ask)), None)


# --- transitions --------------------------------------------------------------------------------------


def begin(view: InstanceView, role: Role, now: float, limits: Limits = Limits()) -> Step:
    """Change ``view``'s instance to ``role``: ask its agent (nothing to do when it has that role)."""
    state = RoleState(view.agent_id, view.info.role, role, now, view.session, view.admin_draining, limits)
    if role == view.info.role:
        return Step(replace(state, phase="done"), (Done("none"),))
    return Step(state, (Ask(view.agent_id, role),))


def answered(state: RoleState, answer: Answer, now: float) -> Step:
    """The agent answered the ``Ask`` (or the command failed)."""
    if state.phase == "asking":
        return _first_answer(state, answer, now)
    if state.phase == "asking_restart":
        return _restart_answer(state, answer, now)
    return Step(state)  # an answer nobody waits for any more


def _first_answer(state: RoleState, answer: Answer, now: float) -> Step:
    if answer.ok:
        done = replace(state, phase="done", how="routing")
        return Step(done, (MoveRole(state.agent_id, state.new), Done("routing")))
    if not answer.delivered:
        return Step(replace(state, phase="failed"), (Fail("agent", answer.error),))
    if answer.code != RESTART_REQUIRED:
        return Step(replace(state, phase="failed"), (Fail("refused", _refusal(state, answer)),))
    deadline = now + state.limits.drain_timeout_s
    draining = replace(state, phase="draining", how="restart", deadline=deadline)
    return Step(draining, (SetDrain(state.agent_id, True), Publish("draining", draining.timeline)))


def _restart_answer(state: RoleState, answer: Answer, now: float) -> Step:
    if not answer.ok:
        failure: Failure = "agent" if not answer.delivered else "refused"
        return _failed(state, failure, answer.error if failure == "agent" else _refusal(state, answer))
    # Marked restarting first: the old engine must not look ready while the new one starts.
    restarting = replace(
        state.mark("restarting", now), phase="restarting", deadline=now + state.limits.restart_timeout_s
    )
    return Step(
        restarting,
        (
            EngineRestarting(state.agent_id, f"restarting as {state.new}"),
            MoveRole(state.agent_id, state.new),
            Publish("restarting", restarting.timeline, restarting.left_in_flight),
        ),
    )


def resume(state: RoleState) -> Step:
    """Go on with a change another orchestrator (the last leader) left at ``state``: ask again what it
    may have asked (``set_role`` is the same answer twice: an engine that has restarted in the new
    role serves it as it runs), or look again."""
    if state.phase == "asking":
        return Step(state, (Ask(state.agent_id, state.new),))
    if state.phase == "asking_restart":
        return Step(state, (Ask(state.agent_id, state.new, True),))
    return Step(state)


def step(state: RoleState, snap: RegistrySnapshot, now: float) -> Step:
    """Look again: a drain that ended (or timed out), a new engine ready (or late), an instance gone.
    Nothing changes while the change waits for an answer or has ended."""
    if state.phase == "draining":
        return _draining(state, snap, now)
    if state.phase == "restarting":
        return _restarting(state, snap, now)
    return Step(state)


def _draining(state: RoleState, snap: RegistrySnapshot, now: float) -> Step:
    left = snap.in_flight_of(state.agent_id)
    assert state.deadline is not None
    if left and now < state.deadline:
        return Step(state)
    drained = replace(state.mark("drained", now), left_in_flight=left)
    gone = _gone(drained, snap)
    if gone:
        return _failed(drained, "gone", gone)
    return Step(
        replace(drained, phase="asking_restart", deadline=None), (Ask(state.agent_id, state.new, True),)
    )


def _restarting(state: RoleState, snap: RegistrySnapshot, now: float) -> Step:
    gone = _gone(state, snap)
    if gone:
        return _failed(state, "gone", gone)
    view = snap.by_id[state.agent_id]
    if view.engine_state == "ready" and view.kv_link_ready:  # a new engine: its KV link proven too
        ready = replace(state.mark("ready", now), phase="done", deadline=None)
        restore = SetDrain(state.agent_id, state.was_draining)
        return Step(ready, (restore, Publish("ready", ready.timeline, ready.left_in_flight), Done("restart")))
    assert state.deadline is not None
    if now < state.deadline:
        return Step(state)
    limit = state.limits.restart_timeout_s
    return _failed(
        state,
        "timed_out",
        f"{state.agent_id} restarted as {state.new} but its engine was not ready within {limit:g} s "
        "(it is routed to once it is)",
    )


def cancel(state: RoleState) -> Step:
    """The change is abandoned (its caller went away, the orchestrator stops): a drain it made is put
    back as it was."""
    if state.phase not in _DRAINED_BY_IT:
        return Step(state)
    return Step(replace(state, phase="failed"), (SetDrain(state.agent_id, state.was_draining),))


def _failed(state: RoleState, failure: Failure, message: str) -> Step:
    """A restart under way failed: said in its event, the drain put back, then the failure."""
    return Step(
        replace(state, phase="failed", deadline=None),
        (
            Publish("failed", state.timeline, state.left_in_flight, message),
            SetDrain(state.agent_id, state.was_draining),
            Fail(failure, message),
        ),
    )


def _gone(state: RoleState, snap: RegistrySnapshot) -> str:
    """Why the change cannot go on with this instance ("" while it can)."""
    view = snap.by_id.get(state.agent_id)
    if view is None or view.state == "dead":
        return f"{state.agent_id} is gone during its role change"
    if view.session != state.session:
        return f"{state.agent_id} started a new session during its role change"
    return ""


def _refusal(state: RoleState, answer: Answer) -> str:
    return f"{state.agent_id} cannot serve as {state.new}: {answer.error}"
