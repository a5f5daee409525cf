"""A KV move: ``kv_grant`` to the holder, then ``kv_fetch`` of what it holds to the receiver; every way
it can fail is a result with a reason, never an exception."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import pytest

from tests.unit.scheduling_support import view
from vllm_disagg.errors import AgentTooOld, AgentUnreachable, CommandError, CommandTimeout
from vllm_disagg.orchestrator.control.kv_moves import ControlKvMover, KvMoveSettings, MoveResult
from vllm_disagg.orchestrator.control.plane import ControlPlane
from vllm_disagg.orchestrator.state.views import GatewayRegistry, InstanceView
from vllm_disagg.protocol.commands import CommandPayload, FetchResult, GrantResult, KvFetch, KvGrant
from vllm_disagg.protocol.messages import Ack, CommandKind

KEYS = [bytes([0xB0 + i]) * 32 for i in range(4)]
HEX = [k.hex() for k in KEYS]
KEY_OF = {"p0": b"P" * 40, "d0": b"D" * 40}


def pool_view(agent_id: str, endpoint: str = "") -> InstanceView:
    v = view(agent_id, kv_connector="vllm-disagg")
    return dataclasses.replace(v, info=dataclasses.replace(v.info, kv_pool_endpoint=endpoint))


class FakeRegistry:
    def __init__(self, *views: InstanceView) -> None:
        self.views = {v.agent_id: v for v in views}

    def get(self, agent_id: str) -> InstanceView | None:
        return self.views.get(agent_id)


class FakeControl:
    """Answers each command with what ``answer(kind, payload)`` returns, or raises it."""

    def __init__(self, answer: Callable[[CommandKind, CommandPayload], Ack | CommandError]) -> None:
        self.answer = answer
        self.sent: list[tuple[str, CommandPayload, float | None]] = []

    async def send_command(
        self, agent_id: str, payload: CommandPayload, timeout_s: float | None = None
    ) -> Ack:
        self.sent.append((agent_id, payload, timeout_s))
        answer = self.answer(payload.KIND, payload)
        if isinstance(answer, CommandError):
            raise answer
        return answer

    def public_key_of(self, agent_id: str) -> bytes | None:
        return KEY_OF.get(agent_id)


def mover(
    answer: Callable[[CommandKind, CommandPayload], Ack | CommandError], **views: str
) -> tuple[ControlKvMover, FakeControl]:
    control = FakeControl(answer)
    endpoints = {"p0": "tcp://p0:1", "d0": "tcp://d0:1", **views}
    registry = FakeRegistry(*(pool_view(a, e) for a, e in endpoints.items()))
    settings = KvMoveSettings(grant_ttl_s=9.0, grant_timeout_s=0.5, fetch_timeout_s=1.5)
    return ControlKvMover(cast(ControlPlane, control), cast(GatewayRegistry, registry), settings), control


def granting(
    held: int, fetch: Ack | CommandError | None = None
) -> Callable[[CommandKind, CommandPayload], Any]:
    def answer(kind: CommandKind, payload: CommandPayload) -> Ack | CommandError:
        if kind == "kv_grant":
            return Ack(1, True, result=GrantResult(requested=4, held=held))
        return fetch or Ack(2, True, result=FetchResult(requested=held, already_held=1, reserved=held - 1))

    return answer


async def test_a_move_grants_on_the_holder_then_fetches_what_it_holds_to_the_receiver() -> None:
    move, control = mover(granting(held=3))
    result = await move.move("p0", "d0", HEX)
    assert result == MoveResult(True, requested=4, held=3, already_held=1, reserved=2)
    (g_to, grant, g_wait), (f_to, fetch, f_wait) = control.sent
    assert isinstance(grant, KvGrant) and isinstance(fetch, KvFetch)
    assert (g_to, g_wait) == ("p0", 0.5)
    assert grant == KvGrant(grant.token, KEYS, KEY_OF["d0"].decode(), 9.0) and len(grant.token) >= 16
    assert (f_to, f_wait) == ("d0", 2.0)  # its own timeout, and a margin for the Ack
    assert fetch == KvFetch(grant.token, KEYS[:3], "tcp://p0:1", KEY_OF["p0"].decode(), 1.5)


async def test_every_move_has_a_token_of_its_own() -> None:
    move, control = mover(granting(held=4))
    await move.move("p0", "d0", HEX)
    await move.move("p0", "d0", HEX)
    tokens = {c[1].token for c in control.sent if isinstance(c[1], KvGrant)}
    assert len(tokens) == 2


@pytest.mark.parametrize(
    ("answer", "reason", "commands"),
    [
        pytest.param(
            lambda k, a: CommandTimeout("slow"), "grant_timeout", ["kv_grant"], id="grant times out"
        ),
        pytest.param(
            lambda k, a: AgentUnreachable("gone"), "unreachable", ["kv_grant"], id="holder unreachable"
        ),
        pytest.param(lambda k, a: AgentTooOld("1.2"), "too_old", ["kv_grant"], id="holder too old"),
        pytest.param(
            lambda k, a: Ack(1, False, "no pool"), "grant_refused", ["kv_grant"], id="grant refused"
        ),
        pytest.param(granting(held=0), "not_held", ["kv_grant"], id="first block no longer held"),
        pytest.param(
            granting(held=4, fetch=CommandTimeout("slow")),
            "fetch_timeout",
            ["kv_grant", "kv_fetch"],
            id="fetch times out",
        ),
        pytest.param(
            granting(held=4, fetch=Ack(2, True, result=FetchResult(requested=4, already_held=0, reserved=0))),
            "fetch_refused",
            ["kv_grant", "kv_fetch"],
            id="a fetch that takes none of the blocks",
        ),
        pytest.param(
            granting(held=4, fetch=Ack(2, False, "holder refused the token")),
            "fetch_refused",
            ["kv_grant", "kv_fetch"],
            id="fetch refused",
        ),
    ],
)
async def test_a_failure_is_a_result_with_its_reason(
    answer: Callable[[CommandKind, CommandPayload], Any], reason: str, commands: list[str]
) -> None:
    move, control = mover(answer)
    result = await move.move("p0", "d0", HEX)
    assert (result.ok, result.reason, result.requested) == (False, reason, 4)
    assert result.error
    assert [c[1].KIND for c in control.sent] == commands


@pytest.mark.parametrize(
    ("holder", "receiver", "reason"),
    [
        pytest.param("p0", "dx", "unreachable", id="an unknown receiver"),
        pytest.param("px", "d0", "unreachable", id="an unknown holder"),
        pytest.param("pn", "d0", "no_pool", id="a holder serving no pool"),
        pytest.param("p0", "dn", "no_pool", id="a receiver serving no pool"),
    ],
)
async def test_nothing_is_sent_between_instances_that_cannot_move_kv(
    holder: str, receiver: str, reason: str
) -> None:
    move, control = mover(granting(held=4), pn="", dn="")
    result = await move.move(holder, receiver, HEX)
    assert (result.ok, result.reason) == (False, reason)
    assert control.sent == []


def node_mover(
    answer: Callable[[CommandKind, CommandPayload], Ack | CommandError],
) -> tuple[ControlKvMover, FakeControl]:
    """p0 runs its host's pool, which d0 shares; d1 runs its own on another host."""
    control = FakeControl(answer)
    member = pool_view("d0")
    member = dataclasses.replace(member, info=dataclasses.replace(member.info, kv_pool_node="p0"))
    registry = FakeRegistry(pool_view("p0", "tcp://p0:1"), member, pool_view("d1", "tcp://d1:1"))
    return ControlKvMover(cast(ControlPlane, control), cast(GatewayRegistry, registry)), control


async def test_engines_sharing_their_host_s_pool_move_nothing_between_them() -> None:
    move, control = node_mover(granting(held=4))
    result = await move.move("p0", "d0", HEX)
    assert (result.ok, result.reserved, result.already_held) == (True, 0, 4)
    assert control.sent == []  # the blocks are in the memory both engines map


async def test_the_agent_running_a_shared_pool_grants_for_the_engines_that_share_it() -> None:
    move, control = node_mover(granting(held=4))
    result = await move.move("d0", "d1", HEX)  # d0's engine saved them: they are in p0's pool
    assert result.ok
    assert [(agent, payload.KIND) for agent, payload, _ in control.sent] == [
        ("p0", "kv_grant"),
        ("d1", "kv_fetch"),
    ]
    fetch = control.sent[1][1]
    assert isinstance(fetch, KvFetch) and fetch.endpoint == "tcp://p0:1"
