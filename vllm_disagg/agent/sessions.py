"""One agent, many orchestrators: a protocol session with every replica, as one.

Replicated orchestrators (docs/operations.md) each keep their own registry and KV index, fed directly
by the agents, so a failover needs no state transfer: an agent connects to every replica
(``--orchestrator tcp://a:5555,tcp://b:5555``) and holds one ``AgentSession`` per endpoint, each with
its own socket, Hello/Welcome, heartbeats, registration and peer minor. Only the leader sends
commands; the sessions share what a command changes (``shared.py``: the instance, the draining flag,
the fence, the command log). One endpoint is the agent of a single orchestrator, unchanged.

``Sessions`` is what the rest of the agent sees: ``run`` until any session ends the agent (a shutdown
command, a version refusal), ``goodbye`` and ``report_now`` to all, ``set_instance`` for all, and the
members, which the KV-event forwarder keeps a lane for each (a Welcome resyncs that session alone).
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Callable, Sequence

from vllm_disagg.agent.command_log import CommandLog
from vllm_disagg.agent.kv.plane import KvPlane
from vllm_disagg.agent.session import AgentSession, RoleSwitch, SessionEnd
from vllm_disagg.agent.shared import SharedState
from vllm_disagg.protocol.curve import ClientCurve
from vllm_disagg.protocol.messages import EngineState, InstanceInfo, MetricsSnapshot, Role
from vllm_disagg.protocol.transport import DealerTransport


class Sessions:
    """The agent's sessions, one per orchestrator endpoint, sharing one instance and one fence."""

    def __init__(
        self,
        transports: Sequence[tuple[str, DealerTransport]],
        agent_id: str,
        instance: InstanceInfo,
        *,
        engine_state: Callable[[], EngineState],
        metrics: Callable[[], MetricsSnapshot],
        kv_plane: KvPlane | None = None,
        command_log: CommandLog | None = None,
        heartbeat_interval_s: float = 0.25,
        rng: random.Random | None = None,
    ) -> None:
        if not transports:
            raise ValueError("an agent needs at least one orchestrator")
        self.shared = SharedState(instance, command_log=command_log)
        self._transports = [transport for _, transport in transports]
        self.members: tuple[AgentSession, ...] = tuple(
            AgentSession(
                transport,
                agent_id,
                instance,
                engine_state=engine_state,
                metrics=metrics,
                rng=rng,
                heartbeat_interval_s=heartbeat_interval_s,
                kv_plane=kv_plane,
                shared=self.shared,
                endpoint=endpoint,
            )
            for endpoint, transport in transports
        )

    @staticmethod
    def dealers(endpoints: Sequence[str], curve: ClientCurve | None) -> list[tuple[str, DealerTransport]]:
        """A socket to each of ``endpoints``, for the constructor (one CurveZMQ server key for all:
        replicas share theirs)."""
        dealers: list[tuple[str, DealerTransport]] = []
        try:
            for endpoint in endpoints:
                dealers.append((endpoint, DealerTransport(endpoint, curve=curve)))
        except BaseException:
            for _, transport in dealers:
                transport.close()
            raise
        return dealers

    async def run(self) -> SessionEnd:
        """Run every session until one ends the agent (a shutdown command, a version refusal)."""
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(member.run(), name=f"agent-session-{i}")
                for i, member in enumerate(self.members)
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
        return next(iter(done)).result()

    @property
    def instance(self) -> InstanceInfo:
        """What the agent's Hello says about its engine, to every orchestrator."""
        return self.shared.instance

    def set_instance(self, instance: InstanceInfo) -> None:
        """Say Hello again with ``instance`` to every orchestrator."""
        self.shared.set_instance(instance)

    @property
    def registered(self) -> bool:
        """True while some orchestrator has this agent registered."""
        return any(member.registered for member in self.members)

    @property
    def draining(self) -> bool:
        """True between a ``drain`` and an ``undrain``."""
        return self.shared.draining

    @property
    def highest_epoch(self) -> int:
        """The newest leadership term this agent has obeyed (0: none, or a single orchestrator)."""
        return self.shared.fence.highest

    def report_now(self) -> None:
        """Send a heartbeat to every orchestrator now (the engine's state changed)."""
        for member in self.members:
            member.report_now()

    def goodbye(self, reason: str) -> None:
        """Tell every orchestrator the agent is leaving on purpose."""
        for member in self.members:
            member.goodbye(reason)

    def set_roles(
        self, role_switch: Callable[[Role], RoleSwitch], restart_as: Callable[[Role], None] | None
    ) -> None:
        """How the engine takes a new role, whichever session is asked (``AgentSession.role_switch``)."""
        for member in self.members:
            member.role_switch = role_switch
            member.restart_as = restart_as

    def on_welcome(self, hook: Callable[[AgentSession], None]) -> None:
        """Call ``hook(session)`` on every Welcome of any session (a KV index resync to that one)."""
        for member in self.members:
            member.on_welcome = functools.partial(hook, member)

    def close(self, *, linger_ms: int = 0) -> None:
        """Close every socket; ``linger_ms`` > 0 first delivers what is queued (the last Ack, Goodbye)."""
        for transport in self._transports:
            transport.close(linger_ms=linger_ms)
