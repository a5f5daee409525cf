"""The fencing proof of this folder's tests (``commands.fencing_violations``) catches two leaders acting at
once, and passes clean handovers: a table of made-up command logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.replicas.commands import CommandRecord, fencing_violations, first_accepted, read_command_log


def rec(agent: str, mono: float, epoch: int, accepted: bool = True) -> CommandRecord:
    return CommandRecord(agent, 1e9 + mono, mono, int(mono * 10), "drain", epoch, "tcp://x", accepted, "")


CLEAN = {
    "a": [rec("a", 1.0, 5), rec("a", 2.0, 5), rec("a", 4.0, 9)],
    "b": [rec("b", 1.5, 5), rec("b", 4.5, 9), rec("b", 5.0, 5, accepted=False)],  # a stale one refused
}


@pytest.mark.parametrize(
    ("logs", "found"),
    [
        (CLEAN, 0),
        ({"a": [rec("a", 1.0, 9), rec("a", 2.0, 5)]}, 2),  # one agent went back an epoch
        (
            {"a": [rec("a", 1.0, 5), rec("a", 3.0, 9)], "b": [rec("b", 3.5, 5)]},
            1,
        ),  # b obeyed the old leader late
        ({"a": [rec("a", 1.0, 5)], "b": [rec("b", 0.5, 9)], "c": [rec("c", 0.7, 5)]}, 2),  # interleaved terms
    ],
    ids=["clean-handover", "an-agent-goes-back", "an-old-epoch-after-the-new-ones-first", "interleaved"],
)
def test_fencing_violations_are_found_where_two_leaders_acted_at_once(
    logs: dict[str, list[CommandRecord]], found: int
) -> None:
    assert len(fencing_violations(logs)) == found, fencing_violations(logs)


def test_the_new_epochs_first_command_is_the_earliest_accepted_one_of_a_newer_epoch() -> None:
    first = first_accepted(CLEAN, newer_than=5)
    assert first is not None and (first.agent, first.mono) == ("a", 4.0)
    assert first_accepted(CLEAN, newer_than=9) is None


def test_a_command_log_is_read_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    assert read_command_log("a", path) == []
    lines = [
        {"t": 1.5, "mono": 2.5, "id": 7, "kind": "drain", "epoch": 4, "from": "tcp://r0", "accepted": True},
        {
            "t": 1.6,
            "mono": 2.6,
            "id": 8,
            "kind": "undrain",
            "epoch": 3,
            "from": "tcp://r1",
            "accepted": False,
        },
    ]
    codes = [("", ""), ("stale_epoch", "stale epoch 3: this agent obeys epoch 4 and newer")]
    path.write_text(
        "".join(
            json.dumps({**d, "code": c, "error": e}) + "\n" for d, (c, e) in zip(lines, codes, strict=True)
        )
    )
    assert read_command_log("a", path) == [
        CommandRecord("a", 1.5, 2.5, 7, "drain", 4, "tcp://r0", True, ""),
        CommandRecord("a", 1.6, 2.6, 8, "undrain", 3, "tcp://r1", False, "stale_epoch"),
    ]
