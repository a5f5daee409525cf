"""Topology labels of an agent: ``--label KEY=VALUE`` over ``VLLM_DISAGG_NODE/ZONE/DOMAIN``, checked
before anything starts, and said in the Hello (``InstanceInfo.labels``)."""

from __future__ import annotations

import pytest

from vllm_disagg.agent import connect
from vllm_disagg.agent import main as agent_main
from vllm_disagg.agent.discover import EngineFacts, attached_instance_info
from vllm_disagg.agent.engine_kinds import instance_info
from vllm_disagg.agent.labels import resolve_labels
from vllm_disagg.cli.commands import build_parser, main
from vllm_disagg.errors import ConfigError


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        pytest.param([], {}, (), id="none"),
        pytest.param(
            [],
            {"VLLM_DISAGG_NODE": "gpu-7", "VLLM_DISAGG_ZONE": "us-1a", "VLLM_DISAGG_DOMAIN": "nvl-3"},
            (("domain", "nvl-3"), ("node", "gpu-7"), ("zone", "us-1a")),
            id="the-environment-sets-node-zone-domain",
        ),
        pytest.param(
            [("domain", "nvl-9")], {"VLLM_DISAGG_DOMAIN": "nvl-3"}, (("domain", "nvl-9"),), id="a-flag-wins"
        ),
        pytest.param([("rack", "r1"), ("rack", "r2")], {}, (("rack", "r2"),), id="the-last-flag-wins"),
        pytest.param([], {"VLLM_DISAGG_ZONE": ""}, (), id="an-empty-variable-sets-nothing"),
        pytest.param([("x.y", "a=b")], {}, (("x.y", "a=b"),), id="a-value-may-hold-an-equals-sign"),
    ],
)
def test_labels_come_from_flags_over_the_environment(
    flags: list[tuple[str, str]], env: dict[str, str], expected: tuple[tuple[str, str], ...]
) -> None:
    assert resolve_labels(flags, env) == expected


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param([("Bad Key", "x")], "is not 1-63 lower-case", id="bad-key"),
        pytest.param([("domain", "x" * 129)], "its value must be 1 to 128", id="long-value"),
        pytest.param([(f"k{i}", "v") for i in range(17)], "17 labels, at most 16", id="too-many"),
    ],
)
def test_labels_past_the_bounds_are_a_config_error(flags: list[tuple[str, str]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_labels(flags, {})


def test_agent_flags_reach_the_hello(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DISAGG_NODE", "node-1")
    monkeypatch.setenv("VLLM_DISAGG_DOMAIN", "nvl-env")
    args = build_parser().parse_args(
        ["agent", "--agent-id", "d0", "--role", "decode", "--label", "domain=nvl-3a", "--label", "rack=r2"]
    )
    cfg = agent_main.config_from_args(args)
    assert instance_info(cfg).labels == {"domain": "nvl-3a", "node": "node-1", "rack": "r2"}


def test_connect_flags_reach_the_attached_agents_hello(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DISAGG_ZONE", "z1")
    args = build_parser().parse_args(
        ["connect", "--orchestrator", "tcp://127.0.0.1:5555", "--url", "http://h:8000", "--label", "domain=d"]
    )
    facts = EngineFacts(served_names=("m",))
    cfg = connect.config_for(args, facts)
    assert cfg.labels == (("domain", "d"), ("zone", "z1"))
    info, _ = attached_instance_info(cfg, facts)
    assert info.labels == {"domain": "d", "zone": "z1"}


def test_a_bad_label_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["agent", "--agent-id", "a", "--role", "both", "--label", "Domain=x"]) == 2
    assert "configuration error: agent labels: label key 'Domain'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", "--agent-id", "a", "--role", "both", "--label", "domain"])
    assert "expected KEY=VALUE" in capsys.readouterr().err
