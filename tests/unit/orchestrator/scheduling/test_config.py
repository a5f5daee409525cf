"""The scheduler's YAML config: the shipped default loads, and every mistake is named with its place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.scheduling.config import (
    default_config,
    default_config_text,
    load_config,
    load_config_file,
)
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler


def test_the_shipped_default_is_valid_and_builds() -> None:
    config = default_config()
    assert set(config.profiles) == {"decode", "prefill"}
    prefill = config.profiles["prefill"]
    assert prefill.picker == "max-score-picker"
    assert dict(prefill.scorers)["prefix-scorer"] == 2.0
    assert config.plugins["kv-usage-filter"].params.ceiling == 0.95
    assert PluginScheduler(config).config is config


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(default_config_text())
    assert isinstance(doc, dict)
    return doc


def _edit(path: str, value: object) -> str:
    """The default config with one value replaced; ``path`` is dotted, list indexes as numbers."""
    doc = _doc()
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is DELETE:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return yaml.safe_dump(doc)


DELETE = object()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("a: [", "not valid YAML", id="not-yaml"),
        pytest.param("- 1\n- 2\n", "expected a mapping", id="not-a-mapping"),
        pytest.param(
            _edit("apiVersion", "v9"),
            "apiVersion: expected 'vllm-disagg/v1alpha1', got 'v9'",
            id="wrong-api-version",
        ),
        pytest.param(_edit("kind", "Other"), "kind: expected 'SchedulerConfig'", id="wrong-kind"),
        pytest.param(_edit("extra", 1), "unknown key 'extra'", id="unknown-top-level-key"),
        pytest.param(
            _edit("plugins.0.type", "magic-filter"),
            "plugins[0].type: unknown plugin type 'magic-filter'",
            id="unknown-type",
        ),
        pytest.param(
            _edit("plugins.1.type", "role-filter"),
            "the name 'role-filter' is used twice",
            id="duplicate-name",
        ),
        pytest.param(
            _edit("plugins.3.parameters", {"ceil": 0.5}),
            "plugins[3].parameters.ceil: unknown parameter of kv-usage-filter (known: ceiling)",
            id="unknown-parameter",
        ),
        pytest.param(
            _edit("plugins.3.parameters", {"ceiling": 1.5}),
            "plugins[3].parameters",
            id="parameter-out-of-range",
        ),
        pytest.param(
            _edit("plugins.3.parameters", {"ceiling": "high"}),
            "expected float, got str",
            id="parameter-of-wrong-type",
        ),
        pytest.param(
            _edit("plugins.3.parameters", [1]),
            "expected a mapping of parameters",
            id="parameters-not-a-mapping",
        ),
        pytest.param(_edit("profiles.1", DELETE), "the prefill profile is missing", id="missing-profile"),
        pytest.param(
            _edit("profiles.1.name", "decode"), "the decode profile is defined twice", id="duplicate-profile"
        ),
        pytest.param(
            _edit("profiles.0.name", "middle"), "profiles[0].name: expected one of", id="unknown-profile"
        ),
        pytest.param(
            _edit("profiles.0.plugins.11", DELETE),
            "a profile needs exactly one picker, got 0",
            id="no-picker",
        ),
        pytest.param(
            _edit("profiles.0.plugins.0", {"pluginRef": "max-score-picker"}),
            "exactly one picker, got 2",
            id="two-pickers",
        ),
        pytest.param(
            _edit("profiles.0.plugins.2", {"pluginRef": "role-filter"}),
            "must use a kv-compat-filter",
            id="no-compat-filter",
        ),
        pytest.param(
            _edit("profiles.0.plugins.0", {"pluginRef": "nope"}),
            "profiles[0].plugins[0].pluginRef: no plugin named 'nope'",
            id="unknown-ref",
        ),
        pytest.param(
            _edit("profiles.0.plugins.0", {"pluginRef": "role-filter", "weight": 2}),
            "only scorers take a weight",
            id="weight-on-filter",
        ),
        pytest.param(
            _edit("profiles.0.plugins.5", {"pluginRef": "queue-scorer", "weight": -1}),
            "weight: must be >= 0",
            id="negative-weight",
        ),
        pytest.param(
            _edit("profiles.0.plugins.5", {"pluginRef": "queue-scorer", "weight": "heavy"}),
            "expected float",
            id="weight-not-a-number",
        ),
        pytest.param(
            _edit("profiles.0.plugins.5", {"pluginRef": "kv-pool-decider"}),
            "a decider cannot be part of a profile",
            id="decider-in-profile",
        ),
        pytest.param(
            _edit("profiles.0.maxCandidates", 1), "maxCandidates: must be >= 2", id="too-few-candidates"
        ),
        pytest.param(
            _edit("decider", "max-score-picker"),
            "'max-score-picker' is a picker, not a decider",
            id="decider-not-a-decider",
        ),
        pytest.param(_edit("decider", DELETE), "decider: no plugin named None", id="no-decider"),
    ],
)
def test_a_bad_config_is_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(text, "my.yaml")
    assert str(info.value).startswith("my.yaml: ")
    assert message in str(info.value)


def test_parameters_may_be_camel_or_snake_case() -> None:
    camel = load_config(_edit("plugins.6.parameters", {"maxQueue": 8}), "t")
    snake = load_config(_edit("plugins.6.parameters", {"max_queue": 8}), "t")
    assert camel.plugins["queue-scorer"].params == snake.plugins["queue-scorer"].params
    assert camel.plugins["queue-scorer"].params.max_queue == 8.0


def test_a_named_plugin_instance_can_be_used_twice_with_other_parameters(tmp_path: Path) -> None:
    doc = _doc()
    doc["plugins"].append({"type": "kv-usage-filter", "name": "strict-kv", "parameters": {"ceiling": 0.5}})
    doc["profiles"][1]["plugins"][3] = {"pluginRef": "strict-kv"}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    config = load_config_file(str(path))
    assert config.profiles["prefill"].filters[3] == "strict-kv"
    assert config.plugins["strict-kv"].params.ceiling == 0.5
    assert config.source == str(path)


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the scheduler config"):
        load_config_file(str(tmp_path / "missing.yaml"))
