"""Hosts on one machine: a network namespace each, all on one bridge, every one with its own address.

``hosts(names)`` makes a bridge in the root namespace with the /24's first address (the root namespace
is the client's host: the test reaches every host by address, across the bridge), and per name a
namespace with a veth pair, the inside end holding the next address. A process run with
``Host.exec_argv`` sees only its namespace's interfaces: its own address and, when asked for
(``loopback``), its own ``lo``. A link between two hosts can only go over the bridge; an address
another host cannot reach (127.0.0.1, a wildcard) fails the link instead of passing on loopback.

Leaving the context manager, normally or by an exception, kills what still runs in each namespace and
deletes the namespaces, veths and the bridge. Names carry the creating process's pid (``vdisagg-host-
<pid>-<n>``, ``vdh<pid>x<n>o``, ``vdh<pid>br``); what a killed earlier run left behind is deleted
first, only where the pid is gone, so concurrent runs are safe. Only ``ip`` (iproute2) is needed;
where a namespace, veth or bridge cannot be made (not root, no permission), the test is skipped with
the exact error, as ``tests/chaos/netns_support.py`` does.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import signal
import subprocess
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import pytest

from tests.chaos.netns_support import IpCommandError, ip

NETNS_PREFIX = "vdisagg-host"
IF_PREFIX = "vdh"  # at most 15 characters: vdh + pid (up to 7 digits) + x<n>o, or br
POOL = ipaddress.IPv4Network("10.232.0.0/16")  # private; each run takes one /24 of it
_NETNS_NAME = re.compile(rf"^{NETNS_PREFIX}-(\d+)-\d+$")
_IF_NAME = re.compile(rf"^{IF_PREFIX}(\d+)(x\d+[oi]|br)$")
_runs = itertools.count()


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the bridge, and how to run a command there."""

    name: str  # the test's name for it: "etcd", "orch-a"...
    netns: str
    addr: str
    outer_if: str  # the veth end in the root namespace, on the bridge

    @property
    def inner_if(self) -> str:
        """The veth end inside the namespace, holding ``addr`` (the pair's other name, ``i`` for ``o``)."""
        return f"{self.outer_if[:-1]}i"

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Processes running inside the namespace."""
        return [int(p) for p in ip("netns", "pids", self.netns, check=False).stdout.split() if p.isdigit()]


@dataclass(frozen=True)
class Network:
    """The bridge, the root namespace's address on it, and the hosts."""

    bridge: str
    root_addr: str
    hosts: dict[str, Host]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def kill_inside(netns: str) -> None:
    """SIGKILL every process in ``netns``."""
    for pid in (int(p) for p in ip("netns", "pids", netns, check=False).stdout.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def clean_leftovers() -> None:
    """Delete namespaces and links of this kind whose creating process is gone."""
    with contextlib.suppress(IpCommandError):
        for line in ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            match = _NETNS_NAME.match(name)
            if match and not _alive(int(match.group(1))):
                kill_inside(name)
                ip("netns", "del", name, check=False)
        for line in ip("-o", "link", "show", check=False).stdout.splitlines():
            fields = line.split(":")
            name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
            match = _IF_NAME.match(name)
            if match and not _alive(int(match.group(1))):
                ip("link", "del", name, check=False)


def _free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 of ``POOL`` that no interface here has an address in, starting from one picked by the pid."""
    used = [
        ipaddress.IPv4Interface(word).ip
        for line in ip("-o", "-4", "addr", "show", check=False).stdout.splitlines()
        for word in line.split()
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+/\d+", word)
    ]
    subnets = list(POOL.subnets(new_prefix=24))
    start = pid % len(subnets)
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(addr in net for addr in used):
            return net
    raise IpCommandError(f"every /24 of {POOL} is in use")


@contextlib.contextmanager
def hosts(names: Sequence[str], loopback: Collection[str] = ()) -> Iterator[Network]:
    """One namespace per name on a fresh bridge (``pytest.skip`` where they cannot be made); ``lo`` is up
    only in the hosts named in ``loopback``. Everything is removed on exit."""
    clean_leftovers()
    pid, run = os.getpid(), next(_runs)
    bridge = f"{IF_PREFIX}{pid}br"
    made: list[Host] = []
    try:
        try:
            ip("link", "add", bridge, "type", "bridge")
        except IpCommandError as exc:
            pytest.skip(f"cannot make a bridge: {exc}")
        net = _free_subnet(pid)
        addrs = [str(a) for a in net.hosts()]
        ip("addr", "add", f"{addrs[0]}/{net.prefixlen}", "dev", bridge)
        ip("link", "set", bridge, "up")
        for n, name in enumerate(names):
            host = Host(name, f"{NETNS_PREFIX}-{pid}-{run * 100 + n}", addrs[n + 1], f"{IF_PREFIX}{pid}x{n}o")
            try:
                ip("netns", "add", host.netns)
            except IpCommandError as exc:
                pytest.skip(f"cannot make a network namespace: {exc}")
            made.append(host)
            inner = host.inner_if
            ip("link", "add", host.outer_if, "type", "veth", "peer", "name", inner, "netns", host.netns)
            ip("link", "set", host.outer_if, "master", bridge)
            ip("link", "set", host.outer_if, "up")
            ip("-n", host.netns, "addr", "add", f"{host.addr}/{net.prefixlen}", "dev", inner)
            ip("-n", host.netns, "link", "set", inner, "up")
            if name in loopback:
                ip("-n", host.netns, "link", "set", "lo", "up")
        yield Network(bridge, addrs[0], {h.name: h for h in made})
    finally:
        for host in made:
            kill_inside(host.netns)
            ip("link", "del", host.outer_if, check=False)  # deletes the pair at once
            ip("netns", "del", host.netns, check=False)
        ip("link", "del", bridge, check=False)


def stop_groups(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each process's group, then SIGKILL what is left after ``grace_s``."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
