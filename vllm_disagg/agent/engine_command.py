"""What an engine kind is (``EngineCommand``: how to start it, what to tell the orchestrator) and the
simulated engine's kind; vLLM's is in ``vllm_command``, and ``engine_kinds`` picks one for an agent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from vllm_disagg.config import AgentConfig, SimEngineConfig
from vllm_disagg.protocol.messages import VLLM_CAPABILITIES, InstanceInfo, KvLayout
from vllm_disagg.runtime import SELF_ARGV

KV_EVENTS_PORT_OFFSET = 2000  # an engine publishes KV cache events on its port + 2000 unless told


def kv_events_port(cfg: AgentConfig) -> int:
    """The port the engine binds its KV cache event PUB socket on (vLLM and the simulated engine alike)."""
    return cfg.kv_events_port or cfg.engine_port + KV_EVENTS_PORT_OFFSET


def kv_events_endpoint(cfg: AgentConfig) -> str:
    """Where a subscriber connects to hear this engine's KV cache events."""
    return f"tcp://{cfg.engine_host}:{kv_events_port(cfg)}"


# --- engine kinds -------------------------------------------------------------------------------


class EngineCommand(ABC):
    """How to launch one kind of engine and what to tell the orchestrator about it."""

    kind: ClassVar[str]

    @abstractmethod
    def argv(self, cfg: AgentConfig) -> list[str]:
        """The engine's command line."""

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
