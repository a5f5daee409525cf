"""Process look-ups from ``/proc`` (Linux): CPU time, process groups, resident memory, engine servers.

Used by the benchmarks and the end-to-end tests to measure processes and to prove none survived.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def _pids() -> Iterator[int]:
    return (int(e) for e in os.listdir("/proc") if e.isdigit())


def _stat_fields(pid: int) -> list[str]:
    # The command name may contain spaces and parentheses: split after its closing one.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def group_members(pgids: set[int], *, zombies: bool = False) -> list[int]:
    """Processes whose process group is one of ``pgids``: live ones, and with ``zombies`` unreaped ones."""
    members = []
    for pid in _pids():
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        if (zombies or fields[0] != "Z") and int(fields[2]) in pgids:
            members.append(pid)
    return members


def group_rss_gib(pgid: int) -> float:
    """Resident memory of every process in a process group, in GiB."""
    total_kib = 0
    for pid in group_members({pgid}):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib / (1 << 20)


def engine_servers(ports: set[int]) -> list[int]:
    """Pids of ``vllm serve`` processes started with ``--port`` in ``ports`` (each leads its group)."""
    found = []
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\x00")
        except OSError:
            continue
        if "serve" in argv and "--port" in argv:
            port = argv[argv.index("--port") + 1]
            if port.isdigit() and int(port) in ports:
                found.append(pid)
    return found
