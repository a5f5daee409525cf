"""Fencing (the highest epoch obeyed admits commands of it or newer) and the command log's lines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vllm_disagg import jsonutil
from vllm_disagg.agent.command_log import CommandLog
from vllm_disagg.agent.fencing import Fence, stale_error
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.commands import Drain, KvGrant
from vllm_disagg.protocol.messages import Command

FENCING = [
    pytest.param([0], [True], 0, id="epoch 0 (a single orchestrator) is obeyed"),
    pytest.param([0, 0, 0], [True, True, True], 0, id="a single orchestrator is always obeyed"),
    pytest.param([5, 3], [True, False], 5, id="5 then 3: the older leader is refused"),
    pytest.param([5, 5], [True, True], 5, id="5 then 5: one term, both obeyed"),
    pytest.param([5, 7, 5], [True, True, False], 7, id="5, 7, then 5: the deposed leader is refused"),
    pytest.param([3, 0], [True, False], 3, id="an orchestrator without etcd after a leader's term: refused"),
    pytest.param(
        [1, 9, 2, 9, 10], [True, True, False, True, True], 10, id="refusals leave the highest alone"
    ),
]


@pytest.mark.parametrize(("epochs", "admitted", "highest"), FENCING)
def test_a_fence_admits_the_highest_epoch_obeyed_and_newer(
    epochs: list[int], admitted: list[bool], highest: int
) -> None:
    fence = Fence()
    assert [fence.admit(epoch) == "" for epoch in epochs] == admitted
    assert (fence.highest, fence.refused) == (highest, admitted.count(False))


def test_a_refusal_says_both_epochs_and_a_rise_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fence = Fence()
    with caplog.at_level(logging.INFO, logger="vllm_disagg.agent.fencing"):
        assert fence.admit(4) == "" and fence.admit(4) == ""
        assert fence.admit(2) == stale_error(2, 4)
    assert stale_error(2, 4) == (
        "stale epoch 2: this agent obeys epoch 4 and newer (a newer leader has taken over)"
    )
    assert [r.getMessage() for r in caplog.records] == [
        "now obeying epoch 4 (was 0): commands of older leaders are refused"
    ]


def test_the_command_log_appends_one_flushed_json_line_per_command_and_never_a_payload(
    tmp_path: Path,
) -> None:
    path = tmp_path / "commands.jsonl"
    path.write_bytes(b'{"earlier": "run"}\n')  # a restarted agent appends
    log = CommandLog.open(str(path))
    try:
        log.record(Command.of(7, Drain(), epoch=3), "tcp://a:5555", accepted=True)
        grant = KvGrant("sekrit-token", [b"k" * 32], "", 30.0)
        log.record(
            Command.of(8, grant, epoch=2), "tcp://b:5555", accepted=False, code="stale_epoch", error="old"
        )
        text = path.read_text()  # before close: every line is on the disk's way already
    finally:
        log.close()
    lines = [jsonutil.loads(line) for line in text.splitlines()]
    assert lines[0] == {"earlier": "run"} and log.lines == 2
    for line in lines[1:]:
        assert set(line) == {"t", "mono", "id", "kind", "epoch", "from", "accepted", "code", "error"}
        assert line["t"] > 1e9 and line["mono"] > 0
    assert [{k: v for k, v in line.items() if k not in ("t", "mono")} for line in lines[1:]] == [
        {
            "id": 7,
            "kind": "drain",
            "epoch": 3,
            "from": "tcp://a:5555",
            "accepted": True,
            "code": "",
            "error": "",
        },
        {
            "id": 8,
            "kind": "kv_grant",
            "epoch": 2,
            "from": "tcp://b:5555",
            "accepted": False,
            "code": "stale_epoch",
            "error": "old",
        },
    ]
    assert "sekrit" not in text


def test_a_command_log_that_cannot_be_written_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"agent\.command_log: cannot write"):
        CommandLog.open(str(tmp_path / "missing-dir" / "commands.jsonl"))
