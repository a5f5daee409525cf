"""The agent-facing side: one ROUTER socket, one reader task, an expiry task, and commands.

The reader never dies on bad input: a frame that cannot be decoded, a wrong protocol version, or a
heartbeat or ``KvEvents`` from an agent without a session is answered with a ``Refuse`` carrying a
code and a reason, counted in ``vllm_disagg_protocol_refused_total{code}``, and the loop goes on.

Connections are not agents: the ROUTER names each connection, and a ``Hello`` binds one to an agent
id; a frame from a connection no ``Hello`` bound is refused (``unknown_agent``), which sends an agent
that reconnected back to ``Hello``.

Who may speak (docs/security.md): with agent keys, only a listed key connects at all, a ``Hello`` must
name the agent id its key is bound to, and every later frame must come with that key. Without keys, a
``Hello`` for an id held by a live session is refused while that session's connection is still open
(the refusal is sent there too, so the real agent logs that someone claimed its id); once libzmq has
closed that connection, the new one takes the session over. Either way a model's settings (engine,
tokenizer, block size, revision) are fixed by its first instance: a later ``Hello`` that disagrees is
refused, not applied; and its engine URL must be the agent's own address, this host's loopback for an
agent on this host, or in ``--engine-networks`` (``protocol/engine_urls.py``).

The control plane is the only writer of the ``KvIndex``: it applies each live agent's ``KvEvents`` and
drops an instance's entries when the instance dies (expiry, Goodbye, engine stopped) or says Hello
again (a new session may be a new engine, its cache empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from vllm_disagg.clock import Clock
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import (
    AgentTooOld,
    AgentUnknown,
    AgentUnreachable,
    CommandTimeout,
    FieldTypeError,
    RequestError,
    VersionMismatch,
)
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.leadership import Leadership
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.commands import CommandPayload, Drain, from_detail
from vllm_disagg.protocol.curve import ServerCurve, load_agent_keys, load_keypair
from vllm_disagg.protocol.engine_urls import ENGINE_URL_REFUSED, EngineNetworks, hello_url_problem
from vllm_disagg.protocol.messages import (
    COMMAND_SINCE_MINOR,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    STALE_EPOCH,
    Ack,
    Command,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvEvents,
    Message,
    Refuse,
    Welcome,
    label_problem,
)
from vllm_disagg.protocol.transport import Incoming, RouterTransport

log = logging.getLogger(__name__)
_MAX_REFUSED_PEERS = 10_000  # bounds the once-per-peer log memo against a flood of random peers
_OURS = f"{PROTOCOL_VERSION}.{PROTOCOL_MINOR}"  # the protocol version this orchestrator speaks


def starved_after(period_s: float) -> float:
    """A tick of a ``period_s`` loop that comes this late means the process did not get the CPU."""
    return 2 * period_s + 0.05


@dataclass(frozen=True, slots=True)
class _Pending:
    agent_id: str
    future: asyncio.Future[Ack]


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """What every instance of one model must agree on (its first instance sets it)."""

    engine: str
    tokenizer: str
    block_size: int
    revision: str

    @staticmethod
    def of(info: InstanceInfo) -> ModelSettings:
        return ModelSettings(info.engine, info.tokenizer, info.block_size, info.revision)

    def describe(self) -> str:
        return (
            f"engine {self.engine!r}, tokenizer {self.tokenizer!r}, block size {self.block_size}, "
            f"revision {self.revision!r}"
        )


def load_server_curve(config: OrchestratorConfig) -> ServerCurve | None:
    """The orchestrator's keys and admitted agents, None without agent keys (``ConfigError``)."""
    if not config.curve_secret_key_file:
        return None
    return ServerCurve(load_keypair(config.curve_secret_key_file), load_agent_keys(config.agent_keys_dir))


class ControlPlane:
    """Owns the ``RouterTransport``; feeds the registry from Hello/Heartbeat/Goodbye; sends commands."""

    def __init__(
        self,
        config: OrchestratorConfig,
        registry: Registry,
        clock: Clock,
        metrics: OrchestratorMetrics,
        kv_index: KvIndex | None = None,
        on_hello: Callable[[InstanceInfo], None] | None = None,
        leadership: Leadership | None = None,
    ) -> None:
        self._config = config
        # Commands are the leader's alone, and carry its epoch: agents refuse an older one's.
        self.leadership = leadership or Leadership.sole()
        self._hello_hook = on_hello  # e.g. the gateway loads the model's tokenizer before traffic comes
        self._registry = registry
        self.kv_index = kv_index if kv_index is not None else KvIndex()
        self._clock = clock
        self._metrics = metrics
        self._transport: RouterTransport | None = None
        # Heartbeats carry no agent id: the connection they came on says who sent them.
        self._peer_to_agent: dict[bytes, str] = {}
        self._agent_to_peer: dict[str, bytes] = {}
        self._pending: dict[int, _Pending] = {}
        self._refused_peers: set[tuple[bytes, str]] = set()  # logged at INFO once, until a Hello
        self._next_command_id = 1
        self._tasks: set[asyncio.Task[None]] = set()  # commands sent on the control plane's own behalf
        self._curve = load_server_curve(config)
        self._engine_networks = EngineNetworks.parse(config.engine_networks)
        self._models: dict[str, ModelSettings] = {}  # fixed by each model's first instance
        # (model, revision) a rollout admits beside the model's settings; None until its first Hello.
        self._revisions: dict[tuple[str, str], ModelSettings | None] = {}
        self._incarnations: dict[str, str] = {}  # agent id -> the agent process of its session
        self._minors: dict[str, int] = {}  # agent id -> the protocol minor of its session's Hello
        # agent id -> its CurveZMQ public key (z85): what another agent's KV link must expect of it.
        self._agent_keys: dict[str, bytes] = (
            {agent_id: key for key, agent_id in self._curve.agents.items()} if self._curve is not None else {}
        )

    @property
    def endpoint(self) -> str:
        """The endpoint actually bound (a wildcard port resolved)."""
        if self._transport is None:
            raise RuntimeError("the control plane is not started")
        return self._transport.endpoint

    @property
    def public_key(self) -> bytes | None:
        """The orchestrator's CurveZMQ public key (z85), None without agent keys."""
        return self._curve.keys.public if self._curve is not None else None

    def admit(self, public_key: bytes, agent_id: str) -> None:
        """With agent keys: admit ``agent_id``'s key from now on (an agent the admin API spawned)."""
        if self._transport is None:
            raise RuntimeError("the control plane is not started")
        self._transport.admit(public_key, agent_id)
        self._agent_keys[agent_id] = public_key

    def public_key_of(self, agent_id: str) -> bytes | None:
        """An agent's CurveZMQ public key (z85); None without agent keys."""
        return self._agent_keys.get(agent_id)

    def start(self) -> None:
        """Bind the socket (synchronously, so the endpoint is known before agents are told it)."""
        self._transport = RouterTransport(
            self._config.zmq_endpoint,
            max_frame_bytes=self._config.max_frame_bytes,
            curve=self._curve,
            on_denied=self._key_denied,
        )

    def close(self) -> None:
        """Fail pending commands and close the socket; call after the tasks are cancelled."""
        for task in self._tasks:
            task.cancel()
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(AgentUnreachable("the orchestrator is stopping"))
                # Nobody may be waiting any more; retrieve so asyncio does not warn.
                pending.future.exception()
        self._pending.clear()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    async def run_reader(self) -> None:
        """Receive and handle frames until cancelled."""
        transport = self._transport
        if transport is None:
            raise RuntimeError("the control plane is not started")
        while True:
            incoming = await transport.recv()
            try:
                self.handle(incoming)
            except Exception:  # a bug in a handler must not stop every agent's session
                log.exception("error handling a frame from %s", self._who(incoming.peer))

    async def run_expiry(self) -> None:
        """Every half heartbeat interval, mark silent instances dead."""
        period = self._config.heartbeat_interval_s / 2
        last = self._clock.monotonic()
        while True:
            await self._clock.sleep(period)
            now = self._clock.monotonic()
            lag, last = now - last, now
            if lag > starved_after(period):
                # This process was starved of CPU (the engines can saturate a small host): heartbeats
                # may sit unread in the socket, so silence now is no evidence. Read them first.
                log.info("expiry tick %.2fs late; skipping it", lag - period)
                continue
            for agent_id in self._registry.expire(now):
                log.warning(
                    "instance %s is dead: no heartbeat for %.2fs", agent_id, self._config.heartbeat_timeout_s
                )
                self._forget_peer(agent_id)
                self.kv_index.drop(agent_id)

    def _key_denied(self) -> None:
        self._metrics.refused("unknown_key")
        log.warning("refused a connection whose key is not among the agent keys")

    def handle(self, incoming: Incoming) -> None:
        """Dispatch one frame (synchronous: every registry call is)."""
        peer = incoming.peer
        if incoming.error is not None:
            self._refuse(peer, incoming.error.code, str(incoming.error))
            return
        msg = incoming.message
        if self._curve is not None and not isinstance(msg, Hello):
            agent_id = self._peer_to_agent.get(peer)
            if agent_id is not None and incoming.user != agent_id:
                self._refuse(
                    peer, "unauthorized", f"this connection's key is {incoming.user!r}'s, not {agent_id!r}'s"
                )
                return
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(peer, msg)
        elif isinstance(msg, KvEvents):
            self._on_kv_events(peer, msg)
        elif isinstance(msg, Hello):
            self._on_hello(peer, msg, incoming.user, incoming.peer_address())
        elif isinstance(msg, Ack):
            self._on_ack(peer, msg)
        elif isinstance(msg, Goodbye):
            self._on_goodbye(peer, msg)
        elif isinstance(msg, Refuse):
            log.warning("%s refused a frame: %s (%s)", self._who(peer), msg.reason, msg.code)
        elif msg is not None:
            self._refuse(peer, "unexpected_message", f"an agent may not send {type(msg).__name__}")

    def _who(self, peer: bytes) -> str:
        """A connection, for logs: its agent's id once a Hello named one."""
        agent_id = self._peer_to_agent.get(peer)
        return f"agent {agent_id!r}" if agent_id is not None else f"connection {peer.hex()}"

    def _send(self, peer: bytes, message: Message) -> bool:
        return self._transport is not None and self._transport.send(peer, message)

    def _refuse(self, peer: bytes, code: str, reason: str) -> None:
        self._metrics.refused(code)
        # After a partition heals, every heartbeat queued during it is refused: one line per peer and
        # code until its next Hello, the rest at DEBUG.
        key = (peer, code)
        if key in self._refused_peers:
            log.debug("refusing frame from %s: %s (%s)", self._who(peer), reason, code)
        else:
            if len(self._refused_peers) >= _MAX_REFUSED_PEERS:
                self._refused_peers.clear()
            self._refused_peers.add(key)
            log.info("refusing frame from %s: %s (%s)", self._who(peer), reason, code)
        self._send(peer, Refuse(code=code, reason=reason))

    def _on_hello(self, peer: bytes, msg: Hello, user: str = "", address: str = "") -> None:
        """A Hello (from the IP ``address``): refused with its reason, or the connection bound to its
        agent, the session begun (or, for the same agent process on a new connection, gone on with), and
        a Welcome sent."""
        if self._refused_hello(peer, msg, user, address):
            return
        key = (msg.instance.model, msg.instance.revision)
        if key in self._revisions and self._revisions[key] is None:
            self._revisions[key] = ModelSettings.of(msg.instance)  # a rollout's new revision, first seen
        self._models.setdefault(msg.instance.model, ModelSettings.of(msg.instance))
        self._bind(peer, msg)
        if self._reconnected(msg):
            # The same agent process on a new connection: its engine, cache and requests are as they
            # were, so its session goes on (a new one would abandon its requests as lost).
            view = self._registry.get(msg.agent_id)
            log.info("agent %s reconnected (session %d goes on)", msg.agent_id, view.session if view else 0)
            if view is not None and view.info.role != msg.instance.role:
                # Another replica's leader changed its role: this replica takes it from the Hello.
                self._registry.set_role(msg.agent_id, msg.instance.role)
        else:
            self._new_session(msg)
        self._send(
            peer,
            Welcome(
                protocol_version=PROTOCOL_VERSION,
                agent_id=msg.agent_id,
                heartbeat_interval_s=self._config.heartbeat_interval_s,
                heartbeat_timeout_s=self._config.heartbeat_timeout_s,
                # An agent of 1.0 refuses fields it does not know: its Welcome leaves the minor out.
                protocol_minor=PROTOCOL_MINOR if msg.protocol_minor else 0,
            ),
        )

    def _refused_hello(self, peer: bytes, msg: Hello, user: str, address: str) -> bool:
        """Refuse a Hello that may not start a session (another major version, no agent id, any of
        ``_hello_refusal``'s reasons); whether it was."""
        if msg.protocol_version != PROTOCOL_VERSION:
            theirs = f"{msg.protocol_version}.{msg.protocol_minor}"
            self._refuse(
                peer,
                VersionMismatch.code,
                f"agent speaks protocol v{theirs}, orchestrator v{_OURS}: the major versions must match",
            )
            return True
        if not msg.agent_id:
            self._refuse(peer, "invalid_hello", "agent_id must not be empty")
            return True
        labels = label_problem(msg.instance.labels)
        if labels is not None:
            self._refuse(peer, "invalid_hello", f"instance labels: {labels}")
            return True
        refusal = self._hello_refusal(peer, msg, user, address)
        if refusal is None:
            return False
        code, reason = refusal
        log.warning("refusing Hello as %r from %s: %s", msg.agent_id, self._who(peer), reason)
        self._refuse(peer, code, reason)
        return True

    def _bind(self, peer: bytes, msg: Hello) -> None:
        """The connection speaks for ``msg.agent_id`` from now on (a connection it had before, no more)."""
        if self._refused_peers:
            self._refused_peers = {k for k in self._refused_peers if k[0] != peer}
        old_peer = self._agent_to_peer.get(msg.agent_id)
        if old_peer is not None and old_peer != peer:
            self._peer_to_agent.pop(old_peer, None)
        self._peer_to_agent[peer] = msg.agent_id
        self._agent_to_peer[msg.agent_id] = peer
        self._minors[msg.agent_id] = msg.protocol_minor

    def _new_session(self, msg: Hello) -> None:
        """A new session in the registry: maybe a new engine, so nothing it cached is known any more."""
        theirs = f"{msg.protocol_version}.{msg.protocol_minor}"
        self._incarnations[msg.agent_id] = msg.incarnation
        self.kv_index.drop(msg.agent_id)
        view = self._registry.hello(msg.agent_id, msg.instance, self._clock.monotonic(), protocol=theirs)
        if theirs != _OURS:  # one side is upgraded before the other: fine within a major version
            log.info("agent %s speaks protocol v%s, this orchestrator v%s", msg.agent_id, theirs, _OURS)
        if self._hello_hook is not None:
            self._hello_hook(msg.instance)
        if view.admin_draining and self.leadership.is_leader:
            # An operator drained it, and the agent came back as a new process that does not know.
            self._tell_drained(msg.agent_id)
        info = msg.instance
        log.info(
            "hello from %s (session %d): %s %s at %s",
            msg.agent_id,
            view.session,
            info.role,
            info.model,
            info.url,
        )
        missing = info.capabilities.missing()
        if missing:
            log.warning(
                "instance %s: its engine at %s lacks %s: streams it cannot say the ids of are relayed "
                "as they come and are not resumable (docs/engines.md)",
                msg.agent_id,
                info.url,
                ", ".join(missing),
            )

    def _tell_drained(self, agent_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._redrain(agent_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _redrain(self, agent_id: str) -> None:
        try:
            await self.send_command(agent_id, Drain())
        except RequestError as exc:  # its heartbeats say it is not draining: routing already knows
            log.warning("could not tell %s again that it is drained: %s", agent_id, exc)

    def _reconnected(self, msg: Hello) -> bool:
        """Whether this Hello is a live session's agent process back on a new connection."""
        view = self._registry.get(msg.agent_id)
        return (
            bool(msg.incarnation)
            and self._incarnations.get(msg.agent_id) == msg.incarnation
            and view is not None
            and view.state != "dead"
            and view.info == replace(msg.instance, role=view.info.role)  # a role it took goes on too
        )

    def _hello_refusal(self, peer: bytes, msg: Hello, user: str, address: str) -> tuple[str, str] | None:
        """Why this Hello may not start a session ((code, reason)), or None."""
        agent_id = msg.agent_id
        if self._curve is not None and user != agent_id:
            return (
                "unauthorized",
                f"this connection's key is {user!r}'s: it may not say Hello as {agent_id!r}",
            )
        # The gateway sends users' prompts and the engine key there: not wherever an agent says.
        url_problem = self.engine_url_problem(msg.instance.url, address)
        if url_problem is not None:
            return ENGINE_URL_REFUSED, url_problem
        old_peer = self._agent_to_peer.get(agent_id)
        if (
            self._curve is None
            and old_peer not in (None, peer)
            and self._registry.is_live(agent_id)
            and self._still_open(old_peer, agent_id)
        ):
            return (
                "agent_id_in_use",
                f"agent id {agent_id!r} is held by a live session on another connection; it is free "
                "again once that connection closes, says Goodbye or goes silent",
            )
        fixed = self._models.get(msg.instance.model)
        said = ModelSettings.of(msg.instance)
        if fixed is None or said == fixed:
            return None
        hint = ""
        key = (msg.instance.model, msg.instance.revision)
        if key in self._revisions:  # a revision a rollout admits: its own settings, once seen
            admitted = self._revisions[key]
            if admitted is None or admitted == said:
                return None
            fixed = admitted
        elif said.revision != fixed.revision:
            hint = f"; a new revision joins during a rollout (vllm-disagg rollout --to {said.revision})"
        return "model_mismatch", (
            f"model {msg.instance.model!r} is served with {fixed.describe()}; this instance says "
            f"{said.describe()}{hint}"
        )

    def engine_url_problem(self, url: str, address: str) -> str | None:
        """Why an agent connecting from the IP ``address`` may not announce the engine ``url``, or None."""
        return hello_url_problem(url, address, self.endpoint, self._engine_networks)

    def admit_revisions(self, model: str, old: str, new: str) -> None:
        """A rollout begins: Hellos of ``model`` at revision ``old`` or ``new`` are accepted, each
        revision held to the settings of its first instance."""
        fixed = self._models.get(model)
        if fixed is not None and fixed.revision == old:
            self._revisions[(model, old)] = fixed
        self._revisions.setdefault((model, new), None)

    def settle_revision(self, model: str, revision: str) -> None:
        """A rollout completed (or rolled back): the model's settings are ``revision``'s from now on."""
        settings = self._revisions.get((model, revision))
        if settings is not None:
            self._models[model] = settings

    def _still_open(self, peer: bytes, agent_id: str) -> bool:
        """Whether ``peer``'s connection is open, found by telling it that another claims its id.

        libzmq refuses a send to a connection it has closed or is closing, which is what an agent's own
        reconnect leaves behind; a connection that takes the message is an agent still there.
        """
        claim = Refuse(
            code="agent_id_in_use",
            reason=f"another connection said Hello as {agent_id!r}; it was refused while this one is open",
        )
        return self._send(peer, claim)

    def _on_heartbeat(self, peer: bytes, msg: Heartbeat) -> None:
        agent_id = self._peer_to_agent.get(peer)
        if agent_id is not None:
            clock = self._clock
            view = self._registry.heartbeat(agent_id, msg, clock.monotonic(), clock.wall())
            if view is not None:
                if view.state == "dead":  # its engine stopped: nothing it cached is there any more
                    self.kv_index.drop(agent_id)
                return
        self._refuse_unknown(peer, agent_id)

    def _on_kv_events(self, peer: bytes, msg: KvEvents) -> None:
        agent_id = self._peer_to_agent.get(peer)
        if agent_id is None or not self._registry.is_live(agent_id):
            self._refuse_unknown(peer, agent_id)
            return
        if msg.missed < 0:
            self._refuse(
                peer, FieldTypeError.code, f"field 'missed': expected a count >= 0, got {msg.missed}"
            )
            return
        applied = self.kv_index.apply(agent_id, msg.events)
        self._metrics.kv_events(agent_id, applied, msg.missed)

    def _refuse_unknown(self, peer: bytes, agent_id: str | None) -> None:
        if agent_id is not None:
            self._forget_peer(agent_id)
        self._refuse(
            peer,
            "unknown_agent",
            "no live session on this connection: send Hello first "
            "(the orchestrator restarted, the session expired, or the agent reconnected)",
        )

    def _on_ack(self, peer: bytes, msg: Ack) -> None:
        pending = self._pending.get(msg.id)
        if pending is None or self._agent_to_peer.get(pending.agent_id) != peer:
            log.debug("ack %d from %s matches no pending command", msg.id, self._who(peer))
            return
        del self._pending[msg.id]
        if not pending.future.done():
            pending.future.set_result(msg)

    def _on_goodbye(self, peer: bytes, msg: Goodbye) -> None:
        agent_id = self._peer_to_agent.get(peer)
        if agent_id is None:
            return
        self._registry.goodbye(agent_id, msg.reason)
        self._forget_peer(agent_id)
        self.kv_index.drop(agent_id)
        log.info("goodbye from %s: %s", agent_id, msg.reason or "no reason given")

    def _forget_peer(self, agent_id: str) -> None:
        peer = self._agent_to_peer.pop(agent_id, None)
        if peer is not None:
            self._peer_to_agent.pop(peer, None)

    async def send_command(
        self, agent_id: str, payload: CommandPayload, timeout_s: float | None = None
    ) -> Ack:
        """Send a command and wait for its ``Ack`` (``config.command_timeout_s`` by default).

        The agent gets it as its protocol minor reads it (before 1.5: as string args), and its Ack's
        result comes back typed whichever minor it speaks. It carries the leader's epoch. Raises
        ``NotLeader`` (a replica that does not lead), ``AgentUnknown``, ``AgentUnreachable``,
        ``AgentTooOld`` or ``CommandTimeout``.
        """
        kind = payload.KIND
        epoch = self.leadership.require(f"{kind} to {agent_id!r}")
        if timeout_s is None:
            timeout_s = self._config.command_timeout_s
        if self._registry.get(agent_id) is None:
            raise AgentUnknown(f"no instance {agent_id!r}")
        peer = self._agent_to_peer.get(agent_id)
        if peer is None or not self._registry.is_live(agent_id):
            raise AgentUnreachable(f"instance {agent_id!r} has no live session")
        minor = self._minors.get(agent_id, 0)
        since = COMMAND_SINCE_MINOR.get(kind, 0)
        if minor < since:
            # Its codec would refuse the kind as an unknown literal, and the command would time out.
            raise AgentTooOld(
                f"instance {agent_id!r} speaks protocol v{PROTOCOL_VERSION}.{minor}: "
                f"{kind} needs v{PROTOCOL_VERSION}.{since}"
            )
        command_id = self._next_command_id
        self._next_command_id += 1
        future: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        self._pending[command_id] = _Pending(agent_id, future)
        try:
            if not self._send(peer, Command.of(command_id, payload, epoch).for_minor(minor)):
                raise AgentUnreachable(f"instance {agent_id!r} is not connected")
            try:
                ack = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                raise CommandTimeout(
                    f"instance {agent_id!r} did not acknowledge {kind} within {timeout_s}s"
                ) from None
        finally:
            self._pending.pop(command_id, None)
        if ack.code == STALE_EPOCH:  # a newer leader has commanded it: this one's term is over
            log.warning("instance %r refused %s of epoch %d: %s", agent_id, kind, epoch, ack.error)
        if ack.result is None and ack.detail:  # an agent of 1.3 or 1.4: its counts as strings
            ack = replace(ack, result=from_detail(kind, ack.detail))
        return ack


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait until it has finished."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
