"""``vllm-disagg up``: what its flags make of the cluster's child processes."""

from __future__ import annotations

import argparse
import json

import pytest

from vllm_disagg.cli.up import add_arguments, spec_from_args
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator import main as orchestrator_main
from vllm_disagg.orchestrator.flags import SHARED_FLAGS


def spec_of(*flags: str) -> list[list[str]]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(parser.parse_args(["--engine", "sim", "--prefill", "1", "--decode", "2", *flags]))
    return [spec.agent_argv(plan) for plan in spec.plans()]


def test_every_agent_gets_the_kv_load_failure_policy() -> None:
    for argv in spec_of("--kv-load-failure-policy", "recompute"):
        assert argv[argv.index("--kv-load-failure-policy") + 1] == "recompute"


def test_without_the_flag_the_agents_keep_the_engines_default() -> None:
    assert all("--kv-load-failure-policy" not in argv for argv in spec_of())


def test_an_unknown_policy_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        spec_of("--kv-load-failure-policy", "retry")
    assert "invalid choice: 'retry'" in capsys.readouterr().err


def test_every_agent_gets_the_kv_lease_and_none_without_the_flag() -> None:
    for argv in spec_of("--kv-lease-s", "600"):
        assert argv[argv.index("--kv-lease-s") + 1] == "600"
    assert all("--kv-lease-s" not in argv for argv in spec_of())


def test_every_sim_agent_gets_the_kv_bytes_per_token_and_none_without_the_flag() -> None:
    for argv in spec_of("--kv-bytes-per-token", "65536"):
        assert argv[argv.index("--kv-bytes-per-token") + 1] == "65536"
    assert all("--kv-bytes-per-token" not in argv for argv in spec_of())


def test_each_agent_gets_a_disk_tier_directory_of_its_own_under_the_one_given() -> None:
    argvs = spec_of("--kv-disk-dir", "/var/cache/pools", "--kv-disk-capacity", "50GiB")
    dirs = [argv[argv.index("--kv-disk-dir") + 1] for argv in argvs]
    ids = [argv[argv.index("--agent-id") + 1] for argv in argvs]
    assert dirs == [f"/var/cache/pools/{agent_id}" for agent_id in ids] and len(set(dirs)) == 3
    assert all(argv[argv.index("--kv-disk-capacity") + 1] == "50GiB" for argv in argvs)
    assert all("--kv-disk-dir" not in argv and "--kv-disk-capacity" not in argv for argv in spec_of())


@pytest.mark.parametrize("capacity", ["4096", "10%", "lots"])
def test_a_disk_tier_capacity_that_is_not_bytes_is_refused_before_anything_starts(capacity: str) -> None:
    with pytest.raises(ConfigError, match="kv disk capacity"):
        spec_of("--kv-disk-dir", "/tmp/x", "--kv-disk-capacity", capacity)


def vllm_spec_of(*flags: str) -> list[list[str]]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from_args(parser.parse_args(["--engine", "vllm", "--model", "/m", "--port", "8123", *flags]))
    return [spec.agent_argv(plan) for plan in spec.plans()]


def test_a_store_connector_s_directory_defaults_to_one_of_the_cluster_s_the_same_for_every_agent() -> None:
    argvs = vllm_spec_of("--kv-connector", "shared-storage")
    settings = {
        json.loads(argv[argv.index("--kv-connector-config") + 1])["shared_storage_path"] for argv in argvs
    }
    (store,) = settings
    assert store.endswith("/up-8123/kv-store")
    given = vllm_spec_of(
        "--kv-connector", "shared-storage", "--kv-connector-config", '{"shared_storage_path": "/kv"}'
    )
    assert {argv[argv.index("--kv-connector-config") + 1] for argv in given} == {
        '{"shared_storage_path": "/kv"}'
    }
    assert all("--kv-connector-config" not in argv for argv in vllm_spec_of())


def test_a_connector_that_keeps_kv_under_its_engine_is_refused_for_a_p_d_cluster() -> None:
    with pytest.raises(ConfigError, match="role must be 'both'"):
        vllm_spec_of("--kv-connector", "offloading")


def orchestrator_argv_of(*flags: str) -> list[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engine", "sim", *flags])
    return spec_from_args(args).orchestrator_argv()


def test_the_orchestrators_recovery_flags_given_to_up_reach_the_orchestrator_and_parse_there() -> None:
    argv = orchestrator_argv_of("--max-resumes", "5", "--breaker-open-s", "2.5", "--idle-timeout-s", "60")
    i = argv.index("orchestrator")
    assert argv[argv.index("--max-resumes") + 1] == "5" and argv[argv.index("--breaker-open-s") + 1] == "2.5"
    parser = argparse.ArgumentParser()
    orchestrator_main.add_arguments(parser)
    config = orchestrator_main.config_from_args(parser.parse_args(argv[i + 1 :]))
    assert (config.max_resumes, config.breaker_open_s, config.idle_timeout_s) == (5, 2.5, 60.0)


def test_recovery_flags_not_given_to_up_leave_the_orchestrators_defaults() -> None:
    argv = orchestrator_argv_of()
    assert not {flag for flag, *_ in SHARED_FLAGS} & set(argv)


def admission_of(*flags: str) -> tuple[list[str], AdmissionConfig]:
    """The orchestrator's argv from ``up`` with ``flags``, and the admission config it parses to."""
    argv = orchestrator_argv_of(*flags)
    parser = argparse.ArgumentParser()
    orchestrator_main.add_arguments(parser)
    config = orchestrator_main.config_from_args(parser.parse_args(argv[argv.index("orchestrator") + 1 :]))
    return argv, config.admission


def test_the_admission_flags_given_to_up_reach_the_orchestrator() -> None:
    _, admission = admission_of(
        "--admission-max-queue", "64", "--admission-ttft-s", "2", "--sheddable-priority", "3",
        "--tenant-weight", "gold=3", "--tenant-weight", "bronze=0.5", "--forward-priority",
        "--tenant-header", "x-org",
    )  # fmt: skip
    assert (admission.max_queue, admission.ttft_s, admission.sheddable_priority) == (64, 2.0, 3)
    assert admission.tenant_weights == (("gold", 3.0), ("bronze", 0.5))
    assert admission.forward_priority and admission.enabled and admission.tenant_header == "x-org"
    assert not admission_of("--admission", "off")[1].enabled


def test_without_admission_flags_up_leaves_the_orchestrators_defaults() -> None:
    argv, admission = admission_of()
    assert admission == AdmissionConfig()
    assert not [part for part in argv if "admission" in part or "tenant" in part or "priority" in part]


@pytest.mark.parametrize("weight", ["gold", "gold=0", "gold=inf", "gold=-1", "=2", "gold=x"])
def test_a_bad_tenant_weight_is_refused_by_the_parser(
    weight: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        orchestrator_argv_of("--tenant-weight", weight)
    assert "TENANT=WEIGHT" in capsys.readouterr().err


def test_a_tenant_weighed_twice_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="twice"):
        admission_of("--tenant-weight", "a=1", "--tenant-weight", "a=2")


def test_labels_reach_every_agent_and_an_instance_label_wins_for_its_instance() -> None:
    argvs = spec_of("--label", "zone=z1", "--label", "domain=a", "--instance-label", "decode-1:domain=b")

    def labels(argv: list[str]) -> list[str]:
        return [argv[i + 1] for i, flag in enumerate(argv) if flag == "--label"]

    assert [labels(argv) for argv in argvs] == [
        ["domain=a", "zone=z1"],  # prefill-0
        ["domain=a", "zone=z1"],  # decode-0
        ["domain=b", "zone=z1"],  # decode-1
    ]
    assert all("--label" not in argv for argv in spec_of())


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--instance-label", "decode-7:domain=b"), "no instance 'decode-7'"),
        (("--label", "Bad Key=x"), "labels of prefill-0:"),
        (("--label", "domain=" + "x" * 200), "labels of prefill-0:"),
    ],
)
def test_labels_that_cannot_be_used_are_refused_before_anything_starts(
    flags: tuple[str, ...], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        spec_of(*flags)


def test_a_label_without_a_value_sign_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        spec_of("--instance-label", "decode-0")
    assert "expected AGENT_ID:KEY=VALUE" in capsys.readouterr().err


def test_tracing_flags_reach_the_orchestrator_and_the_vllm_engines_the_agents_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_TRACES_EXPORTER",
    ):
        monkeypatch.delenv(variable, raising=False)
    url = "http://127.0.0.1:4318/v1/traces"
    argv = orchestrator_argv_of("--otlp-traces-endpoint", url, "--otel-traces-sampler", "always_on")
    parser = argparse.ArgumentParser()
    orchestrator_main.add_arguments(parser)
    config = orchestrator_main.config_from_args(parser.parse_args(argv[argv.index("orchestrator") + 1 :]))
    assert config.tracing is not None and (config.tracing.endpoint, config.tracing.sampler) == (
        url,
        "always_on",
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--prefill", "1", "--decode", "1", "--otlp-traces-endpoint", url]
    vllm = spec_from_args(parser.parse_args(["--engine", "vllm", *flags]))
    for agent in (vllm.agent_argv(plan) for plan in vllm.plans()):
        assert agent[agent.index("--otlp-traces-endpoint") + 1] == url
        assert agent[agent.index("--otlp-traces-protocol") + 1] == "http/protobuf"
    assert not any("--otlp-traces-endpoint" in agent for agent in spec_of()), "none without the flag"


def test_with_the_project_s_connector_every_engine_shares_the_first_agent_s_pool_by_default() -> None:
    argvs = vllm_spec_of(
        "--prefill", "1", "--decode", "2", "--kv-connector", "vllm-disagg", "--kv-disk-dir", "/d"
    )
    ids = [argv[argv.index("--agent-id") + 1] for argv in argvs]
    nodes = {
        i: argv[argv.index("--kv-pool-node") + 1] if "--kv-pool-node" in argv else ""
        for i, argv in zip(ids, argvs, strict=True)
    }
    assert nodes == {"prefill-0": "", "decode-0": "prefill-0", "decode-1": "prefill-0"}
    disks = [argv[argv.index("--kv-disk-dir") + 1] for argv in argvs if "--kv-disk-dir" in argv]
    assert disks == ["/d/prefill-0"]  # one disk tier: the pool's
    per_agent = vllm_spec_of("--kv-connector", "vllm-disagg", "--kv-pool-scope", "agent")
    assert all("--kv-pool-node" not in argv for argv in per_agent)
