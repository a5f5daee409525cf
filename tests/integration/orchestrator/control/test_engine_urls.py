"""A Hello's engine URL is where the gateway sends users' prompts and the engine key: an agent on a real
ZeroMQ socket that names an engine elsewhere is refused with a reason, logged, and never registered."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.orchestrator_support import FakeAgent, orch_config, sample, scrape
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.curve import ClientCurve, load_keypair, load_public, make_keypair
from vllm_disagg.protocol.engine_urls import ENGINE_URL_REFUSED
from vllm_disagg.protocol.messages import Refuse, Welcome

Start = Callable[..., Any]


@pytest.fixture
async def start() -> AsyncIterator[Callable[..., Any]]:
    """Start orchestrators with config overrides; closed after the test."""
    started: list[OrchestratorServer] = []

    async def make(**overrides: Any) -> OrchestratorServer:
        server = await start_orchestrator(orch_config(**overrides), shutdown_timeout_s=1.0)
        started.append(server)
        return server

    yield make
    for server in started:
        await server.close()


async def hello(server: OrchestratorServer, agent_id: str, url: str, **kwargs: Any) -> Welcome | Refuse:
    """What the orchestrator answers an agent announcing ``url`` (its socket closed after)."""
    agent = FakeAgent(kwargs.pop("endpoint", server.zmq_endpoint), agent_id, url, "decode", **kwargs)
    try:
        return await agent.hello()
    finally:
        await agent.close()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://203.0.113.5:8000", "203.0.113.5 is neither this agent's address"),
        ("file:///etc/passwd", "scheme must be http"),
        ("ftp://127.0.0.1:21/", "scheme must be http"),
        ("https://127.0.0.1:8443", "plain HTTP"),
        ("http://engine.example:8000", "is a name"),
        ("http://127.0.0.1@203.0.113.5:8000", "credentials"),
    ],
    ids=["another-host", "file", "ftp", "https", "a-name", "credentials-hiding-the-host"],
)
async def test_a_hello_naming_an_engine_elsewhere_is_refused_with_a_reason_and_never_registered(
    start: Start, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, url: str, reason: str
) -> None:
    server = await start()
    with caplog.at_level(logging.WARNING, logger="vllm_disagg.orchestrator.control.plane"):
        answer = await hello(server, "forger", url)
    assert isinstance(answer, Refuse), answer
    assert answer.code == ENGINE_URL_REFUSED and reason in answer.reason, answer
    assert server.registry.get("forger") is None
    assert server.registry.snapshot().instances == ()
    assert any(
        "refusing Hello as 'forger'" in r.getMessage() and reason in r.getMessage() for r in caplog.records
    )
    samples = await scrape(http, server.url)
    assert sample(samples, "vllm_disagg_protocol_refused_total", code=ENGINE_URL_REFUSED) == 1


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9", "http://localhost:9", "http://[::1]:9/"], ids=["ipv4", "localhost", "ipv6"]
)
async def test_an_agent_on_this_host_may_announce_a_loopback_engine(start: Start, url: str) -> None:
    server = await start()
    assert isinstance(await hello(server, "d0", url), Welcome)
    view = server.registry.get("d0")
    assert view is not None and view.info.url == url


async def test_an_operators_network_admits_engines_on_other_hosts_and_only_those(start: Start) -> None:
    server = await start(engine_networks="203.0.113.0/24,2001:db8::/32")
    assert isinstance(await hello(server, "d0", "http://203.0.113.5:8000"), Welcome)
    assert isinstance(await hello(server, "d1", "http://[2001:db8::5]:8000"), Welcome)
    refused = await hello(server, "d2", "http://198.51.100.5:8000")
    assert isinstance(refused, Refuse) and "(203.0.113.0/24,2001:db8::/32)" in refused.reason, refused
    assert {v.agent_id for v in server.registry.snapshot().instances} == {"d0", "d1"}


async def test_any_admits_every_http_url_but_no_other_scheme(start: Start) -> None:
    server = await start(engine_networks="any")
    assert isinstance(await hello(server, "d0", "http://engine.example:8000"), Welcome)
    refused = await hello(server, "d1", "file:///etc/passwd")
    assert isinstance(refused, Refuse) and refused.code == ENGINE_URL_REFUSED, refused


def _own_address() -> str | None:
    """This host's address on its default route (no packet is sent); None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


async def test_an_agent_connecting_from_another_address_may_name_its_own_engine_not_our_loopback(
    start: Start, tmp_path: Path
) -> None:
    address = _own_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    # Listening on every interface needs agent keys; the agents come over this host's own address, so
    # the orchestrator sees them as it would see another host.
    make_keypair(tmp_path, "orchestrator")
    for agent_id in ("d0", "d1"):
        make_keypair(tmp_path / "agents", agent_id)
    server = await start(
        zmq_endpoint="tcp://0.0.0.0:*",
        curve_secret_key_file=str(tmp_path / "orchestrator.key_secret"),
        agent_keys_dir=str(tmp_path / "agents"),
    )
    endpoint = f"tcp://{address}:{server.zmq_endpoint.rpartition(':')[2]}"

    def curve(agent_id: str) -> ClientCurve:
        secret = load_keypair(str(tmp_path / "agents" / f"{agent_id}.key_secret"))
        return ClientCurve(secret, load_public(str(tmp_path / "orchestrator.key")))

    own = await hello(server, "d0", f"http://{address}:8000", endpoint=endpoint, curve=curve("d0"))
    assert isinstance(own, Welcome), own
    ours = await hello(server, "d1", "http://127.0.0.1:8000", endpoint=endpoint, curve=curve("d1"))
    assert isinstance(ours, Refuse) and f"this agent connects from {address}" in ours.reason, ours
    assert "the orchestrator's own host" in ours.reason
    assert server.registry.get("d1") is None
