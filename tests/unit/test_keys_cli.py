"""``vllm-disagg keys``: keypairs the orchestrator and agents load, secrets readable by their owner only."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from vllm_disagg.cli.commands import main
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.curve import load_agent_keys, load_keypair, load_public


def test_keys_for_an_orchestrator_and_two_agents_load_and_bind_each_agent_to_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "orchestrator", str(tmp_path)]) == 0
    assert main(["keys", "agent", "decode-0", str(tmp_path / "agents")]) == 0
    assert main(["keys", "agent", "decode-1", str(tmp_path / "agents")]) == 0
    assert "secret: " in capsys.readouterr().out
    server = load_keypair(str(tmp_path / "orchestrator.key_secret"))
    assert load_public(str(tmp_path / "orchestrator.key")) == server.public
    agents = load_agent_keys(str(tmp_path / "agents"))  # the .key_secret files beside them are ignored
    assert sorted(agents.values()) == ["decode-0", "decode-1"]
    assert agents[load_keypair(str(tmp_path / "agents" / "decode-1.key_secret")).public] == "decode-1"
    for secret in (tmp_path / "orchestrator.key_secret", tmp_path / "agents" / "decode-0.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["keys", "agent", "../escape", "DIR"], "an agent id names a file"),
        (["keys", "agent", "only-an-id"], "usage: vllm-disagg keys agent ID DIR"),
        (["keys", "orchestrator", "a", "b"], "usage: vllm-disagg keys orchestrator DIR"),
    ],
)
def test_bad_arguments_are_a_configuration_error(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert reason in capsys.readouterr().err


def test_a_public_key_file_is_not_a_keypair_and_an_empty_directory_admits_nobody(tmp_path: Path) -> None:
    main(["keys", "orchestrator", str(tmp_path)])
    with pytest.raises(ConfigError, match="holds no secret key"):
        load_keypair(str(tmp_path / "orchestrator.key"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no agent public keys"):
        load_agent_keys(str(tmp_path / "empty"))
