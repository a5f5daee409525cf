"""Operators' intent, kept in etcd: the leader writes it in its own term, every replica applies it.

Keys under ``/vllm-disagg/<cluster>/intent/``:

- ``instances/<agent id>``: ``{"drained", "cordoned", "pinned"}`` (``state/intent.py``), or
  ``{"removed": true}`` for a dead instance an operator removed; deleted when nothing is said any more;
- ``scheduler/weights``: every profile's scorer weights, ``{profile: {scorer: weight}}``;
- ``admission/tenants``: the admission queue's tenants' weights, ``{tenant: weight}`` (the configured
  ones included: a tenant left out weighs 1.0); once written, it is every replica's, whatever its flags;
- ``planner``: the leader's planner memory (its streak and the time of its last shift, in wall time)
  and the config it plans with;
- ``roles/<agent id>``: a role change under way (``RoleState.record``), with its drain, so a new
  leader finishes what the last one began (gone once it ended);
- ``rollouts/<model>``: a rollout's state (``RolloutState.record``), written in one transaction with
  the drains of the step that made it, so a new leader goes on from exactly where the old one was.

A write is one etcd transaction that succeeds only while the leader key is still this replica's term
(its ``create_revision`` is the epoch): a leader that has lost etcd, or been replaced, cannot write, and
the admin call that asked is answered 503 with the reason (``NotLeader``), so nothing is recorded that
the cluster does not keep. The admin API writes first and acts after: what it did is always in etcd.

Every replica reads the prefix at start and then follows it (a broken watch is followed by a fresh
read), applying each key to its registry (``Registry.apply_intent``) and its scheduler: followers route
as the leader does, a new leader starts from the same intent, and an agent that restarts comes back as
operators left it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.clock import Clock
from vllm_disagg.errors import DisaggError, NotLeader
from vllm_disagg.etcd.client import EtcdClient, EtcdError, KeyValue
from vllm_disagg.orchestrator.state.intent import NO_INTENT, InstanceIntent
from vllm_disagg.orchestrator.state.leadership import Leadership
from vllm_disagg.orchestrator.state.registry import Registry

log = logging.getLogger(__name__)
_RETRY_S = 0.5  # after a broken watch or an unreachable etcd, read again this soon
Weights = Mapping[str, Mapping[str, float]]


class DurableIntent:
    """Writes operators' intent to etcd (the leader) and applies what etcd holds (every replica)."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        leader_key: str,
        leadership: Leadership,
        registry: Registry,
        clock: Clock,
        *,
        weights: Callable[[], dict[str, dict[str, float]]] | None = None,
        set_weights: Callable[[Weights], Any] | None = None,
    ) -> None:
        self._client = client
        self._prefix = f"{prefix}intent/"
        self._leader_key = leader_key
        self._leadership = leadership
        self._registry = registry
        self._clock = clock
        self._weights = weights
        self._set_weights = set_weights
        # A rollout as etcd holds it (model, its record or None): the replica's ``Rollouts.adopt``.
        self.on_rollout: Callable[[str, Any], None] | None = None
        self.on_planner: Callable[[Any], None] | None = None
        self.on_tenants: Callable[[Any], None] | None = None  # tenants' weights: the gateway's admission
        self.on_role: Callable[[str, Any], None] | None = (
            None  # a role change under way: ``adopt``  # the planner's recorded memory: ``adopt``
        )
        self.loaded = asyncio.Event()  # the first full read was applied
        self.applied = 0  # keys applied (tests and the admin API read it)

    # --- the leader's writes ---------------------------------------------------------------------

    async def save_instance(self, agent_id: str, intent: InstanceIntent) -> None:
        """Record what operators now say of ``agent_id`` (nothing: the key goes); ``NotLeader`` when
        this replica cannot (it does not lead, or etcd is unreachable)."""
        value = None if intent.empty else jsonutil.dumps(intent.to_json())
        await self._write(f"instances/{agent_id}", value, f"{agent_id}'s intent")

    async def save_removed(self, agent_id: str) -> None:
        """Record that an operator removed the dead instance ``agent_id``."""
        await self._write(f"instances/{agent_id}", jsonutil.dumps({"removed": True}), f"{agent_id}'s removal")

    async def save_weights(self, weights: Weights) -> None:
        """Record every profile's scorer weights."""
        await self._write("scheduler/weights", jsonutil.dumps(weights), "the scheduler's weights")

    async def save_tenants(self, weights: Mapping[str, float]) -> None:
        """Record the admission queue's tenants' weights (all of them: one left out weighs 1.0)."""
        await self._write("admission/tenants", jsonutil.dumps(weights), "the tenants' weights")

    async def save_planner(self, record: dict[str, Any]) -> None:
        """Record the planner's memory and config (the leader's, after a look that changed them)."""
        await self._write("planner", jsonutil.dumps(record), "the planner's memory")

    async def save_rollout(
        self, model: str, record: Mapping[str, Any], intents: Mapping[str, InstanceIntent]
    ) -> None:
        """Record a rollout's new state and the instance intents of its step, in one transaction."""
        values: dict[str, bytes | None] = {f"rollouts/{model}": jsonutil.dumps(record)}
        for agent_id, intent in intents.items():
            values[f"instances/{agent_id}"] = None if intent.empty else jsonutil.dumps(intent.to_json())
        await self._write_many(values, f"the rollout of {model!r}")

    async def save_role(
        self, agent_id: str, record: Mapping[str, Any] | None, intents: Mapping[str, InstanceIntent]
    ) -> None:
        """Record a role change's new state (None: it ended) and the drain of its step, at once."""
        values: dict[str, bytes | None] = {
            f"roles/{agent_id}": None if record is None else jsonutil.dumps(record)
        }
        for other, intent in intents.items():
            values[f"instances/{other}"] = None if intent.empty else jsonutil.dumps(intent.to_json())
        await self._write_many(values, f"the role change of {agent_id!r}")

    async def _write(self, key: str, value: bytes | None, what: str) -> None:
        await self._write_many({key: value}, what)

    async def _write_many(self, values: Mapping[str, bytes | None], what: str) -> None:
        epoch = self._leadership.require(f"recording {what}")
        try:
            done = await self._client.put_many_fenced(
                {self._prefix + k: v for k, v in values.items()},
                fence_key=self._leader_key,
                fence_revision=epoch,
            )
        except EtcdError as exc:
            raise NotLeader(
                f"recording {what} in etcd failed ({exc}); leader actions wait for etcd"
            ) from None
        if not done:
            raise NotLeader(f"recording {what}: epoch {epoch} is over (another replica leads now)")

    # --- every replica's reads -------------------------------------------------------------------

    async def run(self) -> None:
        """Read every key, apply them, then follow the changes; again after any break, until cancelled."""
        while True:
            try:
                kvs, revision = await self._client.get_prefix(self._prefix)
                for kv in kvs:
                    self._apply(kv.key, kv)
                self.loaded.set()
                async for batch in self._client.watch(self._prefix, prefix=True, start_revision=revision + 1):
                    for event in batch:
                        self._apply(event.kv.key, event.kv if event.kind == "put" else None)
            except EtcdError as exc:
                log.warning("following operators' intent in etcd: %s; reading it again", exc)
            await self._clock.sleep(_RETRY_S)

    def _apply(self, key: str, kv: KeyValue | None) -> None:
        name = key[len(self._prefix) :]
        try:
            data = jsonutil.loads(kv.value) if kv is not None else None
            if name.startswith("instances/"):
                self._apply_instance(name[len("instances/") :], data)
            elif name == "planner":
                if self.on_planner is not None and data is not None:
                    self.on_planner(data)
            elif name.startswith("roles/"):
                if self.on_role is not None:
                    self.on_role(name[len("roles/") :], data)
            elif name.startswith("rollouts/"):
                if self.on_rollout is not None:
                    self.on_rollout(name[len("rollouts/") :], data)
            elif name == "admission/tenants":
                if self.on_tenants is not None and data is not None:
                    self.on_tenants(data)
            elif name == "scheduler/weights" and data is not None and self._set_weights is not None:
                if self._weights is None or self._weights() != data:
                    self._set_weights(data)
            else:
                log.warning("ignoring an unknown intent key %r", key)
                return
        except (ValueError, DisaggError) as exc:  # a hand-edited key must not stop the others
            log.error("ignoring the intent key %r: %s", key, exc)
            return
        self.applied += 1

    def _apply_instance(self, agent_id: str, data: Any) -> None:
        if isinstance(data, dict) and data.get("removed") is True:
            self._registry.apply_intent(agent_id, NO_INTENT)
            view = self._registry.get(agent_id)
            if view is not None and view.state == "dead":
                self._registry.remove(agent_id)
            return
        intent = NO_INTENT if data is None else InstanceIntent.from_json(data)
        if self._registry.intent_of(agent_id) != intent:
            self._registry.apply_intent(agent_id, intent)
