"""Who may register as an engine: agent keys (CurveZMQ), ids bound to keys, no takeover of a live id,
and a model's settings fixed by its first instance. Every forger is refused while the cluster serves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config, sample, scrape
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.codec import encode
from vllm_disagg.protocol.curve import (
    ClientCurve,
    Keypair,
    load_keypair,
    load_public,
    make_keypair,
    setup_client,
)
from vllm_disagg.protocol.messages import PROTOCOL_VERSION, Hello, InstanceInfo, Refuse, Welcome

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass
class Keyed:
    server: OrchestratorServer
    keys: Path

    def curve(self, agent_id: str) -> ClientCurve:
        return ClientCurve(
            load_keypair(str(self.keys / "agents" / f"{agent_id}.key_secret")),
            load_public(str(self.keys / "orchestrator.key")),
        )


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[Keyed]:
    """An orchestrator that admits the agents d0 and d1 by their keys."""
    make_keypair(tmp_path, "orchestrator")
    for agent_id in ("d0", "d1"):
        make_keypair(tmp_path / "agents", agent_id)
    config = orch_config(
        curve_secret_key_file=str(tmp_path / "orchestrator.key_secret"),
        agent_keys_dir=str(tmp_path / "agents"),
    )
    server = await start_orchestrator(config, shutdown_timeout_s=1.0)
    try:
        yield Keyed(server, tmp_path)
    finally:
        await server.close()


@contextlib.contextmanager
def forged_dealer(
    endpoint: str, curve: ClientCurve | None
) -> Iterator[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]]:
    """A DEALER and a monitor of its handshakes, attached before it connects (so none is missed)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        setup_client(sock, curve)
    monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
    sock.connect(endpoint)
    try:
        yield sock, monitor
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


async def test_a_keyed_agent_is_welcomed_and_its_frames_carry_its_id(keyed: Keyed) -> None:
    agent = FakeAgent(
        keyed.server.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode", curve=keyed.curve("d0")
    )
    try:
        await agent.join()
        await eventually(lambda: keyed.server.registry.snapshot().ready_decode, what="d0 ready")
    finally:
        await agent.close()


@pytest.mark.parametrize("forger", ["no-key", "an-unlisted-key"])
async def test_a_peer_without_a_listed_key_cannot_connect_nor_make_the_orchestrator_buffer_anything(
    keyed: Keyed, http: aiohttp.ClientSession, forger: str
) -> None:
    curve = None
    if forger == "an-unlisted-key":
        make_keypair(keyed.keys / "elsewhere", "forger")
        curve = ClientCurve(
            load_keypair(str(keyed.keys / "elsewhere" / "forger.key_secret")),
            load_public(str(keyed.keys / "orchestrator.key")),
        )
    with forged_dealer(keyed.server.zmq_endpoint, curve) as (forged, monitor):
        hello = Hello(PROTOCOL_VERSION, "forger", InstanceInfo("http://127.0.0.1:9", "decode", MODEL))
        # A multi-part message of many large parts: refused before libzmq would buffer a byte of it.
        for parts in ([encode(hello)], [b"x" * (1 << 20)] * 64):
            with contextlib.suppress(zmq.Again):  # a DEALER queues up to its high-water mark, no more
                await forged.send_multipart(parts, flags=zmq.NOBLOCK)
        raw = await asyncio.wait_for(monitor.recv_multipart(), 30)
        event = parse_monitor_message(raw)["event"]
        if curve is not None:
            assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH, event
        else:  # a peer without CURVE fails on the mechanism, before any authentication
            assert event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL), event
    samples = await scrape(http, keyed.server.url)
    if curve is not None:  # the orchestrator's authenticator said no (a keyless peer fails before it)
        await eventually(lambda: keyed.server.registry.get("forger") is None, what="nothing registered")
        assert sample(samples, "vllm_disagg_protocol_refused_total", code="unknown_key") >= 1
    assert sample(samples, "vllm_disagg_protocol_refused_total", code="malformed_frame") == 0
    assert keyed.server.registry.snapshot().instances == ()
    agent = FakeAgent(
        keyed.server.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode", curve=keyed.curve("d0")
    )
    try:
        await agent.join()  # the orchestrator still admits the real agents
    finally:
        await agent.close()


async def test_another_agents_key_cannot_say_hello_as_someone_else(keyed: Keyed) -> None:
    forger = FakeAgent(
        keyed.server.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode", curve=keyed.curve("d1")
    )
    try:
        answer = await forger.hello()
        assert isinstance(answer, Refuse) and answer.code == "unauthorized", answer
        assert "'d1'" in answer.reason and "'d0'" in answer.reason
        assert keyed.server.registry.get("d0") is None
    finally:
        await forger.close()


async def test_without_keys_a_live_agents_id_cannot_be_taken_over() -> None:
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    real = FakeAgent(server.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode")
    forger = FakeAgent(server.zmq_endpoint, "d0", "http://127.0.0.1:666", "decode")
    try:
        await real.join()
        answer = await forger.hello()
        assert isinstance(answer, Refuse) and answer.code == "agent_id_in_use", answer
        notice = await asyncio.wait_for(real.inbox.get(), 10)
        assert isinstance(notice, Refuse) and notice.code == "agent_id_in_use", "the real agent is told"
        view = server.registry.get("d0")
        assert view is not None and (view.session, view.info.url) == (1, "http://127.0.0.1:9")
        seen = view.heartbeats
        await eventually(
            lambda: (v := server.registry.get("d0")) is not None and v.heartbeats > seen + 2,
            what="the real agent's heartbeats still count",
        )
    finally:
        await forger.close()
        await real.close()
        await server.close()


async def test_a_hello_that_would_change_a_models_tokenizer_is_refused_not_applied() -> None:
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    first = FakeAgent(server.zmq_endpoint, "d0", "http://127.0.0.1:9", "decode")
    info = InstanceInfo("http://127.0.0.1:10", "decode", MODEL, engine="sim", tokenizer="/tmp/evil-tokenizer")
    forger = FakeAgent(server.zmq_endpoint, "d1", "", "decode", info=info)
    try:
        await first.join()
        answer = await forger.hello()
        assert isinstance(answer, Refuse) and answer.code == "model_mismatch", answer
        assert "/tmp/evil-tokenizer" in answer.reason
        assert server.registry.get("d1") is None
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{server.url}/admin/v1/scheduler", headers=ADMIN) as resp,
        ):
            assert "evil-tokenizer" not in await resp.text(), "the gateway never loads the forged tokenizer"
        again = FakeAgent(server.zmq_endpoint, "d2", "http://127.0.0.1:11", "decode")
        try:
            assert isinstance(await again.hello(), Welcome), "an instance that agrees is welcomed"
        finally:
            await again.close()
    finally:
        await forger.close()
        await first.close()
        await server.close()


def test_a_keypair_never_shows_its_secret() -> None:
    assert "s" * 40 not in repr(Keypair(b"p" * 40, b"s" * 40))


@pytest.mark.parametrize(
    ("labels", "says"),
    [
        ({f"k{i}": "v" for i in range(17)}, "17 labels, at most 16"),
        ({"Node": "a"}, "label key 'Node'"),
        ({"node": ""}, "1 to 128 characters"),
        ({"node": "x" * 129}, "1 to 128 characters"),
    ],
)
async def test_a_hello_with_labels_past_their_bounds_is_refused_with_the_reason(
    labels: dict[str, str], says: str
) -> None:
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    info = InstanceInfo("http://127.0.0.1:10", "decode", MODEL, engine="sim", labels=labels)
    agent = FakeAgent(server.zmq_endpoint, "d0", "", "decode", info=info)
    bounded = FakeAgent(server.zmq_endpoint, "d1", "", "decode", info=replace(info, labels={"node": "n1"}))
    try:
        answer = await agent.hello()
        assert isinstance(answer, Refuse) and answer.code == "invalid_hello", answer
        assert says in answer.reason and server.registry.get("d0") is None
        assert isinstance(await bounded.hello(), Welcome), "labels within their bounds are welcomed"
        view = server.registry.get("d1")
        assert view is not None and view.info.labels == {"node": "n1"}
    finally:
        await bounded.close()
        await agent.close()
        await server.close()
