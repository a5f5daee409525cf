"""Mixed versions through a real orchestrator (protocol 1.5) and scripted agents of older minors on
real ZeroMQ: each agent gets a command in the form its minor reads (1.5: the typed payload; before:
the string args it always had), and the orchestrator reads each one's Ack back as the same typed
result. The other direction (an orchestrator of 1.4 and an agent of 1.5) is in
tests/unit/agent/test_session_kv.py and tests/unit/agent/test_session.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.integration.orchestrator_support import orch_config
from vllm_disagg.errors import AgentTooOld
from vllm_disagg.orchestrator.app import CONTROL_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.codec import for_minor
from vllm_disagg.protocol.commands import (
    AckResult,
    CommandPayload,
    Drain,
    FetchResult,
    GrantResult,
    KvFetch,
    KvGrant,
    SetRole,
    to_args,
    to_detail,
)
from vllm_disagg.protocol.messages import PROTOCOL_VERSION, Ack, Command, Hello, InstanceInfo, Welcome
from vllm_disagg.protocol.transport import DealerTransport

KEYS = [bytes([0xD0 + i]) * 32 for i in range(2)]
GRANT = KvGrant("q3Vx9GmS0bH2n7Lw4cTa8yKd", KEYS, "", 30.0)
FETCH = KvFetch("q3Vx9GmS0bH2n7Lw4cTa8yKd", KEYS, "tcp://10.0.0.5:11100", "", 2.0)
INFO = InstanceInfo(
    url="http://127.0.0.1:9",
    role="decode",
    model="m",
    engine="sim",
    kv_connector="vllm-disagg",
    kv_pool_endpoint="tcp://127.0.0.1:11999",
)


@pytest.fixture
async def server() -> AsyncIterator[OrchestratorServer]:
    server = await start_orchestrator(orch_config(preload_tokenizer_libs=False), shutdown_timeout_s=2.0)
    try:
        yield server
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def agent_of(server: OrchestratorServer, minor: int) -> AsyncIterator[DealerTransport]:
    """An agent of protocol 1.``minor``, registered: it says Hello as its release did."""
    transport = DealerTransport(server.zmq_endpoint)
    hello = for_minor(Hello(PROTOCOL_VERSION, f"a{minor}", INFO, "inc", protocol_minor=minor), minor)
    try:
        async with asyncio.timeout(20):
            while True:
                transport.send(hello)
                with contextlib.suppress(TimeoutError):
                    incoming = await asyncio.wait_for(transport.recv(), 0.2)
                    if isinstance(incoming.message, Welcome):
                        break
        yield transport
    finally:
        transport.close()


def ack_of(minor: int, command_id: int, result: AckResult | None) -> Ack:
    """The Ack an agent of that minor sends: a typed result from 1.5, string counts in 1.3 and 1.4."""
    if result is None or minor < 3:
        return Ack(command_id, True)
    if minor < 5:
        return Ack(command_id, True, detail=to_detail(result))
    return Ack(command_id, True, result=result)


@pytest.mark.parametrize(
    ("minor", "payload", "result"),
    [
        pytest.param(0, SetRole("prefill", restart=True), None, id="1.0 gets set_role as args"),
        pytest.param(4, SetRole("prefill", restart=True), None, id="1.4 gets set_role as args"),
        pytest.param(5, SetRole("prefill", restart=True), None, id="1.5 gets set_role typed"),
        pytest.param(4, Drain(), None, id="1.4 gets drain without args"),
        pytest.param(3, GRANT, GrantResult(2, 2), id="1.3 gets kv_grant as args and its counts are read"),
        pytest.param(4, FETCH, FetchResult(2, 1, 1), id="1.4 gets kv_fetch as args and its counts are read"),
        pytest.param(5, GRANT, GrantResult(2, 1), id="1.5 gets kv_grant typed and answers typed"),
        pytest.param(5, FETCH, FetchResult(2, 0, 2), id="1.5 gets kv_fetch typed and answers typed"),
    ],
)
async def test_each_agent_gets_a_command_in_the_form_of_its_minor_and_its_result_reads_typed(
    server: OrchestratorServer, minor: int, payload: CommandPayload, result: AckResult | None
) -> None:
    control = server.app[CONTROL_KEY]
    async with agent_of(server, minor) as agent:
        asked = asyncio.create_task(control.send_command(f"a{minor}", payload, timeout_s=10))
        incoming = await asyncio.wait_for(agent.recv(), 10)
        command = incoming.message
        assert isinstance(command, Command) and command.kind == payload.KIND
        if minor >= 5:
            assert (command.payload, command.args) == (payload, {})
        else:
            assert (command.payload, command.args) == (None, to_args(payload))
        assert command.read() == payload, "whichever form, the agent reads the same command"
        agent.send(ack_of(minor, command.id, result))
        ack = await asyncio.wait_for(asked, 10)
    assert (ack.id, ack.ok, ack.result) == (command.id, True, result)


@pytest.mark.parametrize("payload", [GRANT, FETCH], ids=["kv_grant", "kv_fetch"])
async def test_an_agent_before_kv_pools_is_never_sent_a_pool_command(
    server: OrchestratorServer, payload: CommandPayload
) -> None:
    control = server.app[CONTROL_KEY]
    async with agent_of(server, 2):
        with pytest.raises(AgentTooOld, match=r"needs v1\.3"):
            await control.send_command("a2", payload)
