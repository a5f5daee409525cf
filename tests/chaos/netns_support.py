"""A private network namespace joined to the root namespace by one veth pair, with a switchable partition.

``netns_link()`` makes a uniquely named namespace, a veth pair (``outer_if`` in the root namespace,
``inner_if`` inside), a /30 from 10.231.0.0/16 that exists only on these two ends, and brings ``lo`` up
inside. Leaving the context manager (normally or by an exception) kills what still runs inside, deletes
the veth pair and the namespace. It also removes what a killed earlier run left behind: names carry the
creating process's pid, and only names whose process is gone are touched, so concurrent runs are safe.

``cut()`` is a partition, not an unplugged cable: both sides keep their link up and their routes, and
every frame crossing the veth is silently dropped. Each side gets a permanent neighbour entry mapping
the other side's address to a MAC address that exists nowhere, so frames still leave, arrive at the peer
addressed to another host, and are discarded by its IP layer. No side sees an error: an established
TCP connection keeps retransmitting (sends succeed, reads hang), and a new connection's SYN goes
unanswered until the connect times out (no RST, no ICMP unreachable). ``restore()`` deletes the two
entries; ARP resolves again and TCP's next retransmission delivers what was queued on the same
connection. Alternatives and why not: ``ip link set down`` drops the carrier, which flushes the
neighbour table, and connects fail with EHOSTUNREACH once ARP gives up (a NIC pulled out, which a
process can tell apart from a partition); ``tc netem loss 100%`` and ``tc`` drop actions would be as
silent but need qdiscs and actions this machine's kernel is built without; nftables/iptables drops
would be as silent but their tools are not installed here, and a root-namespace firewall rule reaches
beyond this test.

Only ``ip`` (iproute2) is needed. Where a namespace or a veth pair cannot be made (not root, no
iproute2, no permission), ``netns_link`` skips the test with the exact error.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

NETNS_PREFIX = "vdisagg-part"  # namespace names: vdisagg-part-<pid>-<n>
IF_PREFIX = "vdp"  # veth names: vdp<pid>x<n>o (root side) and vdp<pid>x<n>i (inside); at most 15 chars
BLACKHOLE_MAC = "02:00:00:00:00:00"  # locally administered; no interface here has it
POOL = ipaddress.IPv4Network("10.231.0.0/16")  # private; each link takes one /30 of it
_NETNS_NAME = re.compile(rf"^{NETNS_PREFIX}-(\d+)-\d+$")
_IF_NAME = re.compile(rf"^{IF_PREFIX}(\d+)x\d+[oi]$")
_counter = itertools.count()
IP_TIMEOUT_S = 10.0  # one ``ip`` command; they take milliseconds, unless the kernel is stuck


class IpCommandError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and its stderr."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; ``IpCommandError`` with the command and its stderr when ``check`` and it fails."""
    argv = ["ip", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise IpCommandError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if check and done.returncode != 0:
        raise IpCommandError(
            f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


@dataclass
class NetnsLink:
    """A namespace and the veth pair joining it to the root namespace."""

    netns: str
    outer_if: str  # in the root namespace
    inner_if: str  # inside ``netns``
    outer_addr: str  # on ``outer_if``
    inner_addr: str  # on ``inner_if``
    is_cut: bool = False

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``argv`` inside the namespace."""
        return subprocess.run(self.exec_argv(argv), **kwargs)

    def cut(self) -> None:
        """Partition: every frame across the veth is dropped silently, in both directions."""
        blackhole = ("lladdr", BLACKHOLE_MAC, "nud", "permanent")
        ip("neigh", "replace", self.inner_addr, *blackhole, "dev", self.outer_if)
        ip("-n", self.netns, "neigh", "replace", self.outer_addr, *blackhole, "dev", self.inner_if)
        self.is_cut = True

    def restore(self) -> None:
        """Heal the partition: ARP resolves again and queued TCP segments go out on their next retry."""
        ip("neigh", "del", self.inner_addr, "dev", self.outer_if, check=False)
        ip("-n", self.netns, "neigh", "del", self.outer_addr, "dev", self.inner_if, check=False)
        self.is_cut = False

    def pids(self) -> list[int]:
        """Processes running inside the namespace."""
        done = ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _kill_inside(netns: str) -> None:
    done = ip("netns", "pids", netns, check=False)
    for pid in (int(p) for p in done.stdout.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _delete(netns: str, outer_if: str) -> None:
    """Remove one link; every step tolerates what is already gone."""
    _kill_inside(netns)
    # Deleting one end deletes the pair at once; ``netns del`` alone would free the inside end lazily.
    ip("link", "del", outer_if, check=False)
    ip("netns", "del", netns, check=False)


def clean_leftovers() -> list[str]:
    """Delete namespaces and veths of this kind whose creating process is gone; what was deleted."""
    try:
        return _clean_leftovers()
    except (
        IpCommandError
    ):  # no usable ``ip``: there is nothing of ours to clean, and ``netns add`` will say why
        return []


def _clean_leftovers() -> list[str]:
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NETNS_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _kill_inside(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":")
        name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        match = _IF_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /30 of ``POOL`` on no interface, starting from one picked by the pid (concurrent runs differ)."""
    used = ip("-o", "-4", "addr", "show", check=False).stdout
    subnets = list(POOL.subnets(new_prefix=30))
    start = pid % len(subnets)
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(f" {host}/" in used for host in net.hosts()):
            return net
    raise IpCommandError(f"every /30 of {POOL} is in use")


@contextlib.contextmanager
def netns_link() -> Iterator[NetnsLink]:
    """A fresh namespace and veth pair (``pytest.skip`` where they cannot be made); removed on exit."""
    clean_leftovers()
    pid, n = os.getpid(), next(_counter)
    netns = f"{NETNS_PREFIX}-{pid}-{n}"
    outer_if, inner_if = f"{IF_PREFIX}{pid}x{n}o", f"{IF_PREFIX}{pid}x{n}i"
    try:
        ip("netns", "add", netns)
    except IpCommandError as exc:
        pytest.skip(f"cannot make a network namespace: {exc}")
    try:
        try:
            ip("link", "add", outer_if, "type", "veth", "peer", "name", inner_if, "netns", netns)
        except IpCommandError as exc:
            pytest.skip(f"cannot make a veth pair into a network namespace: {exc}")
        net = _free_subnet(pid)
        outer_addr, inner_addr = (str(h) for h in net.hosts())
        ip("addr", "add", f"{outer_addr}/{net.prefixlen}", "dev", outer_if)
        ip("link", "set", outer_if, "up")
        ip("-n", netns, "addr", "add", f"{inner_addr}/{net.prefixlen}", "dev", inner_if)
        ip("-n", netns, "link", "set", inner_if, "up")
        ip("-n", netns, "link", "set", "lo", "up")  # engines publish KV events on the namespace's loopback
        yield NetnsLink(netns, outer_if, inner_if, outer_addr, inner_addr)
    finally:
        _delete(netns, outer_if)
