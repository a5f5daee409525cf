"""An agent whose connection drops (a network blip, a stalled host) is heard again on its new connection.

Real orchestrator, the agent's real session and transport, and a TCP relay between them that the test
cuts. The orchestrator knows connections, not agents: the agent's heartbeats on the new connection
are refused as ``unknown_agent``, it says Hello there, and the orchestrator, which finds the old
connection closed, hands the agent its instance back at once: no waiting for the old session to go
silent (the heartbeat timeout here is a minute, longer than the test may take). The same agent
process (its Hello's incarnation) goes on with the same session, its requests untouched; another
process under the same id starts a new session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.helpers import TcpProxy, eventually
from tests.integration.orchestrator_support import MODEL, orch_config
from vllm_disagg.agent.session import AgentSession
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.curve import ClientCurve, load_keypair, load_public, make_keypair
from vllm_disagg.protocol.messages import InstanceInfo, MetricsSnapshot
from vllm_disagg.protocol.transport import DealerTransport


@pytest.fixture(params=["without keys", "with agent keys"])
async def orchestrator(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[OrchestratorServer, ClientCurve | None]]:
    keys: dict[str, str] = {}
    curve = None
    if request.param == "with agent keys":
        make_keypair(tmp_path, "orchestrator")
        make_keypair(tmp_path / "agents", "d0")
        keys = dict(
            curve_secret_key_file=str(tmp_path / "orchestrator.key_secret"),
            agent_keys_dir=str(tmp_path / "agents"),
        )
        curve = ClientCurve(
            load_keypair(str(tmp_path / "agents" / "d0.key_secret")),
            load_public(str(tmp_path / "orchestrator.key")),
        )
    server = await start_orchestrator(
        orch_config(heartbeat_timeout_s=60.0, **keys),
        shutdown_timeout_s=1.0,
    )
    try:
        yield server, curve
    finally:
        await server.close()


def new_session(transport: DealerTransport) -> AgentSession:
    info = InstanceInfo(url="http://127.0.0.1:9", role="decode", model=MODEL, engine="sim")
    return AgentSession(
        transport,
        "d0",
        info,
        engine_state=lambda: "ready",
        metrics=MetricsSnapshot,
        heartbeat_interval_s=0.05,
    )


async def test_an_agent_whose_connection_drops_goes_on_with_its_session_on_the_new_connection(
    orchestrator: tuple[OrchestratorServer, ClientCurve | None],
) -> None:
    server, curve = orchestrator
    proxy = await TcpProxy(int(server.zmq_endpoint.rsplit(":", 1)[1])).start()
    transport = DealerTransport(f"tcp://127.0.0.1:{proxy.port}", reconnect_ivl_ms=20, curve=curve)
    session = new_session(transport)
    run = asyncio.create_task(session.run())

    def heartbeats() -> int:
        view = server.registry.get("d0")
        return view.heartbeats if view is not None and view.state == "ready" else 0

    try:
        await eventually(lambda: heartbeats() > 3, timeout=30, what="d0 registered and heard")
        first = server.registry.get("d0")
        assert first is not None
        proxy.sever()
        await eventually(lambda: proxy.accepted == 2, timeout=30, what="the agent reconnected")
        await eventually(lambda: session.welcomes == 2, timeout=30, what="a Welcome on the new connection")
        seen = heartbeats()
        await eventually(lambda: heartbeats() > seen + 3, timeout=30, what="heartbeats on the new connection")
        again = server.registry.get("d0")
        assert again is not None and again.session == first.session, "the same session goes on"
        assert [v.agent_id for v in server.registry.snapshot().instances] == ["d0"]

        # Another agent process for d0 (a new incarnation) once this one's connection is closed.
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        transport.close()
        transport = DealerTransport(server.zmq_endpoint, curve=curve)
        run = asyncio.create_task(new_session(transport).run())
        await eventually(
            lambda: (v := server.registry.get("d0")) is not None and v.session == first.session + 1,
            timeout=30,
            what="a new session for the new process",
        )
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        transport.close()
        await proxy.close()
