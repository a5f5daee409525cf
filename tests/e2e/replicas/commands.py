"""The agents' ``--command-log`` files (docs/agent.md#the-command-log), and what they prove.

``fencing_violations`` is the proof that two leaders never acted at once: per agent, accepted commands'
epochs never go down; across agents (one host, so their monotonic clocks compare), no accepted command
of an epoch comes after the first accepted command of a newer one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CommandRecord:
    """One line of an agent's command log."""

    agent: str
    t: float
    mono: float
    id: int
    kind: str
    epoch: int
    origin: str
    accepted: bool
    code: str


def read_command_log(agent_id: str, path: Path) -> list[CommandRecord]:
    """The records of one ``--command-log`` file (none when it does not exist yet)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            records.append(
                CommandRecord(
                    agent_id,
                    d["t"],
                    d["mono"],
                    d["id"],
                    d["kind"],
                    d["epoch"],
                    d["from"],
                    d["accepted"],
                    d["code"],
                )
            )
    return records


def accepted(logs: dict[str, list[CommandRecord]]) -> Iterator[CommandRecord]:
    """Every accepted command of every agent."""
    for records in logs.values():
        yield from (r for r in records if r.accepted)


def first_accepted(logs: dict[str, list[CommandRecord]], *, newer_than: int) -> CommandRecord | None:
    """The earliest accepted command (by monotonic time) of an epoch above ``newer_than``."""
    newer = [r for r in accepted(logs) if r.epoch > newer_than]
    return min(newer, key=lambda r: r.mono) if newer else None


def fencing_violations(logs: dict[str, list[CommandRecord]]) -> list[str]:
    """Where two leaders acted at once, as the agents' command logs show it (empty: never).

    1. Per agent, in the order it handled them, accepted commands' epochs never go down.
    2. Across agents, by ``mono`` (one host's monotonic clock, so the agents' times compare): no accepted
       command of an epoch comes after the first accepted command of a newer epoch, on any agent.
    """
    found = []
    for agent_id, records in logs.items():
        highest = 0
        for r in records:
            if r.accepted and r.epoch < highest:
                found.append(f"{agent_id} accepted {r.kind} #{r.id} of epoch {r.epoch} after epoch {highest}")
            highest = max(highest, r.epoch) if r.accepted else highest
    first_of: dict[int, float] = {}
    for r in accepted(logs):
        first_of[r.epoch] = min(first_of.get(r.epoch, r.mono), r.mono)
    for r in accepted(logs):
        for epoch, first in first_of.items():
            if epoch > r.epoch and r.mono > first:
                found.append(
                    f"{r.agent} accepted {r.kind} #{r.id} of epoch {r.epoch} at mono {r.mono:.3f}, after "
                    f"epoch {epoch}'s first accepted command at {first:.3f}"
                )
    return found
