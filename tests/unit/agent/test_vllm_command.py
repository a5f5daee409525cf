"""The real-vLLM launch command: argv and environment per role and device, and what the agent reports."""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
import sys
from pathlib import Path

import pytest

from vllm_disagg import jsonutil
from vllm_disagg.agent.engine_command import SimEngineCommand, kv_events_endpoint
from vllm_disagg.agent.engine_kinds import engine_command, instance_info
from vllm_disagg.agent.kv.local import CONNECTOR_NAME, local_dir, local_endpoint
from vllm_disagg.agent.kv_forwarder import forwarder_endpoint
from vllm_disagg.agent.main import add_arguments, config_from_args
from vllm_disagg.agent.vllm_command import (
    VllmEngineCommand,
    flag_value,
    kv_transfer_config,
    vllm_argv,
    vllm_env,
)
from vllm_disagg.agent.vllm_plugin import NIXL_PROGRESS_NICE_ENV
from vllm_disagg.config import AgentConfig, SimTiming
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import VLLM_CAPABILITIES, InstanceInfo, KvLayout


def agent(**changes: object) -> AgentConfig:
    base: dict[str, object] = {
        "agent_id": "a",
        "role": "prefill",
        "engine": "vllm",
        "model": "tiny",
        "model_path": "/models/tiny",
        "engine_port": 8101,
    }
    return AgentConfig(**{**base, **changes})  # type: ignore[arg-type]


def flags(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs after the module name; bare switches map to ''."""
    rest = argv[argv.index("serve") + 2 :]  # after "serve MODEL_PATH"
    out: dict[str, str] = {}
    i = 0
    while i < len(rest):
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            out[rest[i]] = rest[i + 1]
            i += 2
        else:
            out[rest[i]] = ""
            i += 1
    return out


KV_ROLES = [
    pytest.param("prefill", "kv_producer", id="prefill-produces-kv"),
    pytest.param("decode", "kv_consumer", id="decode-consumes-kv"),
    pytest.param("both", "kv_both", id="both-produces-and-consumes-kv"),
]


@pytest.mark.parametrize(("role", "kv_role"), KV_ROLES)
def test_the_kv_transfer_config_names_nixl_and_the_roles_kv_role(role: str, kv_role: str) -> None:
    transfer = jsonutil.loads(flags(vllm_argv(agent(role=role), "cpu"))["--kv-transfer-config"])
    assert transfer == {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}


def test_on_cuda_kv_buffers_stay_on_the_device() -> None:
    transfer = jsonutil.loads(flags(vllm_argv(agent(role="decode"), "cuda"))["--kv-transfer-config"])
    assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def test_without_a_connector_no_kv_transfer_config_and_no_side_channel() -> None:
    cfg = agent(kv_connector="")
    assert "--kv-transfer-config" not in vllm_argv(cfg, "cpu")
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in vllm_env(cfg, "cpu")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_kv_load_failure_policy_goes_into_the_kv_transfer_config(policy: str) -> None:
    cfg = agent(role="decode", kv_load_failure_policy=policy)
    assert kv_transfer_config(cfg, "cuda") == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy,
    }
    transfer = jsonutil.loads(flags(vllm_argv(cfg, "cpu"))["--kv-transfer-config"])
    assert transfer["kv_load_failure_policy"] == policy


def test_an_unset_kv_load_failure_policy_leaves_vllms_default() -> None:
    assert "kv_load_failure_policy" not in kv_transfer_config(agent(role="decode"), "cpu")


def test_without_a_connector_the_kv_load_failure_policy_is_not_passed() -> None:
    cfg = agent(role="decode", kv_connector="", kv_load_failure_policy="recompute")
    assert kv_transfer_config(cfg, "cpu") == {}
    assert "--kv-transfer-config" not in vllm_argv(cfg, "cpu")


def test_the_engine_is_vllm_serve_of_the_model_path_with_the_verified_cpu_flags() -> None:
    argv = vllm_argv(agent(engine_host="127.0.0.2", sim=SimTiming(max_num_seqs=4)), "cpu")
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/models/tiny"]
    got = flags(argv)
    expected = {
        "--served-model-name": "tiny",
        "--host": "127.0.0.2",
        "--port": "8101",
        "--max-model-len": "512",
        "--dtype": "float32",
        "--max-num-seqs": "4",
        "--block-size": "128",
        "--enforce-eager": "",
        "--enable-prompt-tokens-details": "",
    }
    assert {k: got.get(k) for k in expected} == expected


def test_on_cuda_dtype_eager_mode_and_batch_size_are_vllms_own_unless_the_user_gives_them() -> None:
    got = flags(vllm_argv(agent(), "cuda"))
    assert not {"--dtype", "--enforce-eager", "--max-num-seqs"} & set(got), got
    assert got["--block-size"] == "16"  # vLLM's CUDA default, said so the orchestrator knows it
    mine = agent(extra_engine_args=("--dtype", "bfloat16", "--max-num-seqs", "256"))
    assert {k: flags(vllm_argv(mine, "cuda"))[k] for k in ("--dtype", "--max-num-seqs")} == {
        "--dtype": "bfloat16",
        "--max-num-seqs": "256",
    }


def test_on_cpu_the_users_flags_win_over_the_test_settings() -> None:
    argv = vllm_argv(agent(extra_engine_args=("--dtype", "bfloat16")), "cpu")
    assert flags(argv)["--dtype"] == "bfloat16"  # the last one given is the one vLLM takes


def test_kv_events_are_published_on_an_ipc_socket_in_the_agents_private_directory() -> None:
    # They carry users' prompts: never tcp://* (every interface), and no replay socket either.
    cfg = agent(kv_events_port=5557)
    events = jsonutil.loads(flags(vllm_argv(cfg, "cpu"))["--kv-events-config"])
    path = local_dir() / "events-a-8101.sock"
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{path}",  # ipc:// makes vLLM bind, as '*' would, but for this user only
        "topic": "kv-events",
    }
    assert kv_events_endpoint(cfg) == forwarder_endpoint(cfg) == f"ipc://{path}"  # the agent's SUB


def test_the_kv_events_directory_is_made_private_before_each_launch() -> None:
    cfg = agent(agent_id=f"prep-{os.getpid()}")
    endpoint = kv_events_endpoint(cfg)
    directory = Path(endpoint.removeprefix("ipc://")).parent
    assert directory == local_dir()
    VllmEngineCommand("cpu").prepare(cfg)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "agent_id", ["p", "x" * 128], ids=["short id: readable name", "128-char id: hashed, within the limit"]
)
def test_the_kv_events_socket_path_fits_a_unix_socket(agent_id: str) -> None:
    endpoint = kv_events_endpoint(agent(agent_id=agent_id))
    assert endpoint.startswith(f"ipc://{local_dir()}/events-")
    assert len(endpoint.removeprefix("ipc://").encode()) <= 100  # sun_path: 108 bytes with its NUL


def test_two_agents_on_a_host_never_share_a_kv_events_socket() -> None:
    endpoints = {
        kv_events_endpoint(agent(agent_id=a, engine_port=port)) for a in ("p", "d") for port in (8100, 8101)
    }
    assert len(endpoints) == 4


def test_the_simulated_engine_publishes_on_loopback_at_the_configured_port() -> None:
    cfg = agent(engine="sim", engine_host="0.0.0.0", kv_events_port=5557)
    assert kv_events_endpoint(cfg) == forwarder_endpoint(cfg) == "tcp://127.0.0.1:5557"
    assert SimEngineCommand.engine_config(cfg).kv_events_port == 5557


def test_each_instance_gets_its_own_side_channel_port() -> None:
    assert vllm_env(agent(), "cpu")["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "9101"  # engine port + 1000
    assert vllm_env(agent(nixl_side_channel_port=5600), "cpu")["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"


ENVS = [
    pytest.param(
        "cpu",
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": "9101",
            "VLLM_DISAGG_NIXL_PROGRESS_NICE": "19",
        },
        id="cpu-sets-the-cpu-backend-the-side-channel-and-a-niced-progress-thread",
    ),
    pytest.param(
        "cuda",
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "9101"},
        id="cuda-sets-only-the-side-channel",
    ),
]


@pytest.mark.parametrize(("device", "expected"), ENVS)
def test_engine_environment_per_device(device: str, expected: dict[str, str]) -> None:
    env = vllm_env(agent(), device)  # type: ignore[arg-type]
    vllm_keys = {k: v for k, v in env.items() if k.startswith("VLLM_") and k != "VLLM_NO_USAGE_STATS"}
    assert vllm_keys == expected
    assert env["HF_HUB_OFFLINE"] == "1"  # the model is local: never wait on the Hub


@pytest.mark.parametrize("connector", ["", CONNECTOR_NAME])
def test_only_a_nixl_engine_gets_its_progress_thread_niced(connector: str) -> None:
    assert NIXL_PROGRESS_NICE_ENV not in vllm_env(agent(kv_connector=connector), "cpu")


def test_cpu_threads_and_kv_space_are_configurable() -> None:
    env = vllm_env(agent(omp_threads_bind="1", kv_cache_space_gib=2), "cpu")
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("1", "2")


def test_extra_engine_args_come_last_so_they_override_ours() -> None:
    argv = vllm_argv(agent(extra_engine_args=("--dtype", "bfloat16")), "cpu")
    assert argv[-2:] == ["--dtype", "bfloat16"]
    assert flag_value(argv, "--dtype") == "bfloat16"


def test_a_separate_engine_interpreter_and_served_name_are_honoured() -> None:
    argv = vllm_argv(agent(engine_python="/opt/vllm/bin/python", served_model_name="public"), "cpu")
    assert argv[0] == "/opt/vllm/bin/python"
    assert flags(argv)["--served-model-name"] == "public"


def test_launching_without_a_model_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model_path"):
        vllm_argv(agent(model_path=""), "cpu")


INFOS = [
    pytest.param("cpu", (), 128, id="cpu-reports-block-size-128"),
    pytest.param("cuda", (), 16, id="cuda-reports-block-size-16"),
    pytest.param("cpu", ("--block-size=64",), 64, id="an-overridden-block-size-is-reported"),
]


@pytest.mark.parametrize(("device", "extra", "block_size"), INFOS)
def test_instance_info_reports_vllm_its_block_size_and_connector(
    device: str, extra: tuple[str, ...], block_size: int
) -> None:
    cfg = agent(role="decode", served_model_name="public", extra_engine_args=extra)
    info = VllmEngineCommand(device).instance_info(cfg)  # type: ignore[arg-type]
    # Its KV layout as its command line says (NixlConnector asks for LBHNC; tests/unit/agent/test_layout.py).
    assert (info.tensor_parallel_size, info.layout.tp_size, info.layout.kv_layout) == (1, 1, "LBHNC")
    assert info.layout.model_path == cfg.model_path
    assert info.layout.attention_backend == ("CPU_ATTN" if device == "cpu" else info.layout.attention_backend)
    assert dataclasses.replace(info, layout=KvLayout(), tensor_parallel_size=0) == InstanceInfo(
        url="http://127.0.0.1:8101",
        role="decode",
        model="public",
        engine="vllm",
        block_size=block_size,
        kv_connector="NixlConnector",
        max_model_len=512,
        capabilities=VLLM_CAPABILITIES,  # the vLLM 0.32 it launches says its streams' token ids
    )


def test_the_agent_launches_vllm_without_attach() -> None:
    cfg = agent(engine_device="cpu")
    command = engine_command(cfg)
    assert isinstance(command, VllmEngineCommand)
    assert instance_info(cfg).engine == "vllm"
    assert command.env(cfg)["VLLM_TARGET_DEVICE"] == "cpu"


def test_agent_flags_reach_the_vllm_command() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--agent-id=p0",
            "--role=prefill",
            "--engine=vllm",
            "--model-path=/m",
            "--engine-device=cpu",
            "--omp-threads-bind=0",
            "--kv-events-port=5557",
            "--engine-args=--seed 7 --max-num-batched-tokens 1024",
        ]
    )
    cfg = config_from_args(args)
    argv = VllmEngineCommand().argv(cfg)
    assert (flag_value(argv, "serve"), flag_value(argv, "--seed")) == ("/m", "7")
    assert flag_value(argv, "--max-num-batched-tokens") == "1024"
    assert VllmEngineCommand().env(cfg)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_the_kv_load_failure_policy_flag_reaches_the_kv_transfer_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--agent-id=d0", "--role=decode", "--engine=vllm", "--model-path=/m", "--engine-device=cpu"]
    assert config_from_args(parser.parse_args(base)).kv_load_failure_policy == ""
    cfg = config_from_args(parser.parse_args([*base, "--kv-load-failure-policy=recompute"]))
    transfer = flag_value(VllmEngineCommand().argv(cfg), "--kv-transfer-config")
    assert transfer is not None
    assert jsonutil.loads(transfer)["kv_load_failure_policy"] == "recompute"


BAD_CONFIGS = [
    pytest.param({"engine_device": "tpu"}, "engine_device", id="unknown-device"),
    pytest.param({"kv_events_port": 70000}, "kv_events_port", id="events-port-out-of-range"),
    pytest.param({"max_model_len": 0}, "max_model_len", id="zero-context-length"),
    pytest.param({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy", id="unknown-kv-load-policy"),
]


@pytest.mark.parametrize(("changes", "field"), BAD_CONFIGS)
def test_bad_vllm_settings_are_refused_naming_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        agent(**changes)


def test_a_kv_lease_goes_into_the_connectors_extra_config_as_vllms_kv_lease_duration() -> None:
    cfg = agent(role="prefill", kv_lease_s=600)
    transfer = jsonutil.loads(flags(vllm_argv(cfg, "cpu"))["--kv-transfer-config"])
    assert transfer["kv_connector_extra_config"] == {"kv_lease_duration": 600}
    assert "kv_connector_extra_config" not in kv_transfer_config(agent(role="prefill"), "cpu")


def test_a_negative_kv_lease_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="kv_lease_s"):
        agent(kv_lease_s=-1)


STORE_ROLES = [pytest.param(role, id=role) for role in ("prefill", "decode", "both")]


@pytest.mark.parametrize("role", STORE_ROLES)
def test_a_store_connector_runs_kv_both_in_every_role_with_its_settings(role: str) -> None:
    cfg = agent(
        role=role, kv_connector="shared-storage", kv_connector_config='{"shared_storage_path": "/kv"}'
    )
    transfer = jsonutil.loads(flags(vllm_argv(cfg, "cpu"))["--kv-transfer-config"])
    assert transfer == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",  # each engine saves what it computes and loads what the store holds
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"shared_storage_path": "/kv"},
    }


def test_a_p_d_connector_by_our_name_runs_vllm_s_class_by_role_with_the_lease_beside_its_settings() -> None:
    cfg = agent(
        role="decode", kv_connector="mooncake", kv_connector_config='{"num_workers": 4}', kv_lease_s=60
    )
    transfer = jsonutil.loads(flags(vllm_argv(cfg, "cuda"))["--kv-transfer-config"])
    assert transfer == {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"num_workers": 4, "kv_lease_duration": 60},
    }


def test_an_engine_sharing_its_host_s_pool_talks_to_that_agent_and_says_so() -> None:
    cfg = agent(role="decode", kv_connector="vllm-disagg", kv_pool_node="prefill-0")
    transfer = jsonutil.loads(flags(vllm_argv(cfg, "cpu"))["--kv-transfer-config"])
    assert transfer["kv_connector_extra_config"] == {
        "agent_endpoint": local_endpoint("prefill-0"),  # the pool's agent, not its own
        "engine_name": "a",  # its own name in the shared pool
    }
    info = VllmEngineCommand("cpu").instance_info(cfg)
    assert info.kv_pool_node == "prefill-0"
    own = VllmEngineCommand("cpu").instance_info(agent(role="decode", kv_connector="vllm-disagg"))
    assert own.kv_pool_node == ""
