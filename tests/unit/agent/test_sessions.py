"""One agent, three orchestrator replicas: a session with each, one instance, one fence, one command log,
and a KV-event lane per session (a Welcome resyncs that replica's index alone).

Each replica is a real ROUTER socket on loopback speaking the project's codec; the agent is a real
``Sessions`` with its DEALER sockets, run in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from vllm_disagg import jsonutil
from vllm_disagg.agent.command_log import CommandLog
from vllm_disagg.agent.fencing import stale_error
from vllm_disagg.agent.kv_forwarder import KvEventForwarder
from vllm_disagg.agent.main import add_arguments, config_from_args
from vllm_disagg.agent.session import EXIT_OK, EXIT_REFUSED, NO_POOL, RoleSwitch, SessionEnd
from vllm_disagg.agent.sessions import Sessions
from vllm_disagg.cli.commands import main
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.commands import CommandPayload, Drain, KvGrant, SetRole, Shutdown, Undrain
from vllm_disagg.protocol.messages import (
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    STALE_EPOCH,
    Ack,
    Command,
    Heartbeat,
    Hello,
    InstanceInfo,
    KvEvent,
    KvEvents,
    Message,
    MetricsSnapshot,
    Refuse,
    Role,
    Welcome,
)
from vllm_disagg.protocol.transport import RouterTransport
from vllm_disagg.wire.kv_events import BlockStored, encode_batch

M = TypeVar("M", bound=Message)
INSTANCE = InstanceInfo(url="http://e", role="both", model="m")
DEADLINE_S = 30.0


class Replica:
    """One orchestrator replica's ROUTER, driven by the test; it records every message it reads."""

    def __init__(self) -> None:
        self.router = RouterTransport("tcp://127.0.0.1:0")
        self.endpoint = self.router.endpoint
        self.peer = b""
        self.seen: list[Message] = []

    async def next(self, kind: type[M], where: Callable[[M], bool] = lambda _: True) -> M:
        """The next ``kind`` message matching ``where``; others are recorded and skipped."""
        async with asyncio.timeout(DEADLINE_S):
            while True:
                incoming = await self.router.recv()
                assert incoming.error is None and incoming.message is not None, incoming.error
                self.seen.append(incoming.message)
                if isinstance(incoming.message, Hello):
                    self.peer = incoming.peer
                if isinstance(incoming.message, kind) and where(incoming.message):
                    return incoming.message

    def send(self, message: Message) -> None:
        assert self.router.send(self.peer, message), f"could not send {message.TAG}"

    async def welcome(
        self, minor: int = PROTOCOL_MINOR, where: Callable[[Hello], bool] = lambda _: True
    ) -> Hello:
        """Wait for a Hello (matching ``where``) and accept it with a fast heartbeat."""
        hello = await self.next(Hello, where)
        self.send(Welcome(PROTOCOL_VERSION, hello.agent_id, 0.05, 1.0, protocol_minor=minor))
        return hello

    async def command(self, command: Command) -> Ack:
        """Send ``command``, and its Ack."""
        self.send(command)
        return await self.next(Ack, lambda ack: ack.id == command.id)

    def count(self, kind: type[Message]) -> int:
        return sum(isinstance(m, kind) for m in self.seen)


class Agent:
    """``Sessions`` with three replicas, running."""

    def __init__(self, command_log: CommandLog | None = None) -> None:
        self.replicas = [Replica() for _ in range(3)]
        self.command_log = command_log
        self.sessions = Sessions(
            Sessions.dealers([r.endpoint for r in self.replicas], None),
            "a1",
            INSTANCE,
            engine_state=lambda: "ready",
            metrics=MetricsSnapshot,
            command_log=command_log,
        )
        self.task: asyncio.Task[SessionEnd] | None = None

    def start(self) -> Agent:
        self.task = asyncio.create_task(self.sessions.run())
        return self

    async def register(self, *minors: int) -> list[Hello]:
        """Every replica welcomes the agent (at these minors; the current one by default)."""
        minors = minors or (PROTOCOL_MINOR,) * len(self.replicas)
        return [await r.welcome(minor) for r, minor in zip(self.replicas, minors, strict=True)]

    async def end(self) -> SessionEnd:
        assert self.task is not None
        async with asyncio.timeout(DEADLINE_S):
            return await self.task

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.sessions.close()
        if self.command_log is not None:
            self.command_log.close()
        for replica in self.replicas:
            replica.router.close()


@pytest.fixture
async def make_agent() -> AsyncIterator[Callable[..., Agent]]:
    agents: list[Agent] = []

    def make(**kwargs: Any) -> Agent:
        agents.append(Agent(**kwargs))
        return agents[-1].start()

    yield make
    for agent in agents:
        await agent.close()


@pytest.fixture
async def agent(make_agent: Callable[..., Agent]) -> Agent:
    return make_agent()


async def test_the_agent_says_one_hello_to_every_replica_and_heartbeats_reach_each(agent: Agent) -> None:
    hellos = await agent.register()
    assert hellos[0] == hellos[1] == hellos[2], "one instance, one incarnation, to every replica"
    assert hellos[0].instance == INSTANCE and hellos[0].protocol_minor == PROTOCOL_MINOR
    for replica in agent.replicas:
        await replica.next(Heartbeat)
        await replica.next(Heartbeat)
    assert agent.sessions.registered and all(m.registered for m in agent.sessions.members)
    assert [m.endpoint for m in agent.sessions.members] == [r.endpoint for r in agent.replicas]


async def test_a_drain_from_one_replica_shows_in_the_heartbeats_to_all_three(agent: Agent) -> None:
    await agent.register()
    leader = agent.replicas[1]
    assert await leader.command(Command.of(1, Drain(), epoch=1)) == Ack(1, True)
    for replica in agent.replicas:
        await replica.next(Heartbeat, lambda h: h.draining)
    assert await leader.command(Command.of(2, Undrain(), epoch=1)) == Ack(2, True)
    for replica in agent.replicas:
        await replica.next(Heartbeat, lambda h: not h.draining)
    assert [r.count(Ack) for r in agent.replicas] == [0, 2, 0], "only the leader is answered"


async def test_a_role_obeyed_on_one_replica_is_said_in_a_new_hello_to_the_others(agent: Agent) -> None:
    first = await agent.register()
    leader, others = agent.replicas[0], agent.replicas[1:]
    assert await leader.command(Command.of(1, SetRole("prefill"), epoch=2)) == Ack(1, True)
    for replica in others:
        # A Hello the agent repeated before its first Welcome came (a slow machine) may still be queued,
        # saying the old role: the new role must come, in a Hello of its own.
        hello = await replica.welcome(where=lambda h: h.instance.role == "prefill")
        assert hello == dataclasses.replace(first[0], instance=dataclasses.replace(INSTANCE, role="prefill"))
    for _ in range(3):
        await leader.next(Heartbeat)
    assert leader.count(Hello) == 1, "the leader applies the role on the Ack: the session goes on"
    # And every later Hello says it (here: a replica that forgot the agent).
    others[0].send(Refuse("unknown_agent", "who?"))
    assert (await others[0].welcome()).instance.role == "prefill" == agent.sessions.instance.role


async def test_a_new_instance_said_through_any_session_is_said_to_every_replica(agent: Agent) -> None:
    await agent.register()
    changed = dataclasses.replace(INSTANCE, block_size=32)
    agent.sessions.members[2].set_instance(changed)  # as an attached engine's look does
    for replica in agent.replicas:
        # A Hello the agent repeated before its Welcome came (a slow machine) may still be queued:
        # the new instance must come, in a Hello of its own.
        assert (await replica.welcome(where=lambda h: h.instance == changed)).instance == changed
    assert agent.sessions.instance == changed


Step = tuple[int, int, CommandPayload]  # (replica, epoch, payload)
FENCING = [
    pytest.param([(0, 0, Drain())], [True], True, id="epoch 0 of a single orchestrator: obeyed"),
    pytest.param(
        [(0, 5, Undrain()), (1, 3, Drain())],
        [True, False],
        False,
        id="5 then 3 from another replica: refused stale_epoch, and the drain is not carried out",
    ),
    pytest.param([(0, 5, Drain()), (1, 5, Undrain())], [True, True], False, id="5 then 5: both obeyed"),
    pytest.param(
        [(0, 5, Drain()), (1, 7, Undrain()), (0, 5, Drain())],
        [True, True, False],
        False,
        id="5, 7, then 5 again: the deposed leader is refused",
    ),
]


@pytest.mark.parametrize(("steps", "obeyed", "draining"), FENCING)
async def test_commands_older_than_the_newest_epoch_obeyed_are_refused_and_not_carried_out(
    agent: Agent, steps: list[Step], obeyed: list[bool], draining: bool
) -> None:
    await agent.register()
    highest = 0
    for number, ((index, epoch, payload), ok) in enumerate(zip(steps, obeyed, strict=True), start=1):
        ack = await agent.replicas[index].command(Command.of(number, payload, epoch=epoch))
        refused = Ack(number, False, stale_error(epoch, highest), code=STALE_EPOCH)
        assert ack == (Ack(number, True) if ok else refused)
        highest = max(highest, epoch) if ok else highest
    assert (agent.sessions.draining, agent.sessions.highest_epoch) == (draining, highest)
    seqs = [member.seq for member in agent.sessions.members]  # heartbeats sent before the last Ack
    for replica, seq in zip(agent.replicas, seqs, strict=True):
        assert (await replica.next(Heartbeat, sent_after(seq))).draining is draining


def sent_after(seq: int) -> Callable[[Heartbeat], bool]:
    return lambda beat: beat.seq > seq


async def test_an_orchestrator_of_1_1_is_refused_without_the_code_it_would_not_know(agent: Agent) -> None:
    """A replica of an older release sends no epoch (0): after a leader's term, it is refused."""
    await agent.register(PROTOCOL_MINOR, 1, PROTOCOL_MINOR)
    assert await agent.replicas[0].command(Command.of(1, Drain(), epoch=5)) == Ack(1, True)
    assert await agent.replicas[1].command(Command(2, "undrain")) == Ack(2, False, stale_error(0, 5))
    assert agent.sessions.draining


async def test_only_a_current_leaders_shutdown_ends_the_agent(agent: Agent) -> None:
    await agent.register()
    assert await agent.replicas[0].command(Command.of(1, Undrain(), epoch=5)) == Ack(1, True)
    stale = await agent.replicas[1].command(Command.of(2, Shutdown(), epoch=4))
    assert stale == Ack(2, False, stale_error(4, 5), code=STALE_EPOCH)
    await agent.replicas[1].next(Heartbeat)
    assert agent.task is not None and not agent.task.done()
    assert await agent.replicas[2].command(Command.of(3, Shutdown(), epoch=6)) == Ack(3, True)
    assert await agent.end() == SessionEnd(EXIT_OK, "shutdown command", 3)


async def test_a_version_refusal_from_any_replica_ends_the_agent(agent: Agent) -> None:
    await agent.register()
    agent.replicas[2].send(Refuse("version_mismatch", "v9 only"))
    assert await agent.end() == SessionEnd(EXIT_REFUSED, "version_mismatch: v9 only")


async def test_the_command_log_has_a_line_per_command_in_order_written_before_it_is_carried_out(
    make_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    path = tmp_path / "commands.jsonl"
    agent = make_agent(command_log=CommandLog.open(str(path)))
    on_disk_at_restart: list[str] = []

    def restart_as(role: Role) -> None:
        on_disk_at_restart.append(path.read_text())

    agent.sessions.set_roles(lambda role: RoleSwitch("restart", "launched as a producer"), restart_as)
    await agent.register()
    r0, r1, r2 = agent.replicas
    grant = KvGrant("sekrit-token", [b"k" * 32], "", 30.0)
    assert (await r0.command(Command.of(1, Drain(), epoch=2))).ok
    assert await r1.command(Command.of(2, grant, epoch=2)) == Ack(2, False, NO_POOL)
    assert (await r1.command(Command.of(3, Undrain(), epoch=1))).code == STALE_EPOCH
    assert (await r2.command(Command.of(4, SetRole("decode", restart=True), epoch=3))).ok
    lines = [jsonutil.loads(line) for line in path.read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k not in ("t", "mono", "error")} for line in lines] == [
        {"id": 1, "kind": "drain", "epoch": 2, "from": r0.endpoint, "accepted": True, "code": ""},
        {"id": 2, "kind": "kv_grant", "epoch": 2, "from": r1.endpoint, "accepted": False, "code": ""},
        {"id": 3, "kind": "undrain", "epoch": 1, "from": r1.endpoint, "accepted": False, "code": STALE_EPOCH},
        {"id": 4, "kind": "set_role", "epoch": 3, "from": r2.endpoint, "accepted": True, "code": ""},
    ]
    assert [line["error"] for line in lines] == ["", NO_POOL, stale_error(1, 2), ""]
    assert all(a["mono"] <= b["mono"] for a, b in itertools.pairwise(lines))
    assert lines[-1]["t"] == pytest.approx(time.time(), abs=DEADLINE_S)
    assert "sekrit" not in path.read_text()
    assert len(on_disk_at_restart) == 1 and '"id":4' in on_disk_at_restart[0], "logged, then carried out"


def agent_config(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--agent-id", "a", "--role", "decode", *argv]))


@pytest.mark.parametrize(
    ("flag", "endpoints"),
    [
        pytest.param([], ("tcp://127.0.0.1:5555",), id="the default: one orchestrator"),
        pytest.param(["--orchestrator", "tcp://a:5555"], ("tcp://a:5555",), id="one endpoint"),
        pytest.param(
            ["--orchestrator", "tcp://a:5555, tcp://b:5555,tcp://c:5555"],
            ("tcp://a:5555", "tcp://b:5555", "tcp://c:5555"),
            id="replicas: comma-separated, spaces ignored",
        ),
    ],
)
def test_the_orchestrator_flag_takes_a_comma_separated_list(
    flag: list[str], endpoints: tuple[str, ...]
) -> None:
    assert agent_config(*flag).orchestrators == endpoints


@pytest.mark.parametrize(
    "value",
    ["tcp://a:5555,,tcp://b:5555", "tcp://a:5555,tcp://a:5555", "a:5555", ""],
    ids=["an empty entry", "one replica twice", "no scheme", "nothing"],
)
def test_an_orchestrator_list_that_cannot_work_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"agent\.orchestrator must be ZeroMQ endpoints"):
        agent_config("--orchestrator", value)


def test_a_command_log_that_cannot_be_written_exits_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert agent_config("--command-log", "/x/c.jsonl").command_log == "/x/c.jsonl"
    argv = ["agent", "--agent-id", "a", "--role", "decode", "--command-log", str(tmp_path / "no" / "c.jsonl")]
    assert main(argv) == 2
    assert "agent.command_log: cannot write" in capsys.readouterr().err


# --- KV events: one lane per session ---------------------------------------------------------------

BS = 4


def stored(first: int, count: int, parent: int | None = None) -> BlockStored:
    hashes = tuple(range(first, first + count))
    return BlockStored(hashes, parent, tuple(range(first * BS, (first + count) * BS)), BS)


def kinds(message: KvEvents) -> list[str]:
    return [event.kind for event in message.events]


async def kv_of(replica: Replica, done: Callable[[list[KvEvent]], bool]) -> list[KvEvent]:
    """Events of the replica's next KvEvents messages until ``done`` says they are all."""
    events: list[KvEvent] = []
    while not done(events):
        events += (await replica.next(KvEvents)).events
    return events


async def test_kv_events_reach_every_replica_and_a_rewelcomed_one_alone_gets_the_resync(agent: Agent) -> None:
    forwarder = KvEventForwarder("tcp://127.0.0.1:1", agent.sessions.members)  # fed by hand: no SUB
    agent.sessions.on_welcome(forwarder.session_started)
    await agent.register()
    for replica in agent.replicas:  # every Welcome: a resync of the (empty) mirror
        assert kinds(await replica.next(KvEvents)) == ["cleared"]
    forwarder.feed(encode_batch(0, 0.0, [stored(1, 2)]))
    forwarder.flush()
    for replica in agent.replicas:
        message = await replica.next(KvEvents)
        assert (message.seq, kinds(message)) == (2, ["stored"]), "each replica's messages count on their own"

    again = agent.replicas[1]
    again.send(Refuse("unknown_agent", "restarted"))  # it forgot the agent: a new Hello, a new Welcome
    await again.welcome()
    resync = await kv_of(again, lambda events: len(events) >= 2)
    assert [e.kind for e in resync] == ["cleared", "stored"] and resync[1].block_hashes == [1, 2]
    forwarder.feed(encode_batch(1, 0.0, [stored(3, 1, parent=2)]))
    forwarder.flush()
    for replica in agent.replicas:
        assert [e.block_hashes for e in await kv_of(replica, bool)] == [[3]]
    cleared = [
        sum(e.kind == "cleared" for m in r.seen if isinstance(m, KvEvents) for e in m.events)
        for r in agent.replicas
    ]
    assert cleared == [1, 2, 1], "no other replica got the snapshot again"
    assert forwarder.resyncs == 4


async def test_a_replica_that_joins_late_gets_the_whole_state_and_holds_nobody_back(agent: Agent) -> None:
    forwarder = KvEventForwarder("tcp://127.0.0.1:1", agent.sessions.members)
    agent.sessions.on_welcome(forwarder.session_started)
    early, late = agent.replicas[:2], agent.replicas[2]
    for replica in early:
        await replica.welcome()
        assert kinds(await replica.next(KvEvents)) == ["cleared"]
    await late.next(Hello)  # not answered yet: down, or still electing
    forwarder.feed(encode_batch(0, 0.0, [stored(1, 2)]))
    forwarder.feed(encode_batch(2, 0.0, [stored(3, 1, parent=2)]))  # batch 1 was lost on the way
    forwarder.flush()
    for replica in early:
        message = await replica.next(KvEvents)
        assert (kinds(message), message.missed) == (["stored", "stored"], 1)
    late.send(Welcome(PROTOCOL_VERSION, "a1", 0.05, 1.0, protocol_minor=PROTOCOL_MINOR))
    resync = await kv_of(late, lambda events: bool(events))
    assert [(e.kind, e.block_hashes) for e in resync] == [("cleared", []), ("stored", [1, 2, 3])]
    assert forwarder.queued_events == 0
