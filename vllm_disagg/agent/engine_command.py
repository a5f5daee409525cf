"""What an engine kind is (``EngineCommand``: how to start it, what to tell the orchestrator) and the
simulated engine's kind; vLLM's is in ``vllm_command``, and ``engine_kinds`` picks one for an agent.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from vllm_disagg.agent.kv.local import local_dir
from vllm_disagg.config import AgentConfig, SimEngineConfig
from vllm_disagg.protocol.messages import VLLM_CAPABILITIES, InstanceInfo, KvLayout
from vllm_disagg.runtime import SELF_ARGV

KV_EVENTS_PORT_OFFSET = 2000  # the simulated engine publishes KV cache events on its port + 2000 unless told
_MAX_IPC_PATH = 100  # sun_path is 108 bytes with its NUL; keep a margin


def kv_events_port(cfg: AgentConfig) -> int:
    """The loopback port the simulated engine binds its KV cache event PUB socket on."""
    return cfg.kv_events_port or cfg.engine_port + KV_EVENTS_PORT_OFFSET


def kv_events_endpoint(cfg: AgentConfig) -> str:
    """Where a launched engine publishes its KV cache events, and its agent subscribes.

    The events carry every cached block's token ids (users' prompts) and only the agent on this host
    reads them, so no other host may reach them. vLLM binds a PUB socket only for ``tcp://*`` (every
    interface) or ``ipc://`` (a host name makes it connect instead), so it gets a socket file in the
    agent's 0700 runtime directory: only this user can even connect. The path holds the agent id and
    engine port (a port is this host's alone, so two agents never share it), or their hash where the
    path would be too long for a socket. The simulated engine binds loopback only.
    """
    if cfg.engine != "vllm":
        return f"tcp://127.0.0.1:{kv_events_port(cfg)}"
    name = f"{cfg.agent_id}-{cfg.engine_port}"
    path = local_dir() / f"events-{name}.sock"
    if len(str(path).encode()) > _MAX_IPC_PATH:
        path = path.with_name(f"events-{hashlib.sha256(name.encode()).hexdigest()[:24]}.sock")
    return f"ipc://{path}"


# --- engine kinds -------------------------------------------------------------------------------


class EngineCommand(ABC):
    """How to launch one kind of engine and what to tell the orchestrator about it."""

    kind: ClassVar[str]

    @abstractmethod
    def argv(self, cfg: AgentConfig) -> list[str]:
        """The engine's command line."""

    def prepare(self, cfg: AgentConfig) -> None:  # noqa: B027 (a hook: most kinds need nothing)
        """Make what the engine needs on this host before each launch (nothing by default)."""

    def env(self, cfg: AgentConfig) -> Mapping[str, str]:
        """Variables added to the agent's environment for the engine."""
        return {}

    def instance_info(self, cfg: AgentConfig) -> InstanceInfo:
        """The ``InstanceInfo`` the agent says Hello with."""
        return configured_instance_info(cfg)


def configured_instance_info(cfg: AgentConfig) -> InstanceInfo:
    """The engine as the config describes it (all an attached engine's agent knows about it)."""
    return InstanceInfo(
        url=cfg.engine_url, role=cfg.role, model=cfg.model, engine=cfg.engine, block_size=cfg.sim.block_size
    )


class SimEngineCommand(EngineCommand):
    """The simulated engine, run as ``vllm-disagg sim-engine`` by this interpreter."""

    kind = "sim"

    @staticmethod
    def engine_config(cfg: AgentConfig) -> SimEngineConfig:
        """The simulated engine's config for this agent: KV events on the port vLLM would use."""
        return SimEngineConfig(
            model=cfg.model,
            host=cfg.engine_host,
            port=cfg.engine_port,
            timing=cfg.sim,
            kv_events_port=kv_events_port(cfg),
            kv_load_failure_policy=cfg.kv_load_failure_policy or "fail",  # vLLM 0.32's default
            kv_lease_s=float(cfg.kv_lease_s or 30),  # vLLM's default
        )

    def argv(self, cfg: AgentConfig) -> list[str]:
        """``vllm-disagg sim-engine`` with the agent's model, port and timing."""
        from vllm_disagg.sim_engine.cli import sim_engine_argv  # the sim is only imported when launched

        return [*SELF_ARGV, "sim-engine", *sim_engine_argv(self.engine_config(cfg))]

    def instance_info(self, cfg: AgentConfig) -> InstanceInfo:
        """Block size and context length as the simulated engine will use them."""
        sim = self.engine_config(cfg)
        return InstanceInfo(
            url=cfg.engine_url,
            role=cfg.role,
            model=cfg.model,
            engine="sim",
            block_size=sim.timing.block_size,
            max_model_len=sim.max_model_len,
            capabilities=VLLM_CAPABILITIES,  # the simulator speaks vLLM 0.32
            layout=KvLayout(max_num_seqs=sim.timing.max_num_seqs),  # its batch; no layout to speak of
        )
