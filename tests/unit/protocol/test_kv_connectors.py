"""The KV connectors ``--kv-connector`` takes: what each is called, how the gateway hands a request
over with it, and the settings it refuses."""

from __future__ import annotations

import pytest

from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.kv_connectors import (
    CONNECTORS,
    check_kv_settings,
    connector_names,
    extra_config,
    handoff_of,
    reported_connector,
    resolve,
)

HANDOFFS = [
    ("nixl", "NixlConnector", "params"),
    ("mooncake", "MooncakeConnector", "params"),
    ("vllm-disagg", "VllmDisaggConnector", "pool"),
    ("shared-storage", "ExampleConnector", "store"),
    ("lmcache", "LMCacheConnectorV1", "store"),
    ("mooncake-store", "MooncakeStoreConnector", "store"),
    ("offloading", "OffloadingConnector", "local"),
    ("cpu-offload", "SimpleCPUOffloadConnector", "local"),
]


@pytest.mark.parametrize(("name", "vllm_class", "handoff"), HANDOFFS)
def test_a_connector_is_known_by_our_name_and_by_vllm_s(name: str, vllm_class: str, handoff: str) -> None:
    assert resolve(name) is resolve(vllm_class)
    assert (resolve(name).vllm_class, resolve(name).handoff) == (vllm_class, handoff)
    assert reported_connector(name) == (name if name == "vllm-disagg" else vllm_class)
    assert handoff_of(reported_connector(name)) == handoff


def test_every_connector_says_what_running_it_here_gave() -> None:
    assert {spec.name for spec in CONNECTORS} == {name for name, _, _ in HANDOFFS}
    assert all(spec.here for spec in CONNECTORS)
    assert set(connector_names()) == {n for name, cls, _ in HANDOFFS for n in (name, cls)}


def test_a_connector_this_table_does_not_know_passes_through_with_nixl_s_handoff() -> None:
    spec = resolve("FlexKVConnectorV1")
    assert (spec.vllm_class, spec.handoff) == ("FlexKVConnectorV1", "params")
    assert reported_connector("FlexKVConnectorV1") == "FlexKVConnectorV1"
    assert handoff_of("") is None and reported_connector("") == ""


def test_the_operator_s_settings_go_over_the_connector_s_defaults() -> None:
    spec = resolve("shared-storage")
    assert extra_config(spec, '{"shared_storage_path": "/kv", "x": 1}') == {
        "shared_storage_path": "/kv",
        "x": 1,
    }
    assert extra_config(spec, "") == {}


REFUSED = [
    ("both", "shared-storage", "", "needs \\['shared_storage_path'\\]"),
    ("decode", "offloading", "", "role must be 'both'"),
    ("prefill", "cpu-offload", "", "role must be 'both'"),
    ("both", "nixl", "{not json", "not JSON"),
    ("both", "nixl", "[1, 2]", "must be a JSON object"),
]


@pytest.mark.parametrize(("role", "connector", "settings", "why"), REFUSED)
def test_settings_that_cannot_work_are_refused_before_anything_starts(
    role: str, connector: str, settings: str, why: str
) -> None:
    with pytest.raises(ConfigError, match=why):
        check_kv_settings(role, connector, settings, "", 0)


def test_settings_that_work_pass() -> None:
    check_kv_settings("decode", "shared-storage", '{"shared_storage_path": "/kv"}', "recompute", 30)
    check_kv_settings("both", "offloading", "", "", 0)
    check_kv_settings("prefill", "", "", "", 0)
