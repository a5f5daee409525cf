"""What every protocol session of one agent says and obeys alike.

An agent holds one session per orchestrator replica (``sessions.py``); they are one instance to all of
them: one Hello (the engine's ``InstanceInfo``, one incarnation), one draining flag, one fence (the
highest epoch obeyed, ``fencing.py``) and one command log. A change made through any session is what
every session says from then on.
"""

from __future__ import annotations

import secrets
from typing import Protocol

from vllm_disagg.agent.command_log import CommandLog
from vllm_disagg.agent.fencing import Fence
from vllm_disagg.protocol.messages import InstanceInfo


class Member(Protocol):
    """A session as the shared state tells it of changes."""

    def rehello(self) -> None:
        """Say Hello again at once: the instance it said has changed."""

    def report_now(self) -> None:
        """Send a heartbeat now: the draining flag has changed."""


class SharedState:
    """The instance, draining flag, fence and command log of an agent's sessions."""

    def __init__(self, instance: InstanceInfo, *, command_log: CommandLog | None = None) -> None:
        self.instance = instance
        self.incarnation = secrets.token_hex(8)  # per agent process: every replica hears the same
        self.draining = False
        self.fence = Fence()
        self.command_log = command_log
        self.members: list[Member] = []

    def set_instance(self, instance: InstanceInfo) -> None:
        """Every session says Hello again with ``instance``: each orchestrator starts a new session."""
        if instance == self.instance:
            return
        self.instance = instance
        for member in self.members:
            member.rehello()

    def take_role(self, instance: InstanceInfo, obeyed_by: Member) -> None:
        """``obeyed_by`` obeyed a ``set_role``: its orchestrator applies the role on the Ack, in the same
        session; the others hear it in a new Hello now, so that every replica's registry agrees with
        the leader's should one of them take over."""
        self.instance = instance
        for member in self.members:
            if member is not obeyed_by:
                member.rehello()

    def set_draining(self, draining: bool) -> None:
        """Drain (or undrain); every session's next heartbeat, sent at once, says so."""
        self.draining = draining
        for member in self.members:
            member.report_now()
