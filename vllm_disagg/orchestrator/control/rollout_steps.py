"""A rollout's decisions, pure: its state and a registry snapshot in, its next state and what to do out.

A rollout moves one model's load from one revision to another. Its steps:

- **start** (``begin``): the operator names the new revision; Hellos of both revisions are admitted
  from now on (``Admit``). Refused when the model is unknown or has no live instance, when another
  rollout of it is under way, when it is served by that revision already, or by several;
- **rolling** (``step``): one old instance is drained for each new one that is ready, role by role,
  least busy first; all of them once the new revision has as many ready instances as the old had.
  A drained instance takes no new request and finishes those it has, so no client sees an error;
- **complete**: every old instance is drained and idle (and a new one is ready); new Hellos of the
  model are held to the new revision's settings (``Settle``); the old instances stay registered,
  drained, for the operator to shut down;
- **pause** stops draining where it is, **resume** goes on;
- **rollback** undrains the old instances this rollout drained and moves the load back the same way,
  draining one new instance for each old one ready again (``rolling_back``, then ``rolled_back``).

Until the new revision is as big as the old, a role loses an old instance only for a new one of that
role that is ready; after that the rest drain whatever their role (a role the new revision has fewer
instances of then runs on fewer). A new instance that dies stops the draining (it no longer counts as
ready) and undrains nothing; the operator rolls back. A rollout has no deadline: it waits on the
registry as long as its instances take, so its steps need no clock. Each step's effects are carried
out by ``rollout.Rollouts`` in the orchestrator and by the cluster simulator (``cluster_sim/control.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from vllm_disagg.errors import RolloutConflict, RolloutInvalid, RolloutNotFound
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

Phase = Literal["rolling", "paused", "complete", "rolling_back", "rolled_back"]
_PHASES = ("rolling", "paused", "complete", "rolling_back", "rolled_back")
UNDER_WAY: frozenset[Phase] = frozenset(("rolling", "paused", "rolling_back"))  # one per model at a time
MOVING: frozenset[Phase] = frozenset(("rolling", "rolling_back"))  # what ``step`` moves on


@dataclass(frozen=True, slots=True)
class RolloutState:
    """One model's rollout."""

    model: str
    from_revision: str
    to_revision: str
    started_at: float  # wall
    phase: Phase = "rolling"
    drained: tuple[str, ...] = ()  # old instances this rollout drained, in order
    held: tuple[str, ...] = ()  # new instances it drained rolling back

    def record(self) -> dict[str, Any]:
        """What etcd keeps of it (replicas: ``orchestrator/replicas/intent.py``)."""
        return {
            "model": self.model,
            "from": self.from_revision,
            "to": self.to_revision,
            "started_at": self.started_at,
            "phase": self.phase,
            "drained": list(self.drained),
            "held": list(self.held),
        }

    @classmethod
    def from_record(cls, data: Any) -> RolloutState:
        """``record``'s shape back; ``RolloutInvalid`` naming what is wrong (a hand-edited key)."""
        try:
            phase = data["phase"]
            if phase not in _PHASES:
                raise ValueError(f"phase {phase!r}")
            state = cls(
                str(data["model"]),
                str(data["from"]),
                str(data["to"]),
                float(data["started_at"]),
                phase,
                tuple(str(a) for a in data["drained"]),
                tuple(str(a) for a in data["held"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutInvalid(f"a recorded rollout that cannot be read ({exc}): {data!r:.200}") from None
        return state

    def to_json(self, snap: RegistrySnapshot) -> dict[str, Any]:
        """The admin API's view, with both revisions' live instances as ``snap`` has them."""

        def of(revision: str) -> list[dict[str, Any]]:
            return [
                {
                    "agent_id": v.agent_id,
                    "role": v.info.role,
                    "state": v.state,
                    "in_flight": snap.in_flight_of(v.agent_id),
                }
                for v in snap.instances
                if v.info.model == self.model and v.info.revision == revision and v.state != "dead"
            ]

        return {
            "model": self.model,
            "from": self.from_revision,
            "to": self.to_revision,
            "phase": self.phase,
            "started_at": self.started_at,
            "drained": list(self.drained),
            "held": list(self.held),
            "old": of(self.from_revision),
            "new": of(self.to_revision),
        }


# --- effects ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Accept Hellos of ``model`` at revision ``old`` or ``new``, each held to its first instance."""

    model: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class Drain:
    """Drain (or undrain) an instance: the registry's flag at once, so routing follows with the next
    request, and its agent told (best effort: the flag already routes around it)."""

    agent_id: str
    draining: bool


@dataclass(frozen=True, slots=True)
class Settle:
    """From now on, new Hellos of ``model`` are held to ``revision``'s settings."""

    model: str
    revision: str


@dataclass(frozen=True, slots=True)
class Publish:
    """A ``rollout`` event: ``what`` happened, the phase then, and the instance it concerns, if one."""

    what: str
    phase: Phase
    instance: str | None = None


Effect = Admit | Drain | Settle | Publish


@dataclass(frozen=True, slots=True)
class Step:
    """A rollout's next state and what to do, in order."""

    state: RolloutState
    effects: tuple[Effect, ...] = ()


# --- the operator's actions ---------------------------------------------------------------------------


def begin(
    snap: RegistrySnapshot,
    model: str | None,
    to_revision: str,
    rollouts: Mapping[str, RolloutState],
    wall: float,
) -> Step:
    """Start rolling ``model`` (the only one served, when None) to ``to_revision``; ``rollouts``: every
    model's last rollout. ``RolloutInvalid``, ``RolloutNotFound`` or ``RolloutConflict`` says why not."""
    live_models = sorted({v.info.model for v in snap.instances if v.state != "dead"})
    if model is None:
        if len(live_models) != 1:
            raise RolloutInvalid(f"name the model: served models are {live_models}")
        model = live_models[0]
    live = [v for v in snap.instances if v.info.model == model and v.state != "dead"]
    if not live:
        raise RolloutNotFound(f"no live instance serves model {model!r}")
    current = rollouts.get(model)
    if current is not None and current.phase in UNDER_WAY:
        raise RolloutConflict(
            f"model {model!r} is already rolling to {current.to_revision!r} ({current.phase})"
        )
    revisions = sorted({v.info.revision for v in live})
    if revisions == [to_revision]:
        raise RolloutConflict(f"model {model!r} is served by revision {to_revision!r} already")
    others = sorted(set(revisions) - {to_revision})
    if len(revisions) > 1 and len(others) != 1:
        raise RolloutConflict(f"model {model!r} is served by several revisions {others}: finish one first")
    state = RolloutState(model, others[0], to_revision, wall)
    return Step(state, (Admit(model, state.from_revision, to_revision), Publish("started", "rolling")))


def pause(state: RolloutState) -> Step:
    """Stop draining where it is (both revisions serve) until ``resume``."""
    _expect(state, ("rolling",))
    return Step(replace(state, phase="paused"), (Publish("paused", "paused"),))


def resume(state: RolloutState) -> Step:
    """Go on with a paused rollout."""
    _expect(state, ("paused",))
    return Step(replace(state, phase="rolling"), (Publish("resumed", "rolling"),))


def rollback(state: RolloutState, snap: RegistrySnapshot) -> Step:
    """Undrain the old instances this rollout drained (those still registered); the new revision's
    drain as the old ones are ready again."""
    _expect(state, ("rolling", "paused", "complete"))
    undrain = tuple(Drain(a, False) for a in state.drained if a in snap.by_id)
    back = replace(state, phase="rolling_back", drained=())
    return Step(back, (*undrain, Publish("rolling_back", "rolling_back")))


def _expect(state: RolloutState, phases: tuple[Phase, ...]) -> None:
    if state.phase not in phases:
        raise RolloutConflict(f"the rollout of {state.model!r} is {state.phase}")


# --- the rollout's own steps --------------------------------------------------------------------------


def step(state: RolloutState, snap: RegistrySnapshot) -> Step:
    """Drain old instances as new ones are ready; complete once the old ones are drained and idle.
    A paused, complete or rolled-back rollout does nothing."""
    if state.phase == "rolling":
        drained, effects, done = _move(state, snap, state.from_revision, state.to_revision)
        state = replace(state, drained=state.drained + drained)
        if done:
            state = replace(state, phase="complete")
            effects += (Settle(state.model, state.to_revision), Publish("complete", "complete"))
        return Step(state, effects)
    if state.phase == "rolling_back":
        held, effects, done = _move(state, snap, state.to_revision, state.from_revision)
        state = replace(state, held=state.held + held)
        if done:
            state = replace(state, phase="rolled_back")
            effects += (Settle(state.model, state.from_revision), Publish("rolled_back", "rolled_back"))
        return Step(state, effects)
    return Step(state)


def _move(
    state: RolloutState, snap: RegistrySnapshot, source: str, target: str
) -> tuple[tuple[str, ...], tuple[Effect, ...], bool]:
    """Drain one ``source`` instance per ready ``target`` one, role by role (all of them once as many
    ``target`` instances are ready): the instances drained now, the effects, and whether every
    ``source`` instance is drained and idle (with a ``target`` one ready)."""
    old: list[InstanceView] = []
    ready: list[InstanceView] = []
    for v in snap.instances:
        if v.info.model == state.model and v.state != "dead":
            if v.info.revision == source:
                old.append(v)
            elif v.info.revision == target and v.state == "ready":
                ready.append(v)
    everyone = len(ready) >= len(old)
    drained: list[str] = []
    effects: list[Effect] = []
    for role in sorted({v.info.role for v in old}):
        mine = [v for v in old if v.info.role == role]
        gone = sum(v.admin_draining for v in mine)
        wanted = len(mine) if everyone else min(len(mine), sum(v.info.role == role for v in ready))
        idle_first = sorted(
            (v for v in mine if not v.admin_draining),
            key=lambda v: (snap.in_flight_of(v.agent_id), v.agent_id),
        )
        for v in idle_first[: max(0, wanted - gone)]:
            drained.append(v.agent_id)
            effects += (Drain(v.agent_id, True), Publish("drained", state.phase, v.agent_id))
    # Drained as the snapshot has it: one drained now counts from the next step on, once the registry
    # says so (its change is what wakes the next step).
    done = bool(ready) and all(v.admin_draining and snap.in_flight_of(v.agent_id) == 0 for v in old)
    return tuple(drained), tuple(effects), done
