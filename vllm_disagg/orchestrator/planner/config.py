"""The planner's config: YAML (``--planner-config FILE``), every field checked before anything starts.

::

    apiVersion: vllm-disagg/v1alpha1
    kind: PlannerConfig
    dryRun: false          # true (the default): explain and suggest a P:D ratio, never move an instance
    ttftTargetS: 1.0       # TTFT p90 the prefill pool must keep (client-visible, disaggregated requests)
    tpotTargetS: 0.05      # TPOT p90 the decode pool must keep
    ...

Field names are the dataclass's in camelCase; an unknown one is an error naming it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import yaml

from vllm_disagg.errors import ConfigError

API_VERSION = "vllm-disagg/v1alpha1"
KIND = "PlannerConfig"


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Targets, bounds and pace of the planner (docs/planner.md)."""

    enabled: bool = True  # false: the planner does not look at all
    dry_run: bool = True  # explain and suggest only; an operator opts in to shifts
    interval_s: float = 5.0  # one look every
    window_s: float = 60.0  # the signals' window
    ttft_target_s: float = 1.0  # p90 of disaggregated requests' TTFT the prefill pool must keep
    tpot_target_s: float = 0.05  # p90 of streams' TPOT the decode pool must keep
    # A pool is short when its p90 is over ``overload`` x its target, and over the other pool's
    # pressure (p90 / target) by ``margin``: noise around the line moves nothing.
    overload: float = 1.0
    margin: float = 0.25
    sustain: int = 3  # looks in a row the same pool must be short before an instance moves
    cooldown_s: float = 60.0  # after a shift (the planner's or an operator's), none for this long
    min_prefill: int = 1
    min_decode: int = 1
    min_samples: int = 20  # requests in the window below which a pool is not judged
    # No move that would leave the giving pool's mean KV cache usage above this (the same use over one
    # instance fewer): its instances would turn requests away (the scheduler's kv-usage-filter, 0.95).
    kv_usage_ceiling: float = 0.8
    source: str = "<default>"

    def __post_init__(self) -> None:
        for name in ("interval_s", "window_s", "ttft_target_s", "tpot_target_s", "overload"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ConfigError(f"planner {_camel(name)}: a number > 0, got {value!r}")
        if not (isinstance(self.kv_usage_ceiling, int | float) and 0 < self.kv_usage_ceiling <= 1):
            raise ConfigError(f"planner kvUsageCeiling: a number in (0, 1], got {self.kv_usage_ceiling!r}")
        for name in ("margin", "cooldown_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                raise ConfigError(f"planner {_camel(name)}: a number >= 0, got {value!r}")
        for name in ("sustain", "min_prefill", "min_decode", "min_samples"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (1 if name == "sustain" else 0)
            ):
                raise ConfigError(
                    f"planner {_camel(name)}: an integer >= {int(name == 'sustain')}, got {value!r}"
                )

    def to_json(self) -> dict[str, Any]:
        """The config as its YAML names it."""
        return {_camel(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() if part != "s" else "S" for part in rest)


_FIELDS = {_camel(f.name): f for f in dataclasses.fields(PlannerConfig) if f.name != "source"}


def load_planner_config(text: str, source: str) -> PlannerConfig:
    """Parse and check a planner config; ``ConfigError`` naming the field otherwise."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a planner config is a mapping")
    if raw.get("apiVersion", API_VERSION) != API_VERSION or raw.get("kind", KIND) != KIND:
        raise ConfigError(f"{source}: expected apiVersion {API_VERSION} and kind {KIND}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("apiVersion", "kind"):
            continue
        field = _FIELDS.get(key)
        if field is None:
            raise ConfigError(f"{source}: unknown planner field {key!r} (fields: {sorted(_FIELDS)})")
        if field.type == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{source}: planner {key}: true or false, got {value!r}")
        values[field.name] = value
    try:
        return PlannerConfig(**values, source=source)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_planner_config_file(path: str) -> PlannerConfig:
    """``load_planner_config`` on a file (empty path: the defaults)."""
    if not path:
        return PlannerConfig()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the planner config {path!r}: {exc.strerror}") from None
    return load_planner_config(text, path)
