"""The agent's side of the protocol session: Hello until Welcome, then heartbeats, commands and Acks.

One reader task owns the socket's receiving side; one talker task sends Hello (with backoff) or
heartbeats (at the interval the orchestrator chose). The session ends with a ``SessionEnd`` when the
orchestrator says ``shutdown`` or refuses our protocol version; the caller stops the engine.

An agent of replicated orchestrators holds one session per replica (``sessions.py``), all sharing the
Hello's instance, the draining flag, the fence and the command log (``shared.py``). Every command
passes the fence first (``fencing.py``): one older than the newest leadership term obeyed is answered
``STALE_EPOCH`` and not carried out; and it is written to the command log before it is carried out.

An agent that runs a KV pool (``kv_plane``) also obeys ``kv_grant`` (at once) and ``kv_fetch`` (in a
task of its own, Acked once the transfer has started: the reader never waits on another agent).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, assert_never

from vllm_disagg.agent.kv.plane import FetchStarted, KvPlane
from vllm_disagg.agent.shared import SharedState
from vllm_disagg.errors import FieldTypeError, VersionMismatch
from vllm_disagg.protocol.codec import for_minor
from vllm_disagg.protocol.commands import (
    POOL_MINOR,
    AckResult,
    CommandPayload,
    Drain,
    FetchResult,
    GrantResult,
    KvFetch,
    KvGrant,
    SetRole,
    Shutdown,
    Undrain,
    peer_public_key,
)
from vllm_disagg.protocol.messages import (
    HELLO_BACKOFF_MAX_S,
    MEDIUM_GPU,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    RESTART_REQUIRED,
    ROLES,
    STALE_EPOCH,
    Ack,
    Command,
    EngineState,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvEvents,
    Message,
    MetricsSnapshot,
    Refuse,
    Role,
    Welcome,
)
from vllm_disagg.protocol.transport import DealerTransport

log = logging.getLogger(__name__)

HELLO_BACKOFF_START_S = 0.1
# Refusals that mean "I do not know you": the orchestrator restarted or dropped us. Say Hello again.
REHELLO_CODES = frozenset({"unknown_agent", "not_registered"})
EXIT_OK = 0
EXIT_REFUSED = 3  # the orchestrator will never accept this agent (protocol version)
NO_POOL = "this agent has no KV pool (run it with --kv-connector vllm-disagg)"


def hello_delay(attempt: int, jitter: float) -> float:
    """Seconds before Hello number ``attempt + 1``: 0.1 s doubling to 2 s, times a jitter in [0.5, 1].

    ``jitter`` is a uniform random number in [0, 1); spreading retries keeps a restarted
    orchestrator from being hit by every agent at the same instant.
    """
    base = min(HELLO_BACKOFF_MAX_S, HELLO_BACKOFF_START_S * 2.0 ** min(attempt, 32))
    return base * (0.5 + 0.5 * jitter)


@dataclass(frozen=True, slots=True)
class RoleSwitch:
    """How this agent's engine can take a new role: at once (``live``: routing alone), by restarting
    with the role's ``kv_role`` (``restart``), or not at all (``refuse``); ``why`` says why not live."""

    how: Literal["live", "restart", "refuse"]
    why: str = ""


@dataclass(frozen=True, slots=True)
class SessionEnd:
    """Why the session ended and the agent's exit code."""

    exit_code: int
    reason: str
    command_id: int | None = None  # the shutdown command, when one ended it


@dataclass(frozen=True, slots=True)
class _Admitted:
    """A command that passed every check and is to be carried out (a role change: how)."""

    payload: CommandPayload
    switch: RoleSwitch | None = None


class AgentSession:
    """Registers with one orchestrator and keeps it informed until told to stop."""

    def __init__(
        self,
        transport: DealerTransport,
        agent_id: str,
        instance: InstanceInfo,
        *,
        engine_state: Callable[[], EngineState],
        metrics: Callable[[], MetricsSnapshot],
        rng: random.Random | None = None,
        heartbeat_interval_s: float = 0.25,
        kv_plane: KvPlane | None = None,
        shared: SharedState | None = None,
        endpoint: str = "",
    ) -> None:
        self._transport = transport
        self.endpoint = endpoint  # the orchestrator's, as the command log and the logs name it
        self.kv_plane = kv_plane  # the node's KV pool and its agent-to-agent link; None: no pool
        self._kv_tasks: set[asyncio.Task[None]] = set()  # fetches waiting for their transfer to start
        # What every session of this agent says alike; ``instance`` is ignored beside one given.
        self._shared = shared if shared is not None else SharedState(instance)
        self._shared.members.append(self)
        self._agent_id = agent_id
        self._minor = PROTOCOL_MINOR  # what our Hello says; 0 to an orchestrator of 1.0
        self._engine_state = engine_state
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._wake = asyncio.Event()
        self._end: asyncio.Future[SessionEnd] | None = None
        self.interval_s = heartbeat_interval_s
        self.registered = False
        # A new Hello must go out even if a Welcome to the previous one arrives first (it registers
        # what that Hello said, not what changed since).
        self._hello_due = False
        self.seq = 0  # of the last heartbeat sent; grows for the agent's whole life
        self.hellos_sent = 0
        self.welcomes = 0  # sessions started (a repeated Welcome counts: each may follow a new Hello)
        # How the engine can serve a role: asked before a ``set_role`` is obeyed; ``restart_as`` restarts
        # it as one (a ``set_role`` that says ``restart`` after the orchestrator drained the instance).
        self.role_switch: Callable[[Role], RoleSwitch] = lambda _role: RoleSwitch("live")
        self.restart_as: Callable[[Role], None] | None = None
        self.peer_minor = 0  # the orchestrator's protocol minor, from its Welcome
        # Called on every Welcome, registered already: the orchestrator has just dropped (or never had)
        # what it knew of this instance beyond the Hello, e.g. its KV index entries.
        self.on_welcome: Callable[[], None] | None = None

    @property
    def agent_id(self) -> str:
        """This agent's id (what its Hello says)."""
        return self._agent_id

    @property
    def hello(self) -> Hello:
        """The Hello this session says: the shared instance, in the protocol its orchestrator reads."""
        hello = Hello(
            protocol_version=PROTOCOL_VERSION,
            agent_id=self._agent_id,
            instance=self._shared.instance,
            incarnation=self._shared.incarnation,
            protocol_minor=self._minor,
        )
        return hello if self._minor else for_minor(hello, 0)

    async def run(self) -> SessionEnd:
        """Talk to the orchestrator until a shutdown command or a final refusal."""
        self._end = asyncio.get_running_loop().create_future()
        async with asyncio.TaskGroup() as tg:
            reader = tg.create_task(self._read_loop(), name="agent-reader")
            talker = tg.create_task(self._talk_loop(), name="agent-talker")
            end = await self._end
            reader.cancel()
            talker.cancel()
            for task in self._kv_tasks:
                task.cancel()
        return end

    @property
    def instance(self) -> InstanceInfo:
        """What this agent's Hello says about its engine."""
        return self._shared.instance

    def set_instance(self, instance: InstanceInfo) -> None:
        """Say Hello again with ``instance`` (the attached engine turned out, or became, different), in
        every session of this agent; each orchestrator starts a new session for it."""
        self._shared.set_instance(instance)

    @property
    def draining(self) -> bool:
        """True between a ``drain`` and an ``undrain`` obeyed by any session of this agent."""
        return self._shared.draining

    @draining.setter
    def draining(self, draining: bool) -> None:
        self._shared.draining = draining

    def rehello(self) -> None:
        """Say Hello again at once (the instance changed, or the orchestrator forgot us)."""
        self.registered = False
        self._hello_due = True
        self._poke()

    def send_kv_events(self, message: KvEvents) -> bool:
        """Forward KV events; False (nothing sent) while not registered or not connected.

        An orchestrator older than 1.3 would read a pool's events as the engine's (it ignores
        ``medium``): it gets the engine's alone."""
        if not self.registered:
            return False
        if self.peer_minor < POOL_MINOR and any(e.medium != MEDIUM_GPU for e in message.events):
            events = [e for e in message.events if e.medium == MEDIUM_GPU]
            if not events and not message.missed:
                return True  # nothing it may hear
            message = dataclasses.replace(message, events=events)
        return self._transport.send(message)

    def report_now(self) -> None:
        """Send a heartbeat now, not at the next interval (the engine's state changed)."""
        self._poke()

    def goodbye(self, reason: str) -> None:
        """Tell the orchestrator we are leaving on purpose."""
        self._transport.send(Goodbye(reason=reason))

    def _finish(self, end: SessionEnd) -> None:
        if self._end is not None and not self._end.done():
            self._end.set_result(end)

    def _poke(self) -> None:
        self._wake.set()

    async def _read_loop(self) -> None:
        while True:
            incoming = await self._transport.recv()
            if incoming.error is not None:
                log.warning("ignoring a bad frame from the orchestrator%s: %s", self._at(), incoming.error)
                continue
            if incoming.message is not None:
                self.handle(incoming.message)

    def _at(self) -> str:
        return f" at {self.endpoint}" if self.endpoint else ""

    def handle(self, message: Message) -> None:
        """React to one message from the orchestrator."""
        match message:
            case Welcome():
                self._welcomed(message)
            case Refuse(code=VersionMismatch.code):
                log.error("refused by the orchestrator%s (%s): %s", self._at(), message.code, message.reason)
                self._finish(SessionEnd(EXIT_REFUSED, f"{message.code}: {message.reason}"))
            case Refuse(code=FieldTypeError.code) if (
                not self.registered and self._minor and "'protocol_minor'" in message.reason
            ):
                # An orchestrator of protocol 1.0 refuses fields it does not know: speak 1.0 to it.
                log.info("the orchestrator%s speaks protocol v1.0; saying Hello as v1.0", self._at())
                self._minor = 0
                self._poke()
            case Refuse() if message.code in REHELLO_CODES:
                # Every heartbeat in flight is refused; the first refusal is enough to say Hello again.
                if self.registered:
                    log.info(
                        "orchestrator%s does not know us (%s); saying Hello again", self._at(), message.code
                    )
                    self.rehello()
            case Refuse():
                log.warning("orchestrator%s refused (%s): %s", self._at(), message.code, message.reason)
            case Command():
                self._command(message)
            case Goodbye():
                # The orchestrator is going away; it will not know us when it comes back.
                log.info("orchestrator%s said goodbye (%s)", self._at(), message.reason or "no reason")
                self.rehello()
            case _:
                log.warning("ignoring an unexpected %s from the orchestrator%s", message.TAG, self._at())

    def _welcomed(self, welcome: Welcome) -> None:
        if not self.registered:
            log.info(
                "registered%s (the orchestrator speaks protocol v%d.%d); heartbeat every %.3g s",
                self._at(),
                welcome.protocol_version,
                welcome.protocol_minor,
                welcome.heartbeat_interval_s,
            )
        self.registered = True
        self.welcomes += 1
        self.peer_minor = welcome.protocol_minor
        if welcome.heartbeat_interval_s > 0:
            self.interval_s = welcome.heartbeat_interval_s
        self._poke()
        if self.on_welcome is not None:
            try:
                self.on_welcome()
            except Exception:  # a bug in a hook must not end the session
                log.exception("the Welcome hook failed")

    def _command(self, command: Command) -> None:
        epoch = f" (epoch {command.epoch})" if command.epoch else ""
        log.info(
            "command %d%s: %s %s%s", command.id, self._at(), command.kind, _loggable(command) or "", epoch
        )
        admitted = self._admit(command)
        command_log = self._shared.command_log
        if isinstance(admitted, Ack):
            if command_log is not None:
                command_log.record(
                    command, self.endpoint, accepted=False, code=admitted.code, error=admitted.error
                )
            self._transport.send(admitted.for_minor(self.peer_minor))
            return
        if command_log is not None:  # before it is carried out: the log orders what the agent did
            command_log.record(command, self.endpoint, accepted=True)
        self._obey(command.id, admitted)

    def _admit(self, command: Command) -> _Admitted | Ack:
        """The command to carry out, or the Ack that refuses it: a stale leader's first of all."""
        stale = self._shared.fence.admit(command.epoch)
        if stale:
            log.warning(
                "refused command %d (%s) from %s: %s", command.id, command.kind, self.endpoint or "?", stale
            )
            return Ack(id=command.id, ok=False, error=stale, code=STALE_EPOCH)
        if command.kind in ("kv_grant", "kv_fetch") and self.kv_plane is None:
            return Ack(id=command.id, ok=False, error=NO_POOL)
        try:
            payload = command.read()  # typed (1.5), or from the args of an orchestrator before it
        except ValueError as exc:
            return Ack(id=command.id, ok=False, error=f"{command.kind}: {exc}")
        if isinstance(payload, SetRole):
            switch = self._role_switch(command.id, payload)
            return switch if isinstance(switch, Ack) else _Admitted(payload, switch)
        return _Admitted(payload)

    def _obey(self, command_id: int, admitted: _Admitted) -> None:
        payload = admitted.payload
        match payload:
            case Shutdown():
                self._transport.send(Ack(id=command_id, ok=True))
                self._finish(SessionEnd(EXIT_OK, "shutdown command", command_id))
            case SetRole():
                assert admitted.switch is not None
                self._transport.send(self._take_role(command_id, payload.role, admitted.switch))
            case KvGrant():
                self._transport.send(self._kv_grant(command_id, payload))
            case KvFetch():
                self._kv_fetch(command_id, payload)
            case Drain() | Undrain():
                self._transport.send(Ack(id=command_id, ok=True))
                # Every session's next heartbeat goes out at once with the new flag.
                self._shared.set_draining(isinstance(payload, Drain))
            case _:
                assert_never(payload)  # a kind added to the protocol must be obeyed here

    def _role_switch(self, command_id: int, ask: SetRole) -> RoleSwitch | Ack:
        """How the engine takes the role the orchestrator asks for, or the Ack that says it cannot.

        An engine that must restart for it answers ``RESTART_REQUIRED`` first; the orchestrator drains
        the instance and asks again with ``restart``, and the engine restarts after the Ack."""
        role = ask.role
        if role not in ROLES:
            return Ack(id=command_id, ok=False, error=f"unknown role {role!r}; one of {list(ROLES)}")
        switch = self.role_switch(role)
        if switch.how == "refuse" or (switch.how == "restart" and self.restart_as is None):
            log.warning("refusing to become %s: %s", role, switch.why)
            return Ack(id=command_id, ok=False, error=switch.why)
        if switch.how == "restart" and not ask.restart:
            return Ack(id=command_id, ok=False, error=switch.why, code=RESTART_REQUIRED)
        return switch

    def _take_role(self, command_id: int, role: str, switch: RoleSwitch) -> Ack:
        """Take ``role``. No new Hello here: the orchestrator applies the role when the Ack says yes
        (the session, and the requests on it, go on), and the Hello says it from now on (a reconnect
        resumes the session); the agent's other sessions say Hello again with it."""
        assert role in ROLES  # ``_role_switch`` refused any other
        instance = dataclasses.replace(self._shared.instance, role=role)
        self._shared.take_role(instance, self)
        if switch.how == "restart":
            assert self.restart_as is not None
            self.restart_as(role)
        log.info("now serving as %s%s", role, " (the engine restarts)" if switch.how == "restart" else "")
        return Ack(id=command_id, ok=True)

    def _ack(self, command_id: int, result: AckResult) -> Ack:
        """An Ack with a command's result, as the orchestrator reads it: typed from 1.5, a string map
        in 1.3 and 1.4 (an orchestrator before 1.3 sends no command that has one)."""
        return Ack(id=command_id, ok=True, result=result).for_minor(self.peer_minor)

    def _kv_grant(self, command_id: int, grant: KvGrant) -> Ack:
        """Let another agent fetch blocks of this pool; the Ack says how many leading ones are held."""
        assert self.kv_plane is not None
        try:
            held = self.kv_plane.grant(grant.token, grant.keys, peer_public_key(grant.peer_key), grant.ttl_s)
        except Exception as exc:  # the plane's refusal goes back to the orchestrator, the session goes on
            log.warning("kv_grant %d failed", command_id, exc_info=True)
            return Ack(id=command_id, ok=False, error=f"kv_grant failed: {type(exc).__name__}: {exc}")
        return self._ack(command_id, GrantResult(requested=len(grant.keys), held=held))

    def _kv_fetch(self, command_id: int, fetch: KvFetch) -> None:
        """Start fetching blocks from another agent's pool; Acked once the transfer has started."""
        assert self.kv_plane is not None
        task = asyncio.get_running_loop().create_task(self._fetch(command_id, self.kv_plane, fetch))
        self._kv_tasks.add(task)
        task.add_done_callback(self._kv_tasks.discard)

    async def _fetch(self, command_id: int, plane: KvPlane, fetch: KvFetch) -> None:
        endpoint = fetch.endpoint
        try:
            async with asyncio.timeout(fetch.timeout_s):
                started = await plane.fetch(
                    endpoint, peer_public_key(fetch.peer_key), fetch.token, fetch.keys, fetch.timeout_s
                )
        except TimeoutError:
            error = f"kv_fetch: the transfer from {endpoint} did not start within {fetch.timeout_s:g} s"
            self._transport.send(Ack(id=command_id, ok=False, error=error))
            return
        except Exception as exc:
            log.warning("kv_fetch %d from %s failed: %s", command_id, endpoint, exc)
            self._transport.send(
                Ack(id=command_id, ok=False, error=f"kv_fetch failed: {type(exc).__name__}: {exc}")
            )
            return
        started.done.add_done_callback(lambda done: _fetch_landed(command_id, endpoint, started, done))
        result = FetchResult(
            requested=started.requested, already_held=started.already_held, reserved=started.reserved
        )
        self._transport.send(self._ack(command_id, result))

    async def _talk_loop(self) -> None:
        attempt = 0
        while True:
            if self.registered and not self._hello_due:
                attempt = 0
                self.seq += 1
                beat = Heartbeat(
                    seq=self.seq,
                    engine_state=self._engine_state(),
                    draining=self.draining,
                    metrics=self._metrics(),
                )
                self._transport.send(beat)
                delay = self.interval_s
            else:
                self._hello_due = False
                self._transport.send(self.hello)  # dropped while not connected; retried below
                self.hellos_sent += 1
                delay = hello_delay(attempt, self._rng.random())
                attempt += 1
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that arrives just as
            # the event is set, and this loop would outlive its session.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()


def _fetch_landed(command_id: int, endpoint: str, started: FetchStarted, done: asyncio.Future[int]) -> None:
    """Log a fetch that landed fewer blocks than it reserved (its engine computes the rest)."""
    if done.cancelled():
        return
    error = done.exception()
    landed = 0 if error is not None else done.result()
    if error is not None or landed < started.reserved:
        log.warning(
            "kv_fetch %d from %s landed %d of %d blocks%s",
            command_id,
            endpoint,
            landed,
            started.reserved,
            f" ({error})" if error is not None else "",
        )


# A grant's token authorizes a fetch of prompts' KV: it never goes to a log. Keys lists are long.
_SECRET_ARGS = frozenset({"token"})
_LONG_ARG_CHARS = 80


def _loggable(command: Command) -> dict[str, str]:
    """A command's args or payload as a log line may show them: secrets masked, long values cut."""
    if command.payload is not None:
        fields = {f.name: getattr(command.payload, f.name) for f in dataclasses.fields(command.payload)}
        values = {k: f"{len(v)} keys" if k == "keys" else str(v) for k, v in fields.items()}
    else:
        values = dict(command.args)
    out = {}
    for name, value in values.items():
        if name in _SECRET_ARGS:
            value = "***"
        elif len(value) > _LONG_ARG_CHARS:
            value = f"{value[:_LONG_ARG_CHARS]}... ({len(value)} chars)"
        out[name] = value
    return out
