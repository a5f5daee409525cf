"""What an attached agent learns from a running vLLM, from the answers vLLM 0.32 gives (pure parsers)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from vllm_disagg.agent.discover import (
    DiscoveryError,
    EngineFacts,
    attached_instance_info,
    exposed_kv_event_sources,
    metric_labels,
    parse_kv_event_sources,
    parse_metrics,
    parse_models,
    parse_server_info,
    role_switch,
    warn_exposed_kv_events,
)
from vllm_disagg.config import AgentConfig

# The shape of vLLM 0.32's answers (docs/vllm-attach-facts.md), trimmed.
CACHE_INFO = (
    'vllm:cache_config_info{block_size="128",user_specified_block_size="True",cache_dtype="auto",'
    'enable_prefix_caching="True",prefix_caching_hash_algo="sha256",num_gpu_blocks="1820",'
    'kv_offloading_backend="native",sliding_window="None",engine="0"} 1.0'
)
NIXL = 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 0.0'
MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "root": "/models/tiny-seed0", "parent": None, "max_model_len": 512},
        {"id": "tiny-lora", "object": "model", "root": "/loras/a", "parent": "tiny", "max_model_len": None},
    ],
}


def test_models_give_the_served_names_the_model_as_typed_and_the_real_context_length() -> None:
    assert parse_models(MODELS) == (("tiny",), "/models/tiny-seed0", 512)


@pytest.mark.parametrize("body", [{"data": []}, {"object": "list"}, [], None, {"data": [{"id": 3}]}])
def test_models_that_list_no_base_model_are_an_error_not_a_guess(body: object) -> None:
    with pytest.raises(DiscoveryError, match="no model"):
        parse_models(body)


def test_cache_config_info_gives_the_engines_block_size_and_prefix_caching() -> None:
    exposition = (
        f"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n{CACHE_INFO}\n{NIXL}\n"
    )
    assert parse_metrics(exposition) == (128, True, "NixlConnector")
    labels = metric_labels(exposition, "vllm:cache_config_info")
    assert labels is not None and labels["num_gpu_blocks"] == "1820" and labels["engine"] == "0"


def test_without_nixl_series_there_is_no_known_connector_and_without_the_info_nothing_is_known() -> None:
    assert parse_metrics(CACHE_INFO.replace('"True"', '"False"')) == (128, False, "")
    assert parse_metrics('vllm:num_requests_running{engine="0"} 0.0\n') == (0, None, "")


def test_a_label_value_may_hold_escaped_quotes_and_commas() -> None:
    line = 'm{a="x,\\"y\\"",b="2"} 1'
    assert metric_labels(line, "m") == {"a": 'x,"y"', "b": "2"}


def test_dev_mode_server_info_gives_role_revision_tp_and_dtype() -> None:
    body = {
        "vllm_config": {
            "model_config": {"revision": "abc123", "dtype": "torch.bfloat16", "max_model_len": 8192},
            "cache_config": {"block_size": 16},
            "parallel_config": {"tensor_parallel_size": 2},
            "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
        }
    }
    assert parse_server_info(body) == {
        "revision": "abc123",
        "dtype": "torch.bfloat16",
        "max_model_len": 8192,
        "tensor_parallel_size": 2,
        "block_size": 16,
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
    }


def test_server_info_without_a_connector_or_with_odd_types_leaves_those_out() -> None:
    body = {"vllm_config": {"kv_transfer_config": None, "cache_config": {"block_size": True}}}
    assert parse_server_info(body) == {}
    assert parse_server_info({"vllm_config": "a text dump"}) == {}


@pytest.mark.parametrize(
    ("body", "endpoint"),
    [
        (
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:22229"}},
            "tcp://10.0.0.5:22229",
        ),
        (
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.9:5557"}},
            "tcp://10.0.0.9:5557",
        ),
        (
            {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///run/v/ev.sock"}},
            "ipc:///run/v/ev.sock",
        ),
        ({"0": {"enable_kv_cache_events": False, "publisher": "zmq", "endpoint": "tcp://*:1"}}, ""),
        ({"0": {"enable_kv_cache_events": True, "publisher": "null", "endpoint": "tcp://*:1"}}, ""),
        ({}, ""),
    ],
    ids=[
        "wildcard bind: the engine's host",
        "a host as given",
        "an ipc socket as given",
        "events off",
        "no zmq publisher",
        "none",
    ],
)
def test_kv_event_sources_say_where_to_subscribe(body: object, endpoint: str) -> None:
    assert parse_kv_event_sources(body, "10.0.0.5") == endpoint


def _source(endpoint: str, replay: str | None = None) -> dict[str, object]:
    return {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
        }
    }


@pytest.mark.parametrize(
    ("body", "exposed"),
    [
        pytest.param(_source("tcp://*:5557"), ("tcp://*:5557",), id="wildcard bind: every interface"),
        pytest.param(_source("tcp://0.0.0.0:5557"), ("tcp://0.0.0.0:5557",), id="0.0.0.0"),
        pytest.param(_source("tcp://10.0.0.9:5557"), ("tcp://10.0.0.9:5557",), id="sent to another host"),
        pytest.param(_source("ipc:///run/v/ev.sock"), (), id="ipc: this host only"),
        pytest.param(_source("tcp://127.0.0.1:5557"), (), id="loopback"),
        pytest.param(
            _source("ipc:///run/v/ev.sock", "tcp://*:5558"), ("tcp://*:5558",), id="a public replay socket"
        ),
        pytest.param({"0": {"enable_kv_cache_events": False, "endpoint": "tcp://*:1"}}, (), id="events off"),
    ],
)
def test_kv_event_sources_other_hosts_can_reach(body: object, exposed: tuple[str, ...]) -> None:
    assert exposed_kv_event_sources(body) == exposed


@pytest.mark.parametrize(
    ("subscribed", "said", "warned"),
    [
        pytest.param(
            "tcp://127.0.0.1:5557", ("tcp://*:5557",), "tcp://*:5557", id="bound on * though read on lo"
        ),
        pytest.param(
            "tcp://10.0.0.9:5557", (), "tcp://10.0.0.9:5557", id="an operator's non-loopback endpoint"
        ),
        pytest.param("ipc:///run/v/ev.sock", (), "", id="ipc: quiet"),
        pytest.param("tcp://127.0.0.1:5557", (), "", id="loopback: quiet"),
    ],
)
def test_an_attached_engine_publishing_beyond_its_host_is_warned_about(
    subscribed: str, said: tuple[str, ...], warned: str, caplog: pytest.LogCaptureFixture
) -> None:
    facts = EngineFacts(served_names=("tiny",), kv_events_exposed=said)
    with caplog.at_level(logging.WARNING, logger="vllm_disagg.agent.discover"):
        assert warn_exposed_kv_events(subscribed, facts) == ((warned,) if warned else ())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if warned:
        (message,) = warnings
        assert warned in message and "other hosts" in message and "ipc://" in message
    else:
        assert warnings == []


FACTS = EngineFacts(
    served_names=("tiny",),
    root="/models/tiny",
    max_model_len=512,
    block_size=128,
    kv_connector="NixlConnector",
)


def cfg(**overrides: object) -> AgentConfig:
    settings: dict[str, object] = dict(
        agent_id="p0", role="prefill", engine="vllm", model="tiny", attach_url="http://127.0.0.1:8000"
    )
    return AgentConfig(**{**settings, **overrides})  # type: ignore[arg-type]


def test_the_hello_carries_what_the_engine_said_not_the_agents_defaults() -> None:
    info, notes = attached_instance_info(
        cfg(), dataclasses.replace(FACTS, revision="r1", tensor_parallel_size=2)
    )
    assert (info.model, info.block_size, info.max_model_len, info.kv_connector) == (
        "tiny",
        128,
        512,
        "NixlConnector",
    )
    assert (info.revision, info.tensor_parallel_size, info.role, info.url) == (
        "r1",
        2,
        "prefill",
        "http://127.0.0.1:8000",
    )
    assert notes == []


def test_an_engine_whose_kv_role_cannot_serve_the_agents_role_is_refused() -> None:
    with pytest.raises(DiscoveryError, match="kv_consumer: it can serve as decode, not prefill"):
        attached_instance_info(cfg(), dataclasses.replace(FACTS, kv_role="kv_consumer"))
    info, _ = attached_instance_info(cfg(), dataclasses.replace(FACTS, kv_role="kv_both"))
    assert info.role == "prefill"


def test_a_model_name_the_engine_does_not_serve_is_replaced_by_the_one_it_does_and_said() -> None:
    info, notes = attached_instance_info(cfg(model="llama"), FACTS)
    assert info.model == "tiny"
    assert any("not 'llama'" in n for n in notes)


def test_an_unknown_block_size_falls_back_to_the_config_and_says_so() -> None:
    info, notes = attached_instance_info(cfg(), dataclasses.replace(FACTS, block_size=0))
    assert info.block_size == cfg().sim.block_size
    assert any("block size taken from the config" in n for n in notes)


def test_an_attached_simulator_says_no_connector_as_a_launched_one_does() -> None:
    info, _ = attached_instance_info(cfg(engine="sim", model="tiny"), FACTS)
    assert info.kv_connector == "" and info.engine == "sim"


@pytest.mark.parametrize(
    ("overrides", "facts", "role", "how", "why"),
    [
        (dict(engine="sim"), None, "decode", "live", ""),
        (dict(engine="sim", attach_url="", role_switch="restart"), None, "decode", "restart", "role_switch"),
        (dict(attach_url=""), None, "decode", "restart", "launched with kv_role kv_producer: it restarts"),
        (dict(attach_url="", role="both"), None, "decode", "live", ""),
        (
            dict(
                attach_url="",
                kv_connector="shared-storage",
                kv_connector_config='{"shared_storage_path": "/kv"}',
            ),
            None,
            "decode",
            "live",
            "",
        ),
        (dict(attach_url="", role="both", role_switch="restart"), None, "decode", "restart", "role_switch"),
        (dict(attach_url="", kv_connector=""), None, "decode", "refuse", "without a KV connector"),
        (
            dict(),
            dataclasses.replace(FACTS, kv_role="kv_producer"),
            "decode",
            "refuse",
            "it can serve as prefill, not decode",
        ),
        (dict(role_switch="restart"), dataclasses.replace(FACTS, kv_role="kv_both"), "decode", "live", ""),
        (dict(), FACTS, "decode", "live", ""),  # kv_role unknown (no dev mode): allowed
        (dict(), None, "prefill", "live", ""),  # the role it has
    ],
    ids=[
        "the simulator serves any role as it runs",
        "role_switch restart restarts even the simulator",
        "a launched producer restarts to decode",
        "a launched kv_both engine switches by routing",
        "a launched store connector's engine is kv_both in every role: by routing",
        "unless role_switch says restart",
        "a launched engine without a connector serves whole requests only",
        "an attached producer says it cannot decode: not ours to restart",
        "an attached kv_both engine can (role_switch is for launched engines)",
        "an attached engine that does not say is trusted",
        "no change",
    ],
)
def test_how_the_engine_can_take_a_new_role(
    overrides: dict[str, object], facts: EngineFacts | None, role: str, how: str, why: str
) -> None:
    switch = role_switch(cfg(**overrides), role, facts)  # type: ignore[arg-type]
    assert switch.how == how and (why in switch.why if why else switch.why == ""), switch
