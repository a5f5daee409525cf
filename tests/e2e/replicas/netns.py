"""Network namespaces on one Linux bridge, and a silent cut between any two of them.

``netns_bridge()`` makes a bridge in the root namespace with the first address of a private /24
(10.232.0.0/16, one /24 per run), and ``Bridge.add(label)`` a namespace joined to it by a veth pair,
with the next address and its loopback up. Root-namespace processes reach every namespace through the
bridge, and every namespace reaches the root namespace at ``Bridge.host_addr`` and each other directly:
one L2 segment, no routing.

``Bridge.cut(a, b)`` partitions two namespaces from each other and from nothing else: each gets a
permanent neighbour entry mapping the other's address to a MAC address that exists nowhere
(``tests/chaos/netns_support.py`` explains why this is the silent kind of cut: frames still leave, the
bridge floods them, every receiver drops them as addressed to another host; no RST, no ICMP, no error
on either side). ``heal(a, b)`` deletes the two entries.

Leaving the context manager, normally or by an exception, kills what still runs in the namespaces and
deletes them, the veth pairs and the bridge. Names carry the creating process's pid, so a later run
removes what a killed earlier run left behind, and concurrent runs never touch each other's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.chaos.netns_support import BLACKHOLE_MAC, IpCommandError, ip
from tests.e2e.replicas.cluster import Placement

NS_PREFIX = "vdisagg-br"  # namespaces: vdisagg-br-<pid>x<n>-<label>
IF_PREFIX = "vdb"  # bridge vdb<pid>x<n>; veths vdb<pid>x<n>v<k> (root side), ...i<k> inside (<= 15 chars)
POOL = ipaddress.IPv4Network("10.232.0.0/16")
_NS_NAME = re.compile(rf"^{NS_PREFIX}-(\d+)x")
_IF_NAME = re.compile(rf"^{IF_PREFIX}(\d+)x")
_counter = itertools.count()


@dataclass(frozen=True)
class Member:
    """A namespace on the bridge: its name, the veth end inside it, its address."""

    label: str
    netns: str
    inner_if: str
    addr: str

    @property
    def placement(self) -> Placement:
        """Run a process in this namespace, bound to its address."""
        return Placement(self.addr, ("ip", "netns", "exec", self.netns))


@dataclass
class Bridge:
    """The bridge, its subnet and the namespaces on it."""

    name: str
    net: ipaddress.IPv4Network
    members: list[Member] = field(default_factory=list)
    _outer: list[str] = field(default_factory=list)

    @property
    def host_addr(self) -> str:
        """The root namespace's address on the bridge."""
        return str(self.net.network_address + 1)

    def add(self, label: str) -> Member:
        """A new namespace on the bridge."""
        k = len(self.members)
        netns = f"{NS_PREFIX}-{self.name[len(IF_PREFIX) :]}-{label}"
        outer, inner = f"{self.name}v{k}", f"{self.name}i{k}"
        addr = str(self.net.network_address + 10 + k)
        ip("netns", "add", netns)
        self._outer.append(outer)
        member = Member(label, netns, inner, addr)
        self.members.append(member)
        ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", netns)
        ip("link", "set", outer, "master", self.name)
        ip("link", "set", outer, "up")
        ip("-n", netns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", inner)
        ip("-n", netns, "link", "set", inner, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        return member

    def cut(self, a: Member, b: Member) -> None:
        """Nothing passes between ``a`` and ``b`` any more, silently; each still reaches the rest."""
        blackhole = ("lladdr", BLACKHOLE_MAC, "nud", "permanent")
        ip("-n", a.netns, "neigh", "replace", b.addr, *blackhole, "dev", a.inner_if)
        ip("-n", b.netns, "neigh", "replace", a.addr, *blackhole, "dev", b.inner_if)

    def heal(self, a: Member, b: Member) -> None:
        """Undo ``cut``: ARP resolves again, TCP's next retransmission goes through."""
        ip("-n", a.netns, "neigh", "del", b.addr, "dev", a.inner_if, check=False)
        ip("-n", b.netns, "neigh", "del", a.addr, "dev", b.inner_if, check=False)

    def remove(self) -> None:
        """Kill what runs inside, delete the namespaces, the veths and the bridge."""
        for member in self.members:
            _remove_netns(member.netns)
        for outer in self._outer:
            ip("link", "del", outer, check=False)
        ip("link", "del", self.name, check=False)


def _remove_netns(netns: str) -> None:
    done = ip("netns", "pids", netns, check=False)
    for pid in (int(p) for p in done.stdout.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    ip("netns", "del", netns, check=False)


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def clean_leftovers() -> None:
    """Remove namespaces, veths and bridges of this kind whose creating process is gone."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _remove_netns(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":")
        name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        match = _IF_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            ip("link", "del", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    used = ip("-o", "-4", "addr", "show", check=False).stdout
    subnets = list(POOL.subnets(new_prefix=24))
    start = os.getpid() % len(subnets)
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if f" {net.network_address + 1}/" not in used:
            return net
    raise IpCommandError(f"every /24 of {POOL} is in use")


@contextlib.contextmanager
def netns_bridge() -> Iterator[Bridge]:
    """A fresh bridge (``pytest.skip`` where one cannot be made: not root, no iproute2); removed on exit."""
    try:
        clean_leftovers()
        bridge = Bridge(f"{IF_PREFIX}{os.getpid()}x{next(_counter)}", _free_subnet())
        ip("link", "add", bridge.name, "type", "bridge")
    except IpCommandError as exc:
        pytest.skip(f"cannot make a bridge: {exc}")
    try:
        ip("addr", "add", f"{bridge.host_addr}/{bridge.net.prefixlen}", "dev", bridge.name)
        ip("link", "set", bridge.name, "up")
        yield bridge
    finally:
        bridge.remove()
