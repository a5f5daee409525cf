"""Which engine URLs a ``Hello`` may announce: the gateway sends users' prompts and the engine API key
there, so an agent may not point it anywhere it likes (docs/security.md, engine URLs).

Allowed: scheme ``http``, a host that is an IP address (or ``localhost``), and that address is

- the agent's own: the address its ZeroMQ connection comes from, as the orchestrator sees it;
- loopback, when the agent is on the orchestrator's host too (its connection comes from loopback, or
  over ``ipc://``): a remote agent's ``127.0.0.1`` would be the *orchestrator's* host, its admin port
  or etcd, not the agent's engine;
- in one of the operator's networks (``--engine-networks 10.0.0.0/8,fd00::/8``), for engines
  that agents reach on another address than their own (``connect`` to a vLLM on another host).

``any`` allows every URL of the scheme (host names too). Without it a host name other than
``localhost`` is refused, not resolved: the gateway resolves it again at each connection, so a name
that passed the check could point elsewhere later (DNS rebinding), and resolving in the event loop
would stall it. ``https`` is refused too: the gateway's engine client speaks plain HTTP, and would send
the prompts and the key unencrypted to the TLS port.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from vllm_disagg.errors import ConfigError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ENGINE_SCHEMES = ("http",)  # what ``gateway/upstream.py`` speaks
ENGINE_URL_REFUSED = "engine_url_refused"  # the ``Refuse.code`` of a Hello whose engine URL is not allowed
ANY = "any"
ENGINE_NETWORKS_FLAG = "--engine-networks"
_MAX_URL = 2048
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # no space, no control character: it goes into a request line
_LOOPBACK_V4 = ipaddress.IPv4Address("127.0.0.1")


@dataclass(frozen=True, slots=True)
class EngineNetworks:
    """The networks engine URLs may name beside the agent's own address (and loopback, for a local
    agent); ``any``: every URL of an allowed scheme."""

    networks: tuple[IPNetwork, ...] = ()
    any: bool = False

    @staticmethod
    def parse(text: str) -> EngineNetworks:
        """``""``, ``any``, or CIDRs separated by commas (``ConfigError`` naming the bad one)."""
        items = [item.strip() for item in text.split(",") if item.strip()]
        if items == [ANY]:
            return EngineNetworks(any=True)
        networks = []
        for item in items:
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ConfigError(
                    f"orchestrator.engine_networks: {item!r} is not a network (CIDR such as 10.0.0.0/8 "
                    f"or fd00::/8), and '{ANY}' stands alone"
                ) from None
        return EngineNetworks(tuple(networks))

    def describe(self) -> str:
        """For a refusal's reason."""
        if self.any:
            return ANY
        return ",".join(str(n) for n in self.networks) or "none"

    def __contains__(self, address: IPAddress) -> bool:
        return any(address.version == n.version and address in n for n in self.networks)


def plain(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (``::ffff:10.0.0.5``) as the IPv4 address it is, so that neither
    spelling passes where the other would not."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def peer_address(text: str) -> IPAddress | None:
    """The IP address of a connection's peer as libzmq writes it (``Peer-Address``), or None."""
    try:
        return plain(ipaddress.ip_address(text.strip("[]").partition("%")[0]))
    except ValueError:
        return None


def endpoint_host(endpoint: str) -> str:
    """The host of a ZeroMQ TCP endpoint (``tcp://10.0.0.1:5555`` -> ``10.0.0.1``); "" for others."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")


def host_local_endpoint(endpoint: str) -> bool:
    """Can only this host reach ``endpoint``? ``ipc://``, ``inproc://``, or TCP on a loopback address
    (``tcp://*`` and ``0.0.0.0`` listen on every interface)."""
    if not endpoint.startswith("tcp://"):
        return endpoint.startswith(("ipc://", "inproc://"))
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or host name: maybe public
        return False


def hello_url_problem(url: str, address: str, endpoint: str, networks: EngineNetworks) -> str | None:
    """``engine_url_problem`` for a Hello whose connection came from ``address`` (libzmq's
    ``Peer-Address``) to the socket bound at ``endpoint``."""
    if not endpoint.startswith("tcp://"):
        return engine_url_problem(url, None, networks)  # ipc, inproc: only this host connects
    peer = peer_address(address)
    if peer is None:
        return f"this connection's address is unknown ({address[:64]!r}): its engine URL cannot be checked"
    return engine_url_problem(url, peer, networks, own=peer_address(endpoint_host(endpoint)))


def engine_url_problem(
    url: str, peer: IPAddress | None, networks: EngineNetworks, *, own: IPAddress | None = None
) -> str | None:
    """Why the gateway may not send requests to ``url``, or None where it may.

    ``peer``: the agent's address as its connection shows it; None for an agent on this host whose
    connection has no IP address (``ipc://``, ``inproc://``). ``own``: the address the orchestrator
    listens on, if one: a connection from it comes from this host (TCP's handshake cannot be forged
    from elsewhere), so its agent's loopback is this host's.
    """
    host, problem = _host_of(url)
    if problem:
        return problem
    if networks.any:
        return None
    if host.lower() == "localhost":
        address: IPAddress = _LOOPBACK_V4  # /etc/hosts of this host says so; no resolver asked
    else:
        try:
            address = plain(ipaddress.ip_address(host.partition("%")[0]))
        except ValueError:
            return (
                f"engine URL host {host[:253]!r} is a name: announce the engine's IP address (a name is "
                f"not resolved: it could point elsewhere by the time the gateway connects), or allow "
                f"names with {ENGINE_NETWORKS_FLAG} {ANY}"
            )
    local = peer is None or peer.is_loopback or peer == own
    if address == peer or (address.is_loopback and local) or address in networks:
        return None
    whose = f"this agent connects from {peer}" if peer else "this agent's connection has no IP address"
    if address.is_loopback:
        return (
            f"engine URL host {address} is loopback but {whose}: to the gateway that is the "
            f"orchestrator's own host; announce the address the engine is reached at"
        )
    return (
        f"engine URL host {address} is neither this agent's address ({whose}) nor loopback, nor in "
        f"{ENGINE_NETWORKS_FLAG} ({networks.describe()}): allow its network with {ENGINE_NETWORKS_FLAG}"
    )


def _host_of(url: str) -> tuple[str, str]:
    """The URL's host, or why the URL is not an engine base URL at all."""
    if len(url) > _MAX_URL or not _PRINTABLE.fullmatch(url):
        return "", f"engine URL must be at most {_MAX_URL} printable characters without spaces"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError as exc:
        return "", f"engine URL {url[:200]!r} is not a URL: {exc}"
    if parts.scheme not in ENGINE_SCHEMES:
        return "", (
            f"engine URL scheme must be {' or '.join(ENGINE_SCHEMES)} (the gateway speaks plain HTTP "
            f"to engines), got {url[:200]!r}"
        )
    if "@" in parts.netloc:
        return "", "engine URL must not carry credentials (user@host)"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return "", "engine URL must be a base URL, without query or fragment"
    host = parts.hostname or ""
    if not host:
        return "", f"engine URL {url[:200]!r} names no host"
    return host, ""
