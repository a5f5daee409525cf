"""The engine kinds an agent can launch, and what an agent says about its engine whatever the kind."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

from vllm_disagg.agent.engine_command import EngineCommand, SimEngineCommand, configured_instance_info
from vllm_disagg.agent.vllm_command import VllmEngineCommand
from vllm_disagg.config import AgentConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import InstanceInfo

ENGINE_COMMANDS: Mapping[str, Callable[[], EngineCommand]] = {
    SimEngineCommand.kind: SimEngineCommand,
    VllmEngineCommand.kind: VllmEngineCommand,
}


def engine_command(cfg: AgentConfig) -> EngineCommand | None:
    """The launcher for ``cfg.engine``; None in attach mode. ``ConfigError`` if it cannot be launched."""
    if cfg.attach_url:
        return None
    factory = ENGINE_COMMANDS.get(cfg.engine)
    if factory is None:
        raise ConfigError(
            f"agent.engine {cfg.engine!r} cannot be launched by the agent yet "
            f"(launchable: {sorted(ENGINE_COMMANDS)}); start it yourself and pass --attach URL"
        )
    return factory()


def tokenizer_source(cfg: AgentConfig) -> str:
    """Where the orchestrator can load the engine's tokenizer: vLLM's weights directory (absolute when
    it is one here, else as given, e.g. a hub id); "" for the simulated engine, whose tokens are bytes.
    """
    if cfg.engine != "vllm" or not cfg.model_path:
        return ""
    return os.path.abspath(cfg.model_path) if os.path.isdir(cfg.model_path) else cfg.model_path


def instance_info(cfg: AgentConfig) -> InstanceInfo:
    """What the agent tells the orchestrator about its engine."""
    command = engine_command(cfg)
    info = command.instance_info(cfg) if command is not None else configured_instance_info(cfg)
    return dataclasses.replace(info, tokenizer=tokenizer_source(cfg), labels=dict(cfg.labels))
