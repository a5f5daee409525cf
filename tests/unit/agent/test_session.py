"""The agent's protocol session: Hello backoff (pure) and its reactions to each orchestrator message.

The reactions run in-process over a real ROUTER/DEALER pair on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator
from typing import TypeVar

import pytest

from vllm_disagg.agent.session import (
    EXIT_REFUSED,
    AgentSession,
    RoleSwitch,
    SessionEnd,
    hello_delay,
)
from vllm_disagg.protocol.commands import SetRole
from vllm_disagg.protocol.messages import (
    HELLO_BACKOFF_MAX_S,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    RESTART_REQUIRED,
    Ack,
    Command,
    Goodbye,
    Heartbeat,
    Hello,
    InstanceInfo,
    Message,
    MetricsSnapshot,
    Refuse,
    Role,
    Welcome,
)
from vllm_disagg.protocol.transport import DealerTransport, RouterTransport

M = TypeVar("M", bound=Message)


@pytest.mark.parametrize(
    ("attempt", "base"),
    [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.6), (5, 2.0), (100, 2.0)],
    ids=lambda v: str(v),
)
def test_hello_delay_doubles_from_a_tenth_of_a_second_to_two_seconds_with_jitter(
    attempt: int, base: float
) -> None:
    assert hello_delay(attempt, 0.0) == pytest.approx(base / 2)
    assert hello_delay(attempt, 0.999999) == pytest.approx(base, rel=1e-5)


def test_hello_delay_is_never_above_the_cap_nor_zero() -> None:
    rng = random.Random(7)
    delays = [hello_delay(a, rng.random()) for a in range(50) for _ in range(20)]
    assert max(delays) <= HELLO_BACKOFF_MAX_S
    assert min(delays) >= 0.05
    assert len({round(d, 6) for d in delays[-100:]}) > 50  # jittered, not one fixed value


def new_session(transport: DealerTransport) -> AgentSession:
    return AgentSession(
        transport,
        "a1",
        InstanceInfo(url="http://e", role="both", model="m"),
        engine_state=lambda: "ready",
        metrics=MetricsSnapshot,
        heartbeat_interval_s=0.25,
    )


@pytest.fixture
async def pair() -> AsyncIterator[tuple[RouterTransport, DealerTransport]]:
    router = RouterTransport("tcp://127.0.0.1:0")
    dealer = DealerTransport(router.endpoint)
    try:
        yield router, dealer
    finally:
        dealer.close()
        router.close()


WELCOME = Welcome(PROTOCOL_VERSION, "a1", heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0)
REACTIONS = [
    ("welcome registers and adopts the interval", False, WELCOME, dict(registered=True, interval_s=0.5)),
    ("unknown_agent sends it back to hello", True, Refuse("unknown_agent", "who?"), dict(registered=False)),
    ("not_registered sends it back to hello", True, Refuse("not_registered", "who?"), dict(registered=False)),
    ("an orchestrator goodbye sends it back to hello", True, Goodbye("restarting"), dict(registered=False)),
    ("another refusal is only logged", True, Refuse("field_type_error", "bad"), dict(registered=True)),
    ("drain sets draining", True, Command(1, "drain"), dict(draining=True, registered=True)),
    ("undrain clears draining", True, Command(2, "undrain"), dict(draining=False)),
    ("a message meant for the orchestrator is ignored", True, Heartbeat(1, "ready"), dict(registered=True)),
]


@pytest.mark.parametrize(
    ("registered", "message", "after"), [r[1:] for r in REACTIONS], ids=[r[0] for r in REACTIONS]
)
async def test_session_reactions(
    pair: tuple[RouterTransport, DealerTransport],
    registered: bool,
    message: Message,
    after: dict[str, object],
) -> None:
    session = new_session(pair[1])
    session.registered = registered
    session.draining = isinstance(message, Command) and message.kind == "undrain"
    session.handle(message)
    assert {k: getattr(session, k) for k in after} == after


async def test_commands_are_acked_and_shutdown_ends_the_session_with_exit_0(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    router, dealer = pair
    session = new_session(dealer)
    run = asyncio.create_task(session.run())
    try:
        first = await asyncio.wait_for(router.recv(), 30)
        assert isinstance(first.message, Hello)
        assert router.send(first.peer, WELCOME)
        assert router.send(first.peer, Command(5, "drain"))
        assert router.send(first.peer, Command(6, "shutdown"))
        end = await asyncio.wait_for(run, 30)
    finally:
        run.cancel()
    assert end == SessionEnd(exit_code=0, reason="shutdown command", command_id=6)
    acks: list[Ack] = []
    while len(acks) < 2:
        incoming = await asyncio.wait_for(router.recv(), 30)
        if isinstance(incoming.message, Ack):
            acks.append(incoming.message)
    assert acks == [Ack(5, True), Ack(6, True)]


async def test_a_version_mismatch_ends_the_session_with_the_refused_exit_code(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    router, dealer = pair
    run = asyncio.create_task(new_session(dealer).run())
    try:
        hello = await asyncio.wait_for(router.recv(), 30)
        assert router.send(hello.peer, Refuse("version_mismatch", "v9 only"))
        end = await asyncio.wait_for(run, 30)
    finally:
        run.cancel()
    assert end == SessionEnd(exit_code=EXIT_REFUSED, reason="version_mismatch: v9 only")


async def test_a_burst_of_refused_heartbeats_triggers_one_hello_not_one_each(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    # Every heartbeat in flight when the orchestrator forgot us comes back refused.
    session = new_session(pair[1])
    session.registered = True
    session.handle(Refuse("unknown_agent", "who?"))
    assert session.registered is False
    assert session._wake.is_set()  # the talk loop says Hello at once
    session._wake.clear()
    for _ in range(3):
        session.handle(Refuse("unknown_agent", "who?"))
    assert not session._wake.is_set()  # later refusals wait for the Hello backoff instead


async def acks_of(
    pair: tuple[RouterTransport, DealerTransport], session: AgentSession, welcome: Welcome, *commands: Command
) -> list[Ack]:
    """The session's Acks to ``commands``, sent after ``welcome``."""
    router, _ = pair
    run = asyncio.create_task(session.run())
    try:
        hello = await asyncio.wait_for(router.recv(), 30)
        assert router.send(hello.peer, welcome)
        for command in commands:
            assert router.send(hello.peer, command)
        acks: list[Ack] = []
        while len(acks) < len(commands):
            incoming = await asyncio.wait_for(router.recv(), 30)
            if isinstance(incoming.message, Ack):
                acks.append(incoming.message)
        return acks
    finally:
        run.cancel()


CURRENT = dataclasses.replace(WELCOME, protocol_minor=PROTOCOL_MINOR)  # an orchestrator of this release


def producer(role: Role) -> RoleSwitch:
    """A launched ``kv_producer`` engine: prefill as it runs, decode after a restart; never both."""
    if role == "decode":
        return RoleSwitch("restart", "launched as a producer")
    return RoleSwitch("refuse", "no connector for both") if role == "both" else RoleSwitch("live")


def role_of(session: AgentSession) -> Role:
    """Its role now: read in a call, as mypy would apply an earlier assert's narrowing past an await."""
    return session.instance.role


async def test_set_role_is_acked_and_the_hello_says_it_from_then_on_unless_the_engine_cannot(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    session = new_session(pair[1])
    session.role_switch = producer
    commands = [Command(1, "set_role", {"role": "both"}), Command(2, "set_role", {"role": "chef"})]
    acks = await acks_of(pair, session, WELCOME, *commands, Command(3, "set_role", {"role": "prefill"}))
    assert acks == [
        Ack(1, False, "no connector for both"),
        Ack(2, False, "unknown role 'chef'; one of ['prefill', 'decode', 'both']"),
        Ack(3, True),
    ]
    assert session.instance.role == "prefill" and session.registered, "no new Hello: the session goes on"


async def test_a_role_that_needs_a_restart_is_answered_restart_required_then_restarted_when_asked(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    session = new_session(pair[1])
    session.role_switch = producer
    restarted: list[Role] = []
    session.restart_as = restarted.append
    ask, restart = {"role": "decode"}, {"role": "decode", "restart": "yes"}
    acks = await acks_of(pair, session, CURRENT, Command(1, "set_role", ask))
    assert acks == [Ack(1, False, "launched as a producer", code=RESTART_REQUIRED)]
    assert session.instance.role == "both" and not restarted, "nothing changes until the orchestrator says"
    acks = await acks_of(pair, session, CURRENT, Command(2, "set_role", restart))
    assert acks == [Ack(2, True)] and restarted == ["decode"] and role_of(session) == "decode"


@pytest.mark.parametrize(
    ("ask", "restart"),
    [
        pytest.param(
            Command(1, "set_role", {"role": "decode"}),
            Command(2, "set_role", {"role": "decode", "restart": "yes"}),
            id="args of an orchestrator before 1.5",
        ),
        pytest.param(
            Command.of(1, SetRole("decode")), Command.of(2, SetRole("decode", restart=True)), id="typed (1.5)"
        ),
    ],
)
async def test_a_role_change_means_the_same_as_args_or_as_a_typed_payload(
    pair: tuple[RouterTransport, DealerTransport], ask: Command, restart: Command
) -> None:
    session = new_session(pair[1])
    session.role_switch = producer
    restarted: list[Role] = []
    session.restart_as = restarted.append
    assert await acks_of(pair, session, CURRENT, ask) == [
        Ack(1, False, "launched as a producer", code=RESTART_REQUIRED)
    ]
    assert await acks_of(pair, session, CURRENT, restart) == [Ack(2, True)]
    assert restarted == ["decode"] and session.instance.role == "decode"


async def test_a_typed_role_the_agent_does_not_know_is_answered_with_the_roles_it_does(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    session = new_session(pair[1])
    assert await acks_of(pair, session, CURRENT, Command.of(1, SetRole("chef"))) == [
        Ack(1, False, "unknown role 'chef'; one of ['prefill', 'decode', 'both']")
    ]


async def test_an_orchestrator_of_1_1_gets_a_plain_refusal_and_an_agent_that_cannot_restart_refuses(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    session = new_session(pair[1])
    session.role_switch = producer
    session.restart_as = lambda role: None
    old = dataclasses.replace(WELCOME, protocol_minor=1)  # it would not know the Ack's code
    assert await acks_of(pair, session, old, Command(1, "set_role", {"role": "decode"})) == [
        Ack(1, False, "launched as a producer")
    ]
    session.restart_as = None  # e.g. an attached engine: not ours to restart
    restart = {"role": "decode", "restart": "yes"}
    assert await acks_of(pair, session, CURRENT, Command(2, "set_role", restart)) == [
        Ack(2, False, "launched as a producer")
    ]
    assert session.instance.role == "both"


async def test_a_new_hello_goes_out_even_when_a_welcome_to_the_previous_one_arrives_first(
    pair: tuple[RouterTransport, DealerTransport],
) -> None:
    """The Welcome registers what the earlier Hello said: the change must still be said."""
    router, dealer = pair
    session = new_session(dealer)
    run = asyncio.create_task(session.run())
    try:
        first = await asyncio.wait_for(router.recv(), 30)
        assert router.send(first.peer, WELCOME)
        await asyncio.wait_for(_until(router, Heartbeat), 30)
        changed = InstanceInfo(url="http://e", role="both", model="m", block_size=32)
        session.set_instance(changed)
        session.handle(WELCOME)  # in flight before the change: read before the talk loop runs again
        hello = await asyncio.wait_for(_until(router, Hello), 30)
        assert hello.instance == changed
    finally:
        run.cancel()


async def _until(router: RouterTransport, kind: type[M]) -> M:
    while True:
        incoming = await router.recv()
        if isinstance(incoming.message, kind):
            return incoming.message
