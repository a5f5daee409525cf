"""The KV connectors an instance can run (``--kv-connector``), and what each asks of the cluster.

``--kv-connector`` takes a name below, or vLLM's class name for it, or any other connector vLLM
registers (passed through as it is, with NIXL's handoff). ``--kv-connector-config`` (a JSON object)
is merged over the connector's defaults into vLLM's ``kv_connector_extra_config``. What differs
between connectors, for the rest of the project:

- **handoff**, what the gateway sends between a prefill leg and a decode leg:

  * ``params``: vLLM's P/D handoff (NIXL, Mooncake). The prefill leg asks its engine to keep the KV
    (``kv_transfer_params.do_remote_decode``), the engine answers where the blocks wait, and the
    decode leg carries that answer; the decode engine pulls them.
  * ``store``: the connector writes each prompt's KV into a store every engine of the model reads
    (vLLM's example connector's shared directory, LMCache, Mooncake's store). The prefill leg runs
    the prompt, the decode leg runs the same body without ``kv_transfer_params``, and the decode
    engine finds the prompt in the store.
  * ``pool``: the project's own connector (docs/kv-pool.md).
  * ``local``: a tier under one engine (the offloading connectors: host memory or storage of that
    engine alone). KV never crosses instances: such instances serve whole requests (role ``both``)
    and are never paired.

- **kv_role**: producer and consumer by role for ``params``; ``kv_both`` for the others (each engine
  saves what it computes and loads what the store holds, whatever its role).
- **events**: what the connector publishes besides the engine's prefix cache. Blocks of a connector's
  host-memory tier (vLLM's ``medium`` ``CPU``) are indexed as the instance's pool, and of its storage
  tier (any other medium) as its disk tier: the engine loads them on a hit, so routing counts them.
- **here**: whether it ran on this project's CPU machines, and if not, the error (docs/kv-pool.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_disagg.errors import ConfigError

Handoff = Literal["params", "store", "pool", "local"]
POOL = "vllm-disagg"  # the project's own connector: ``InstanceInfo.kv_connector`` says this name


@dataclass(frozen=True, slots=True)
class ConnectorSpec:
    name: str  # what operators type
    vllm_class: str  # the class vLLM's factory registers (what an instance reports)
    handoff: Handoff
    here: str  # what running it on this project's CPU machines gave
    events: str = "none besides the engine's prefix cache"
    required: tuple[str, ...] = ()  # kv_connector_extra_config keys the operator must set
    defaults: Mapping[str, Any] = field(default_factory=dict)


CONNECTORS: tuple[ConnectorSpec, ...] = (
    ConnectorSpec("nixl", "NixlConnector", "params", "runs: NIXL over UCX between host buffers"),
    ConnectorSpec(
        POOL, "VllmDisaggConnector", "pool", "runs", events="its agent's pool and disk tier (docs/kv-pool.md)"
    ),
    ConnectorSpec(
        "shared-storage",
        "ExampleConnector",
        "store",
        "runs: P/D through a shared directory (tests/e2e/vllm/test_real_vllm_store_connector.py)",
        # vLLM's default is /tmp, where every user of the host could read prompts' KV.
        required=("shared_storage_path",),
    ),
    ConnectorSpec(
        "lmcache",
        "LMCacheConnectorV1",
        "store",
        "not run: the lmcache package is not installed (ModuleNotFoundError: No module named 'lmcache'); "
        "LMCache builds CUDA kernels",
        events="its cache's blocks (vLLM's connector KV events)",
    ),
    ConnectorSpec(
        "mooncake",
        "MooncakeConnector",
        "params",
        "not run: vLLM refuses at import: 'Please install mooncake by following the instructions at "
        "https://github.com/kvcache-ai/Mooncake/blob/main/doc/en/build.md'",
    ),
    ConnectorSpec(
        "mooncake-store",
        "MooncakeStoreConnector",
        "store",
        "not run: needs the mooncake package (not installed) and a Mooncake master",
    ),
    ConnectorSpec(
        "offloading",
        "OffloadingConnector",
        "local",
        "refused on CPU by vLLM: 'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs'",
        events="its CPU and STORAGE tiers' blocks",
    ),
    ConnectorSpec(
        "cpu-offload",
        "SimpleCPUOffloadConnector",
        "local",
        "fails at start on the CPU build: '_StreamPlaceholder' object has no attribute 'priority_range'",
    ),
)
_BY_NAME = {spec.name: spec for spec in CONNECTORS} | {spec.vllm_class: spec for spec in CONNECTORS}


def resolve(name: str) -> ConnectorSpec:
    """The connector ``name`` (ours or vLLM's class name) stands for; another name passes through
    with NIXL's handoff (a connector this table does not know: vLLM says whether it exists)."""
    known = _BY_NAME.get(name)
    if known is not None:
        return known
    return ConnectorSpec(name, name, "params", "not known to vllm-disagg: passed to vLLM as it is")


def connector_names() -> list[str]:
    """Every name ``--kv-connector`` knows: ours, then vLLM's class names."""
    return [spec.name for spec in CONNECTORS] + [spec.vllm_class for spec in CONNECTORS]


def reported_connector(name: str) -> str:
    """What an instance running ``name`` reports (``InstanceInfo.kv_connector``): vLLM's class name,
    as an attached engine's configuration says it, so launched and attached instances pair alike;
    the project's own connector by its name; "" for none."""
    return name if name in ("", POOL) else resolve(name).vllm_class


def handoff_of(kv_connector: str) -> Handoff | None:
    """How the gateway hands a request from P to D for instances reporting ``kv_connector``; None:
    no connector (a plain engine serves whole requests)."""
    return resolve(kv_connector).handoff if kv_connector else None


def extra_config(spec: ConnectorSpec, settings: str) -> dict[str, Any]:
    """``kv_connector_extra_config``: the connector's defaults under the operator's JSON object."""
    return {**spec.defaults, **parse_settings(settings)}


def parse_settings(settings: str) -> dict[str, Any]:
    if not settings:
        return {}
    try:
        parsed = json.loads(settings)
    except ValueError as e:
        raise ConfigError(f"agent.kv_connector_config is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(
            "agent.kv_connector_config must be a JSON object (vLLM's kv_connector_extra_config)"
        )
    return parsed


def check_kv_settings(role: str, connector: str, settings: str, failure_policy: str, lease_s: int) -> None:
    """``ConfigError`` for KV settings that cannot work (an agent's, before anything starts)."""
    parsed = parse_settings(settings)
    if connector:
        spec = resolve(connector)
        missing = [key for key in spec.required if key not in parsed]
        if missing:
            raise ConfigError(
                f"agent.kv_connector {spec.name} needs {missing} in kv_connector_config "
                f'(e.g. --kv-connector-config \'{{"{missing[0]}": "/var/lib/kv"}}\')'
            )
        if spec.handoff == "local" and role != "both":
            raise ConfigError(
                f"agent.kv_connector {spec.name} keeps KV under its own engine, so the instance serves "
                f"whole requests: its role must be 'both', got {role!r}"
            )
    if failure_policy not in ("", "fail", "recompute"):
        raise ConfigError(
            "agent.kv_load_failure_policy must be 'fail', 'recompute' or empty (vLLM's default), "
            f"got {failure_policy!r}"
        )
    if lease_s < 0:
        raise ConfigError(f"agent.kv_lease_s must be >= 0 (0: the default), got {lease_s}")
