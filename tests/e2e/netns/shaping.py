"""One link between two hosts of ``hosts.py`` made slow with ``tc``: a bandwidth limit, and a delay where
the kernel has netem.

``shape(src, dst_addr, ...)`` acts on what ``src`` sends to ``dst_addr`` and nothing else: on ``src``'s
veth (the end inside its namespace) an htb root qdisc with one class limited to ``rate_mbit``, and a u32
filter that puts the IPv4 packets addressed to ``dst_addr`` in it. Every other packet ``src`` sends is
in no class and htb sends it unshaped (its direct queue), so ``src``'s links to other hosts stay as
they were. The direction matters: a shaped link from P to D slows what P sends D, as the body of D's
KV pull from P.

With ``delay_ms``, a netem qdisc under that class would add the delay. This machine's kernel is built
without netem (``CONFIG_NET_SCH_NETEM`` is not set; htb, tbf and u32 are built in): ``tc qdisc add ...
netem delay 10ms`` answers ``Error: Specified qdisc kind is unknown.``. Then the link is only
rate-limited, and ``Shaped.netem_error`` holds that answer so a test can say there is no delay. Where htb
itself cannot be set up the test is skipped with ``tc``'s exact error.

The rules live in ``src``'s namespace and go with it when ``hosts`` deletes it.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

import pytest

from tests.e2e.netns.hosts import Host

TC_TIMEOUT_S = 10.0  # one ``tc`` command; they take milliseconds
SHAPED_CLASS = "1:10"
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt")


class TcError(RuntimeError):
    """A ``tc`` command failed; the message holds the command and what it answered."""


def tc(netns: str, *args: str) -> str:
    """``tc -n NETNS ARGS``'s output; ``TcError`` with its exact answer when it fails."""
    argv = ["tc", "-n", netns, *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TC_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TcError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if done.returncode != 0:
        raise TcError(
            f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


@dataclass(frozen=True)
class Shaped:
    """A shaped link: where the rules are, its rate, and its delay (0 with ``netem_error`` saying why)."""

    host: Host
    dst_addr: str
    rate_mbit: int
    delay_ms: float
    netem_error: str

    def sent(self) -> tuple[int, int]:
        """(bytes, packets) that went through the shaped class: what crossed the slow link."""
        out = tc(self.host.netns, "-s", "class", "show", "dev", self.host.inner_if, "classid", SHAPED_CLASS)
        match = _SENT.search(out)
        return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def shape(src: Host, dst_addr: str, rate_mbit: int, delay_ms: float = 0.0) -> Shaped:
    """Limit what ``src`` sends to ``dst_addr`` to ``rate_mbit`` and, where netem exists, delay it by
    ``delay_ms`` (``pytest.skip`` where htb cannot be set up)."""
    ns, dev = src.netns, src.inner_if
    try:
        # No default class: what the filter does not classify goes out unshaped.
        tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb")
        # A quantum of one large (GSO) packet, not rate/r2q: htb warns about the latter at this rate.
        rate = f"{rate_mbit}mbit"
        tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", SHAPED_CLASS, "htb",
           "rate", rate, "ceil", rate, "quantum", "65536")  # fmt: skip
        tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
           "u32", "match", "ip", "dst", f"{dst_addr}/32", "flowid", SHAPED_CLASS)  # fmt: skip
    except TcError as exc:
        pytest.skip(f"cannot shape a link with htb: {exc}")
    netem_error = ""
    if delay_ms > 0:
        try:
            tc(ns, "qdisc", "add", "dev", dev, "parent", SHAPED_CLASS, "handle", "10:",
               "netem", "delay", f"{delay_ms}ms")  # fmt: skip
        except TcError as exc:
            netem_error = str(exc)
    return Shaped(src, dst_addr, rate_mbit, 0.0 if netem_error else delay_ms, netem_error)
