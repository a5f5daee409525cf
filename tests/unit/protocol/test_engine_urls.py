"""Which engine URLs a Hello may announce: the gateway sends users' prompts and the engine key there."""

from __future__ import annotations

import ipaddress

import pytest

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.engine_urls import (
    EngineNetworks,
    IPAddress,
    endpoint_host,
    engine_url_problem,
    hello_url_problem,
    peer_address,
)

LOCAL_V4 = ipaddress.ip_address("127.0.0.1")
REMOTE_V4 = ipaddress.ip_address("10.1.2.3")
REMOTE_V6 = ipaddress.ip_address("fd00::7")
NONE = EngineNetworks()
LAB = EngineNetworks.parse("10.0.0.0/8, fd00::/8")


@pytest.mark.parametrize(
    ("url", "peer", "networks"),
    [
        ("http://127.0.0.1:8000", LOCAL_V4, NONE),
        ("http://127.0.0.2:8000/", LOCAL_V4, NONE),
        ("http://localhost:8000", LOCAL_V4, NONE),
        ("http://LOCALHOST:8000", LOCAL_V4, NONE),
        ("http://[::1]:8000", LOCAL_V4, NONE),
        ("http://[::ffff:127.0.0.1]:8000", LOCAL_V4, NONE),
        ("http://127.0.0.1:8000", None, NONE),
        ("http://10.1.2.3:8000", REMOTE_V4, NONE),
        ("http://[::ffff:10.1.2.3]:8000", REMOTE_V4, NONE),
        ("http://[fd00::7]:8000", REMOTE_V6, NONE),
        ("http://10.9.9.9:8000/prefix", REMOTE_V4, LAB),
        ("http://[fd00::99]:8000", REMOTE_V4, LAB),
        ("http://10.9.9.9:8000", LOCAL_V4, LAB),
        ("http://engine.internal:8000", REMOTE_V4, EngineNetworks.parse("any")),
        ("http://203.0.113.5", REMOTE_V4, EngineNetworks.parse("0.0.0.0/0")),
    ],
    ids=[
        "loopback-of-a-local-agent",
        "any-of-127/8",
        "localhost",
        "localhost-any-case",
        "ipv6-loopback",
        "ipv4-mapped-loopback",
        "loopback-of-an-ipc-agent",
        "the-agents-own-address",
        "its-own-address-ipv4-mapped",
        "its-own-ipv6-address",
        "in-an-operators-ipv4-network-with-a-path",
        "in-an-operators-ipv6-network",
        "a-local-agent-and-an-operators-network",
        "any-allows-names",
        "a-cidr-of-everything",
    ],
)
def test_an_engine_url_the_gateway_may_reach_is_allowed(
    url: str, peer: IPAddress | None, networks: EngineNetworks
) -> None:
    assert engine_url_problem(url, peer, networks) is None


@pytest.mark.parametrize(
    ("url", "peer", "networks", "reason"),
    [
        ("http://203.0.113.5:8000", REMOTE_V4, NONE, "neither this agent's address"),
        ("http://203.0.113.5:8000", LOCAL_V4, NONE, "--engine-networks (none)"),
        ("http://203.0.113.5:8000", REMOTE_V4, LAB, "(10.0.0.0/8,fd00::/8)"),
        ("http://[2001:db8::1]:8000", REMOTE_V6, LAB, "2001:db8::1 is neither"),
        ("http://[::ffff:203.0.113.5]:8000", REMOTE_V4, LAB, "203.0.113.5 is neither"),
        ("http://127.0.0.1:8000", REMOTE_V4, NONE, "the orchestrator's own host"),
        ("http://localhost:8000", REMOTE_V4, NONE, "the orchestrator's own host"),
        ("http://[::1]:8000", REMOTE_V6, NONE, "the orchestrator's own host"),
        ("http://0.0.0.0:8000", LOCAL_V4, NONE, "neither"),
        ("http://engine.internal:8000", REMOTE_V4, LAB, "is a name"),
        ("http://127.1:8000", LOCAL_V4, NONE, "is a name"),
        ("http://2130706433:8000", LOCAL_V4, NONE, "is a name"),
        ("file:///etc/passwd", LOCAL_V4, NONE, "scheme must be http"),
        ("ftp://127.0.0.1/", LOCAL_V4, NONE, "scheme must be http"),
        ("https://127.0.0.1:8443", LOCAL_V4, NONE, "plain HTTP"),
        ("file:///etc/passwd", REMOTE_V4, EngineNetworks.parse("any"), "scheme must be http"),
        ("http://127.0.0.1@203.0.113.5:8000", LOCAL_V4, NONE, "credentials"),
        ("http://127.0.0.1:8000/?x=1", LOCAL_V4, NONE, "without query"),
        ("http://127.0.0.1:8000/#x", LOCAL_V4, NONE, "without query"),
        ("http://127.0.0.1:8000/a\r\nX-Evil: 1", LOCAL_V4, NONE, "printable"),
        ("http://127.0.0.1:99999", LOCAL_V4, NONE, "not a URL"),
        ("http://:8000", LOCAL_V4, NONE, "names no host"),
        ("", LOCAL_V4, NONE, "printable"),
        ("http://127.0.0.1/" + "a" * 3000, LOCAL_V4, NONE, "at most 2048"),
    ],
    ids=[
        "another-hosts-address",
        "another-host-from-a-local-agent",
        "outside-the-operators-networks",
        "outside-an-ipv6-network",
        "ipv4-mapped-outside",
        "a-remote-agents-loopback-is-ours",
        "a-remote-agents-localhost",
        "a-remote-agents-ipv6-loopback",
        "unspecified",
        "a-host-name",
        "short-ipv4-spelling",
        "integer-ipv4-spelling",
        "file",
        "ftp",
        "https",
        "any-keeps-the-scheme",
        "credentials",
        "query",
        "fragment",
        "header-injection",
        "port-out-of-range",
        "no-host",
        "empty",
        "too-long",
    ],
)
def test_an_engine_url_elsewhere_is_refused_with_a_reason(
    url: str, peer: IPAddress | None, networks: EngineNetworks, reason: str
) -> None:
    problem = engine_url_problem(url, peer, networks)
    assert problem is not None and reason in problem, problem


@pytest.mark.parametrize(
    ("address", "endpoint", "url", "allowed"),
    [
        ("127.0.0.1", "tcp://127.0.0.1:5555", "http://127.0.0.1:8000", True),
        ("192.0.2.2", "tcp://192.0.2.2:5555", "http://127.0.0.1:8000", True),
        ("192.0.2.2", "tcp://0.0.0.0:5555", "http://127.0.0.1:8000", False),
        ("192.0.2.2", "tcp://0.0.0.0:5555", "http://192.0.2.2:8000", True),
        ("::ffff:192.0.2.2", "tcp://[::]:5555", "http://192.0.2.2:8000", True),
        ("", "ipc:///tmp/agents", "http://127.0.0.1:8000", True),
        ("", "ipc:///tmp/agents", "http://192.0.2.2:8000", False),
        ("", "tcp://0.0.0.0:5555", "http://127.0.0.1:8000", False),
    ],
    ids=[
        "loopback-connection",
        "from-the-address-it-listens-on-is-this-host",
        "a-remote-connections-loopback",
        "a-remote-connections-own-address",
        "ipv4-mapped-peer",
        "ipc-is-this-host",
        "ipc-agent-names-another-host",
        "tcp-without-an-address-is-refused",
    ],
)
def test_a_hellos_url_is_judged_by_the_connection_it_came_on(
    address: str, endpoint: str, url: str, allowed: bool
) -> None:
    assert (hello_url_problem(url, address, endpoint, NONE) is None) is allowed


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("10.0.0.5", "10.0.0.5"),
        ("::1", "::1"),
        ("[fd00::2]", "fd00::2"),
        ("::ffff:10.0.0.5", "10.0.0.5"),
        ("fe80::1%eth0", "fe80::1"),
        ("localhost:0:0:1234", None),
        ("", None),
    ],
    ids=["ipv4", "ipv6", "bracketed", "ipv4-mapped", "scoped", "ipc-peer", "none"],
)
def test_a_peer_address_is_read_as_libzmq_writes_it(text: str, address: str | None) -> None:
    got = peer_address(text)
    assert (str(got) if got is not None else None) == address


def test_endpoint_host_is_the_tcp_host_only() -> None:
    assert endpoint_host("tcp://10.0.0.1:5555") == "10.0.0.1"
    assert endpoint_host("tcp://[fd00::1]:5555") == "fd00::1"
    assert endpoint_host("ipc:///tmp/x") == ""


@pytest.mark.parametrize(
    "text", ["10.0.0.0/33", "not-a-network", "any,10.0.0.0/8", "10.0.0.0/8;fd00::/8"], ids=str
)
def test_engine_networks_that_are_not_networks_fail_the_config(text: str) -> None:
    with pytest.raises(ConfigError, match="engine_networks"):
        OrchestratorConfig(engine_networks=text)


def test_engine_networks_parse_cidrs_and_any() -> None:
    assert EngineNetworks.parse("") == EngineNetworks()
    assert EngineNetworks.parse(" any ").any
    parsed = EngineNetworks.parse("10.0.0.5/8,fd00::/8")  # host bits dropped, as operators write them
    assert [str(n) for n in parsed.networks] == ["10.0.0.0/8", "fd00::/8"]
    assert parsed.describe() == "10.0.0.0/8,fd00::/8"
    assert ipaddress.ip_address("10.200.0.1") in parsed
    assert ipaddress.ip_address("fd00::1") in parsed
    assert ipaddress.ip_address("11.0.0.1") not in parsed


@pytest.mark.parametrize("field", ["max_engine_body_bytes", "max_engine_event_bytes"], ids=["body", "event"])
def test_engine_answer_caps_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        OrchestratorConfig(**{field: 0})  # type: ignore[arg-type]
