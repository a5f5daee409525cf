"""The agent's side of the protocol session: Hello until Welcome, then heartbeats, commands and Acks.

One reader task owns the socket's receiving side; one talker task sends Hello (with backoff) or
heartbeats (at the interval the orchestrator chose). The session ends with a ``SessionEnd`` when the
orchestrator says ``shutdown`` or refuses our protocol version; the caller stops the engine.

An agent that runs a KV pool (``kv_plane``) also obeys ``kv_grant`` (at once) and ``kv_fetch`` (in a
task of its own, Acked once the transfer has started: the reader never waits on another agent).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, assert_never

from vllm_disagg.agent.kv.plane import FetchStarted, KvPlane
from vllm_disagg.errors import FieldTypeError, VersionMismatch
from vllm_disagg.protocol.codec import for_minor
from vllm_disagg.protocol.commands import (
    POOL_MINOR,
    AckResult,
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
    MEDIUM_GPU,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    RESTART_REQUIRED,
    ROLES,
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
HELLO_BACKOFF_MAX_S = 2.0
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


class AgentSession:
    """Registers with the orchestrator and keeps it informed until told to stop."""

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
    ) -> None:
        self._transport = transport
        self.kv_plane = kv_plane  # the node's KV pool and its agent-to-agent link; None: no pool
        self._kv_tasks: set[asyncio.Task[None]] = set()  # fetches waiting for their transfer to start
        self._hello = Hello(
            protocol_version=PROTOCOL_VERSION,
            agent_id=agent_id,
            instance=instance,
            incarnation=secrets.token_hex(8),
            protocol_minor=PROTOCOL_MINOR,
        )
        self._engine_state = engine_state
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._wake = asyncio.Event()
        self._end: asyncio.Future[SessionEnd] | None = None
        self.interval_s = heartbeat_interval_s
        self.registered = False
        self.draining = False
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
        return self._hello.agent_id

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
        return self._hello.instance

    def set_instance(self, instance: InstanceInfo) -> None:
        """Say Hello again with ``instance`` (the attached engine turned out, or became, different);
        the orchestrator starts a new session for it."""
        if instance == self._hello.instance:
            return
        self._hello = dataclasses.replace(self._hello, instance=instance)
        self.registered = False
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
                log.warning("ignoring a bad frame from the orchestrator: %s", incoming.error)
                continue
            if incoming.message is not None:
                self.handle(incoming.message)

    def handle(self, message: Message) -> None:
        """React to one message from the orchestrator."""
        match message:
            case Welcome():
                if not self.registered:
                    log.info(
                        "registered (the orchestrator speaks protocol v%d.%d); heartbeat every %.3g s",
                        message.protocol_version,
                        message.protocol_minor,
                        message.heartbeat_interval_s,
                    )
                self.registered = True
                self.welcomes += 1
                self.peer_minor = message.protocol_minor
                if message.heartbeat_interval_s > 0:
                    self.interval_s = message.heartbeat_interval_s
                self._poke()
                if self.on_welcome is not None:
                    try:
                        self.on_welcome()
                    except Exception:  # a bug in a hook must not end the session
                        log.exception("the Welcome hook failed")
            case Refuse(code=VersionMismatch.code):
                log.error("refused by the orchestrator (%s): %s", message.code, message.reason)
                self._finish(SessionEnd(EXIT_REFUSED, f"{message.code}: {message.reason}"))
            case Refuse(code=FieldTypeError.code) if (
                not self.registered and self._hello.protocol_minor and "'protocol_minor'" in message.reason
            ):
                # An orchestrator of protocol 1.0 refuses fields it does not know: speak 1.0 to it.
                log.info("the orchestrator speaks protocol v1.0; saying Hello as v1.0")
                self._hello = for_minor(dataclasses.replace(self._hello, protocol_minor=0), 0)
                self._poke()
            case Refuse() if message.code in REHELLO_CODES:
                # Every heartbeat in flight is refused; the first refusal is enough to say Hello again.
                if self.registered:
                    log.info("orchestrator does not know us (%s); saying Hello again", message.code)
                    self.registered = False
                    self._poke()
            case Refuse():
                log.warning("orchestrator refused (%s): %s", message.code, message.reason)
            case Command():
                self._command(message)
            case Goodbye():
                # The orchestrator is going away; it will not know us when it comes back.
                log.info("orchestrator said goodbye (%s)", message.reason or "no reason")
                self.registered = False
                self._poke()
            case _:
                log.warning("ignoring an unexpected %s from the orchestrator", message.TAG)

    def _command(self, command: Command) -> None:
        log.info("command %d: %s %s", command.id, command.kind, _loggable(command) or "")
        if command.kind in ("kv_grant", "kv_fetch") and self.kv_plane is None:
            self._transport.send(Ack(id=command.id, ok=False, error=NO_POOL))
            return
        try:
            payload = command.read()  # typed (1.5), or from the args of an orchestrator before it
        except ValueError as exc:
            self._transport.send(Ack(id=command.id, ok=False, error=f"{command.kind}: {exc}"))
            return
        match payload:
            case Shutdown():
                self._transport.send(Ack(id=command.id, ok=True))
                self._finish(SessionEnd(EXIT_OK, "shutdown command", command.id))
            case SetRole():
                self._transport.send(self._set_role(command.id, payload))
            case KvGrant():
                self._transport.send(self._kv_grant(command.id, payload))
            case KvFetch():
                self._kv_fetch(command.id, payload)
            case Drain() | Undrain():
                self.draining = isinstance(payload, Drain)
                self._transport.send(Ack(id=command.id, ok=True))
                self._poke()  # let the orchestrator see the new draining flag at once
            case _:
                assert_never(payload)  # a kind added to the protocol must be obeyed here

    def _set_role(self, command_id: int, ask: SetRole) -> Ack:
        """Take the role the orchestrator asks for, if the engine can serve it; the Ack says which.

        No new Hello: the orchestrator applies the role when the Ack says yes (the session, and the
        requests on it, go on), and the Hello says it from now on (a reconnect resumes the session).
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
            # An orchestrator of 1.0 refuses fields it does not know; one of 1.1 reads a refusal.
            code = RESTART_REQUIRED if self.peer_minor >= 2 else ""
            return Ack(id=command_id, ok=False, error=switch.why, code=code)
        instance = dataclasses.replace(self._hello.instance, role=role)
        self._hello = dataclasses.replace(self._hello, instance=instance)
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
            if self.registered:
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
                self._transport.send(self._hello)  # dropped while not connected; retried below
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
