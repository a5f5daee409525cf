"""An agent endpoint other hosts can reach needs agent keys, or ``--insecure-agents`` said out loud:
without keys anyone reaching it could register an engine and be sent users' prompts."""

from __future__ import annotations

import pytest

from vllm_disagg.cli.commands import main
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.engine_urls import host_local_endpoint


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.9:0", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///run/user/0/vllm-disagg/agents.sock", True),
        ("inproc://agents", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://10.0.0.5:5555", False),
        ("tcp://eth0:5555", False),  # an interface name: whatever address it has
        ("tcp://orchestrator.example:5555", False),
    ],
)
def test_which_endpoints_only_this_host_can_reach(endpoint: str, local: bool) -> None:
    assert host_local_endpoint(endpoint) is local


def test_a_public_agent_endpoint_without_keys_is_refused_unless_insecure_agents() -> None:
    with pytest.raises(ConfigError, match="reachable from other hosts and no agent keys"):
        OrchestratorConfig(zmq_endpoint="tcp://0.0.0.0:5555")
    assert OrchestratorConfig(zmq_endpoint="tcp://0.0.0.0:5555", insecure_agents=True).insecure_agents
    keyed = OrchestratorConfig(
        zmq_endpoint="tcp://0.0.0.0:5555", curve_secret_key_file="o.key_secret", agent_keys_dir="agents"
    )
    assert keyed.zmq_endpoint == "tcp://0.0.0.0:5555"
    assert OrchestratorConfig(zmq_endpoint="tcp://127.0.0.1:5555").zmq_endpoint == "tcp://127.0.0.1:5555"


def test_the_cli_refuses_it_before_anything_starts_and_says_what_to_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["orchestrator", "--port", "0", "--zmq-endpoint", "tcp://0.0.0.0:0"]) == 2
    err = capsys.readouterr().err
    assert "--curve-secret-key and --agent-keys" in err and "--insecure-agents" in err
