"""The scheduler's YAML config: which plugins exist, with what parameters, and how profiles use them.

Shaped like the Gateway API Inference Extension's ``EndpointPickerConfig`` so llm-d users read it at
sight::

    apiVersion: vllm-disagg/v1alpha1
    kind: SchedulerConfig
    plugins:                       # every plugin instance: a type, an optional name, parameters
      - type: kv-usage-filter
        parameters: {ceiling: 0.9}
      - {type: queue-scorer, name: queue}
      ...
    profiles:                      # exactly "decode" and "prefill"
      - name: decode
        maxCandidates: 16          # optional: score at most this many (prefix holders first)
        plugins:                   # filters in order, scorers with a weight, exactly one picker
          - pluginRef: kv-usage-filter
          - {pluginRef: queue, weight: 2}
          - pluginRef: max-score-picker
      - name: prefill
        plugins: [...]
    decider: uncached-tokens-decider
    pairing: transfer-pairing      # optional: P and D chosen together, counting the KV transfer
    shards: {key: domain, size: 0, fanout: 2, above: 256}   # optional: a shard first (shards.py)
    ranked: true                   # optional: the flat pick from the holders and a ranked walk (ranked.py)

Everything is checked by ``load_config`` before anything starts; every error names where it is
(``plugins[3].parameters.ceiling: ...``). The default, ``default.yaml`` beside this module, ships
with the package.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.scheduling.framework import PROFILE_NAMES, AnyPlugin, PluginSpec, ProfileName
from vllm_disagg.orchestrator.scheduling.shards import ShardConfig

API_VERSION = "vllm-disagg/v1alpha1"
KIND = "SchedulerConfig"
DEFAULT_MAX_CANDIDATES = 16
# A profile must hold this filter: without it P and D that cannot exchange KV could be paired.
REQUIRED_FILTER = "kv-compat-filter"


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """One plugin instance: its name, its type, and its validated parameters object."""

    name: str
    type: str
    params: Any


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    """A profile's filters (in order), scorers with weights, and picker, by plugin name."""

    name: ProfileName
    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]
    picker: str
    max_candidates: int = DEFAULT_MAX_CANDIDATES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The whole validated config."""

    plugins: Mapping[str, PluginConfig]
    profiles: Mapping[ProfileName, ProfileConfig]
    decider: str
    source: str = "<default>"
    pairing: str | None = None  # a pairing plugin's name; None: the profiles' picks stand
    shards: ShardConfig | None = None  # hierarchical choice past ``above`` instances; None: flat
    ranked: bool = False  # past ``maxCandidates``, the flat pick from a ranked walk where it can serve


def _snake(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower()


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _want(value: object, kind: type, where: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _params(spec: PluginSpec, raw: object, where: str) -> Any:
    return _dataclass(spec.params, spec.type, raw, where)


def _dataclass(cls: type[Any], what: str, raw: object, where: str) -> Any:
    """``cls`` from a mapping of camelCase keys, each value checked against its field's type."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of parameters, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = _snake(str(key))
        if name not in fields:
            known = ", ".join(_camel(f) for f in sorted(fields)) or "none"
            raise ConfigError(f"{where}.{key}: unknown parameter of {what} (known: {known})")
        kind = hints.get(name)
        kwargs[name] = _want(value, kind, f"{where}.{key}") if isinstance(kind, type) else value
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a non-empty list")
    return value


def _only(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(raw) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _plugins(raw: object, specs: Mapping[str, PluginSpec]) -> dict[str, PluginConfig]:
    out: dict[str, PluginConfig] = {}
    for i, item in enumerate(_list(raw, "plugins")):
        where = f"plugins[{i}]"
        entry = _mapping(item, where)
        _only(entry, {"type", "name", "parameters"}, where)
        kind = entry.get("type")
        if not isinstance(kind, str) or kind not in specs:
            raise ConfigError(
                f"{where}.type: unknown plugin type {kind!r} (known: {', '.join(sorted(specs))})"
            )
        name = entry.get("name", kind)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: expected a non-empty string")
        if name in out:
            raise ConfigError(f"{where}.name: the name {name!r} is used twice; give one of them a name")
        out[name] = PluginConfig(
            name, kind, _params(specs[kind], entry.get("parameters"), f"{where}.parameters")
        )
    return out


def _profile(
    i: int, raw: object, plugins: Mapping[str, PluginConfig], specs: Mapping[str, PluginSpec]
) -> ProfileConfig:
    where = f"profiles[{i}]"
    entry = _mapping(raw, where)
    _only(entry, {"name", "plugins", "maxCandidates"}, where)
    name = entry.get("name")
    if name not in PROFILE_NAMES:
        raise ConfigError(f"{where}.name: expected one of {list(PROFILE_NAMES)}, got {name!r}")
    max_candidates = _want(entry.get("maxCandidates", DEFAULT_MAX_CANDIDATES), int, f"{where}.maxCandidates")
    if max_candidates < 2:
        raise ConfigError(f"{where}.maxCandidates: must be >= 2, got {max_candidates}")
    filters: list[str] = []
    scorers: list[tuple[str, float]] = []
    pickers: list[str] = []
    for j, item in enumerate(_list(entry.get("plugins"), f"{where}.plugins")):
        at = f"{where}.plugins[{j}]"
        ref_entry = _mapping(item, at)
        _only(ref_entry, {"pluginRef", "weight"}, at)
        ref = ref_entry.get("pluginRef")
        if not isinstance(ref, str) or ref not in plugins:
            raise ConfigError(f"{at}.pluginRef: no plugin named {ref!r} in 'plugins'")
        kind = specs[plugins[ref].type].kind
        if "weight" in ref_entry and kind != "scorer":
            raise ConfigError(f"{at}.weight: only scorers take a weight ({ref!r} is a {kind})")
        if kind == "filter":
            filters.append(ref)
        elif kind == "scorer":
            weight = _want(ref_entry.get("weight", 1.0), float, f"{at}.weight")
            if not weight >= 0:  # 0: listed but off (not run nor shown), for the admin API to set
                raise ConfigError(f"{at}.weight: must be >= 0, got {weight}")
            scorers.append((ref, weight))
        elif kind == "picker":
            pickers.append(ref)
        else:
            raise ConfigError(f"{at}: a {kind} cannot be part of a profile; name it in '{kind}'")
    if len(pickers) != 1:
        raise ConfigError(f"{where}: a profile needs exactly one picker, got {len(pickers)}")
    if not any(plugins[f].type == REQUIRED_FILTER for f in filters):
        raise ConfigError(
            f"{where}: the {name} profile must use a {REQUIRED_FILTER} "
            "(without it instances that cannot exchange KV could be paired)"
        )
    return ProfileConfig(name, tuple(filters), tuple(scorers), pickers[0], max_candidates)


def _pairing(
    name: object, plugins: Mapping[str, PluginConfig], specs: Mapping[str, PluginSpec]
) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or name not in plugins:
        raise ConfigError(f"pairing: no plugin named {name!r} in 'plugins'")
    kind = specs[plugins[name].type].kind
    if kind != "pairing":
        raise ConfigError(f"pairing: {name!r} is a {kind}, not a pairing")
    return name


def load_config(text: str, source: str, specs: Mapping[str, PluginSpec] | None = None) -> SchedulerConfig:
    """Parse and validate a config; ``ConfigError`` naming the first problem and where it is."""
    if specs is None:
        from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS

        specs = PLUGIN_SPECS
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    try:
        doc = _mapping(raw, "the document")
        _only(
            doc,
            {"apiVersion", "kind", "plugins", "profiles", "decider", "pairing", "shards", "ranked"},
            "the document",
        )
        if doc.get("apiVersion") != API_VERSION:
            raise ConfigError(f"apiVersion: expected {API_VERSION!r}, got {doc.get('apiVersion')!r}")
        if doc.get("kind") != KIND:
            raise ConfigError(f"kind: expected {KIND!r}, got {doc.get('kind')!r}")
        plugins = _plugins(doc.get("plugins"), specs)
        profiles: dict[ProfileName, ProfileConfig] = {}
        for i, item in enumerate(_list(doc.get("profiles"), "profiles")):
            profile = _profile(i, item, plugins, specs)
            if profile.name in profiles:
                raise ConfigError(f"profiles[{i}].name: the {profile.name} profile is defined twice")
            profiles[profile.name] = profile
        missing = [p for p in PROFILE_NAMES if p not in profiles]
        if missing:
            raise ConfigError(f"profiles: the {missing[0]} profile is missing (need {list(PROFILE_NAMES)})")
        decider = doc.get("decider")
        if not isinstance(decider, str) or decider not in plugins:
            raise ConfigError(f"decider: no plugin named {decider!r} in 'plugins'")
        if specs[plugins[decider].type].kind != "decider":
            raise ConfigError(f"decider: {decider!r} is a {specs[plugins[decider].type].kind}, not a decider")
        pairing = _pairing(doc.get("pairing"), plugins, specs)
        shards = _dataclass(ShardConfig, "shards", doc["shards"], "shards") if "shards" in doc else None
        ranked = _want(doc.get("ranked", False), bool, "ranked")
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return SchedulerConfig(plugins, profiles, decider, source, pairing, shards, ranked)


def load_config_file(path: str) -> SchedulerConfig:
    """``load_config`` on a file; an unreadable file is a ``ConfigError`` too."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the scheduler config {path!r}: {exc.strerror}") from None
    return load_config(text, path)


def default_config_text() -> str:
    """The shipped default config (``default.yaml``)."""
    return resources.files(__package__).joinpath("default.yaml").read_text(encoding="utf-8")


def default_config() -> SchedulerConfig:
    """The shipped default, validated."""
    return load_config(default_config_text(), "default.yaml")


def load_scheduler_config(orchestrator: OrchestratorConfig) -> SchedulerConfig:
    """The orchestrator's scheduler config: its ``scheduler_config`` file, or the shipped default."""
    path = orchestrator.scheduler_config
    return load_config_file(path) if path else default_config()


def build_plugins(
    config: SchedulerConfig, specs: Mapping[str, PluginSpec] | None = None
) -> dict[str, AnyPlugin]:
    """Every configured plugin, built, by name."""
    if specs is None:
        from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS

        specs = PLUGIN_SPECS
    return {name: specs[p.type].factory(name, p.params) for name, p in config.plugins.items()}
