"""What an operator said of an instance, apart from any session of it: drained, cordoned, its role
pinned. The registry keeps it per agent id and applies it to every session (an agent that restarts
comes back as it was left); replicas keep it in etcd too (``orchestrator/replicas/intent.py``), so a
new leader, and every follower, knows it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_disagg.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class InstanceIntent:
    """An operator's word on one agent id."""

    drained: bool = False
    cordoned: bool = False
    pinned: bool = False  # its role: the planner leaves it

    @property
    def empty(self) -> bool:
        """Nothing said (the default for every instance)."""
        return self == NO_INTENT

    def to_json(self) -> dict[str, Any]:
        return {"drained": self.drained, "cordoned": self.cordoned, "pinned": self.pinned}

    @classmethod
    def from_json(cls, data: Any) -> InstanceIntent:
        """From ``to_json``'s shape; ``ProtocolError`` for anything else (a hand-edited key)."""
        if not isinstance(data, dict) or any(not isinstance(data.get(k, False), bool) for k in _FIELDS):
            raise ProtocolError(f"an instance's intent is {{{', '.join(_FIELDS)}: bool}}, got {data!r:.200}")
        return cls(**{k: data.get(k, False) for k in _FIELDS})


_FIELDS = ("drained", "cordoned", "pinned")
NO_INTENT = InstanceIntent()


class IntentRecorder(Protocol):
    """Where the leader records operators' intent before acting on it (replicas: etcd); a single
    orchestrator has none (its registry is the record)."""

    async def save_instance(self, agent_id: str, intent: InstanceIntent) -> None:
        """What operators now say of ``agent_id``; ``NotLeader`` when it cannot be recorded."""
        ...

    async def save_removed(self, agent_id: str) -> None:
        """An operator removed the dead instance ``agent_id``."""
        ...

    async def save_weights(self, weights: Mapping[str, Mapping[str, float]]) -> None:
        """Every profile's scorer weights."""
        ...

    async def save_tenants(self, weights: Mapping[str, float]) -> None:
        """The admission queue's tenants' weights, all of them."""
        ...

    async def save_rollout(
        self, model: str, record: Mapping[str, Any], intents: Mapping[str, InstanceIntent]
    ) -> None:
        """A rollout's new state and what it says of instances with it (drains), all at once."""
        ...

    async def save_role(
        self, agent_id: str, record: Mapping[str, Any] | None, intents: Mapping[str, InstanceIntent]
    ) -> None:
        """A role change's new state (None: it ended) and its drain, all at once."""
        ...
