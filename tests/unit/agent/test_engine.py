"""Engine supervision decisions (pure): the state machine, the restart backoff, the engine command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vllm_disagg.agent.engine import Decision, Observation, decide, restart_delay
from vllm_disagg.agent.engine_command import SimEngineCommand
from vllm_disagg.agent.engine_kinds import engine_command, instance_info
from vllm_disagg.config import AgentConfig, SimTiming
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import VLLM_CAPABILITIES, InstanceInfo, KvLayout

STARTUP_TIMEOUT_S = 60.0


def obs(
    state: str,
    *,
    alive: bool = True,
    healthy: bool = False,
    attached: bool = False,
    starting_for_s: float = 1.0,
    failed_checks: int | None = None,
) -> Observation:
    return Observation(
        state=state,  # type: ignore[arg-type]
        attached=attached,
        alive=alive,
        healthy=healthy,
        starting_for_s=starting_for_s,
        failed_checks=(0 if healthy else 1) if failed_checks is None else failed_checks,
    )


DECISIONS = [
    ("a starting engine that answers /health is ready", obs("starting", healthy=True), Decision("ready")),
    ("a starting engine not answering yet stays starting", obs("starting"), Decision("starting")),
    (
        "a starting engine stuck past the startup timeout is killed",
        obs("starting", starting_for_s=STARTUP_TIMEOUT_S + 1),
        Decision("restarting", "kill"),
    ),
    ("a respawned engine not answering yet is starting", obs("restarting"), Decision("starting")),
    ("a respawned engine that answers is ready", obs("restarting", healthy=True), Decision("ready")),
    ("a ready engine that answers stays ready", obs("ready", healthy=True), Decision("ready")),
    ("a ready engine whose health fails is unhealthy", obs("ready"), Decision("unhealthy")),
    ("an unhealthy engine that answers again is ready", obs("unhealthy", healthy=True), Decision("ready")),
    (
        "an unhealthy engine is not killed however long it lasts",
        obs("unhealthy", starting_for_s=STARTUP_TIMEOUT_S * 10),
        Decision("unhealthy"),
    ),
    (
        "a ready engine whose process exited is restarted",
        obs("ready", alive=False),
        Decision("restarting", "restart"),
    ),
    (
        "a process that exits while starting is restarted",
        obs("starting", alive=False),
        Decision("restarting", "restart"),
    ),
    ("a stopped engine stays stopped", obs("stopped", alive=False), Decision("stopped")),
    ("a stopped engine stays stopped even if healthy", obs("stopped", healthy=True), Decision("stopped")),
    ("attached: health 200 is ready", obs("starting", attached=True, healthy=True), Decision("ready")),
    ("attached: no answer at first is unhealthy", obs("starting", attached=True), Decision("unhealthy")),
    (
        "attached: a ready engine that stops answering is unhealthy",
        obs("ready", attached=True),
        Decision("unhealthy"),
    ),
    (
        "attached: never killed or restarted",
        obs("starting", attached=True, starting_for_s=STARTUP_TIMEOUT_S * 10),
        Decision("unhealthy"),
    ),
]


@pytest.mark.parametrize(
    ("observation", "expected"), [d[1:] for d in DECISIONS], ids=[d[0] for d in DECISIONS]
)
def test_decide(observation: Observation, expected: Decision) -> None:
    assert decide(observation, startup_timeout_s=STARTUP_TIMEOUT_S) == expected


@pytest.mark.parametrize(
    ("failed_checks", "expected"),
    [(1, "ready"), (2, "ready"), (3, "unhealthy"), (7, "unhealthy")],
    ids=["one-slow-check-keeps-ready", "two-keep-ready", "the-third-in-a-row-is-unhealthy", "more-stay-so"],
)
def test_a_ready_engine_turns_unhealthy_only_after_failed_checks_in_a_row(
    failed_checks: int, expected: str
) -> None:
    observation = obs("ready", failed_checks=failed_checks)
    assert decide(observation, startup_timeout_s=STARTUP_TIMEOUT_S, unhealthy_after=3).state == expected
    # An engine that was not ready is not kept ready by the grace.
    assert (
        decide(obs("unhealthy", failed_checks=1), startup_timeout_s=1, unhealthy_after=3).state == "unhealthy"
    )


@pytest.mark.parametrize(
    ("failures", "expected"),
    [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (50, 30.0), (10_000, 30.0)],
    ids=lambda v: str(v),
)
def test_restart_delay_doubles_from_base_up_to_the_cap(failures: int, expected: float) -> None:
    assert restart_delay(failures, base_s=1.0, max_s=30.0) == expected


def agent(**changes: object) -> AgentConfig:
    return AgentConfig(agent_id="a", role="prefill", **changes)  # type: ignore[arg-type]


def test_sim_engine_command_runs_the_sim_engine_subcommand_with_the_agents_settings() -> None:
    timing = SimTiming(block_size=32, decode_step_s=0.5, kv_bytes_per_token=2048)
    cfg = agent(model="m1", engine_port=8123, sim=timing)
    argv = SimEngineCommand().argv(cfg)
    assert argv[0] == sys.executable
    rest = argv[argv.index("sim-engine") + 1 :]
    flags = dict(zip(rest[::2], rest[1::2], strict=True))
    assert (flags["--model"], flags["--port"], flags["--block-size"]) == ("m1", "8123", "32")
    assert float(flags["--decode-step-s"]) == 0.5
    assert flags["--kv-bytes-per-token"] == "2048"


@pytest.mark.parametrize(
    ("changes", "port"),
    [
        pytest.param({}, "10123", id="engine port + 2000, where vLLM would publish"),
        pytest.param({"kv_events_port": 9500}, "9500", id="the configured port"),
    ],
)
def test_a_launched_sim_engine_publishes_kv_events_where_the_agent_listens(
    changes: dict[str, object], port: str
) -> None:
    argv = SimEngineCommand().argv(agent(engine_port=8123, **changes))
    rest = argv[argv.index("sim-engine") + 1 :]
    flags = dict(zip(rest[::2], rest[1::2], strict=True))
    assert flags["--kv-events-port"] == port


def test_the_tokenizer_is_vllms_weights_dir_made_absolute_and_none_for_the_sim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    attached = {"engine": "vllm", "attach_url": "http://10.0.0.5:8000"}
    assert instance_info(agent(model_path="tiny", **attached)).tokenizer == str(tmp_path / "tiny")
    assert instance_info(agent(model_path="org/model", **attached)).tokenizer == "org/model"  # a hub id
    assert instance_info(agent(**attached)).tokenizer == ""
    assert instance_info(agent(model_path="tiny", engine_port=8123)).tokenizer == ""  # the sim: bytes


def test_instance_info_of_a_launched_sim_engine() -> None:
    cfg = agent(model="m1", engine_port=8123, sim=SimTiming(block_size=32))
    assert instance_info(cfg) == InstanceInfo(
        url="http://127.0.0.1:8123",
        role="prefill",
        model="m1",
        engine="sim",
        block_size=32,
        max_model_len=4096,
        capabilities=VLLM_CAPABILITIES,  # it speaks vLLM 0.32: streams say their token ids
        layout=KvLayout(max_num_seqs=SimTiming().max_num_seqs),  # its batch, and no KV layout to speak of
    )


def test_attach_mode_launches_nothing_and_reports_the_attached_url() -> None:
    cfg = agent(engine="vllm", attach_url="http://10.0.0.5:8000/")
    assert engine_command(cfg) is None
    info = instance_info(cfg)
    assert (info.url, info.engine) == ("http://10.0.0.5:8000", "vllm")


def test_launching_vllm_without_a_model_path_is_a_config_error() -> None:
    assert engine_command(agent(engine="vllm")) is not None  # vllm is launchable now
    with pytest.raises(ConfigError, match="model_path"):
        instance_info(agent(engine="vllm"))


@pytest.mark.parametrize(("policy", "expected"), [("", "fail"), ("fail", "fail"), ("recompute", "recompute")])
def test_a_launched_sim_engine_follows_the_agents_kv_load_failure_policy(policy: str, expected: str) -> None:
    argv = SimEngineCommand().argv(agent(engine_port=8123, kv_load_failure_policy=policy))
    rest = argv[argv.index("sim-engine") + 1 :]
    flags = dict(zip(rest[::2], rest[1::2], strict=True))
    assert flags["--kv-load-failure-policy"] == expected


@pytest.mark.parametrize(("lease", "expected"), [(0, "30.0"), (600, "600.0")])
def test_a_launched_sim_engine_holds_unpulled_kv_for_the_agents_kv_lease(lease: int, expected: str) -> None:
    argv = SimEngineCommand().argv(agent(engine_port=8123, kv_lease_s=lease))
    rest = argv[argv.index("sim-engine") + 1 :]
    assert dict(zip(rest[::2], rest[1::2], strict=True))["--kv-lease-s"] == expected
