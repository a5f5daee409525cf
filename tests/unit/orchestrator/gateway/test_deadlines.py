"""Which limit a client connection is past (``deadlines.overdue``), and where the limits come from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import pytest

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.flags import add_shared_arguments, shared_argv
from vllm_disagg.orchestrator.gateway.deadlines import ClientLimits, overdue

LIMITS = ClientLimits(head_timeout_s=10, body_timeout_s=20, body_min_rate=500, write_timeout_s=30)


@dataclass
class Conn:
    """What ``overdue`` reads of a ``GatewayProtocol``."""

    head_since: float | None = None
    body_since: float | None = None
    body_received: int = 0
    stalled_since: float | None = None
    idle_since: float | None = None
    reading_paused: bool = False


@pytest.mark.parametrize(
    ("conn", "now", "reason"),
    [
        pytest.param(Conn(head_since=0), 9.9, None, id="a head within its deadline"),
        pytest.param(Conn(head_since=0), 10.1, "head_timeout", id="a head past its deadline"),
        pytest.param(Conn(body_since=0), 19.9, None, id="a body within its grace"),
        pytest.param(Conn(body_since=0, body_received=100), 20.3, "body_timeout", id="a body too slow"),
        pytest.param(Conn(body_since=0, body_received=50_000), 100, None, id="a body at the minimum rate"),
        pytest.param(Conn(body_since=0, body_received=50_000), 121, "body_timeout", id="a body under it"),
        pytest.param(Conn(stalled_since=0), 29, None, id="a writer stalled briefly"),
        pytest.param(Conn(stalled_since=0), 31, "write_timeout", id="a writer stalled too long"),
        pytest.param(Conn(head_since=0, reading_paused=True), 60, None, id="no read deadline while we wait"),
        pytest.param(
            Conn(stalled_since=0, reading_paused=True), 31, "write_timeout", id="a stalled write all the same"
        ),
        pytest.param(Conn(idle_since=0), 76, "idle", id="keep-alive expiry"),
    ],
)
def test_a_connection_is_past_the_limit_its_state_has_run_out(
    conn: Conn, now: float, reason: str | None
) -> None:
    assert overdue(conn, now, LIMITS) == reason  # type: ignore[arg-type]  # the attributes it reads


def test_the_sweep_looks_four_times_per_shortest_deadline_and_at_least_every_five_seconds() -> None:
    assert ClientLimits(head_timeout_s=1.0).sweep_s() == 0.25
    assert ClientLimits().sweep_s() == 2.5
    assert ClientLimits(head_timeout_s=100, body_timeout_s=100, write_timeout_s=100).sweep_s() == 5.0


def test_the_flags_set_the_limits_and_up_forwards_them() -> None:
    parser = argparse.ArgumentParser()
    add_shared_arguments(parser, forwarded=True)
    args = parser.parse_args(["--client-head-timeout-s", "3", "--max-client-connections", "100"])
    assert shared_argv(args) == ("--client-head-timeout-s", "3.0", "--max-client-connections", "100")
    limits = ClientLimits.of(OrchestratorConfig(client_head_timeout_s=3.0, max_client_connections=100))
    assert (limits.head_timeout_s, limits.max_connections, limits.write_timeout_s) == (3.0, 100, 30.0)


@pytest.mark.parametrize(
    "field",
    ["client_head_timeout_s", "client_body_timeout_s", "client_body_min_rate", "client_write_timeout_s"],
)
def test_a_limit_must_be_positive(field: str) -> None:
    values: dict[str, Any] = {field: 0}
    with pytest.raises(ConfigError, match=field):
        OrchestratorConfig(**values)
