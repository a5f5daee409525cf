"""``vllm-disagg connect``: put a vLLM that is already running under the orchestrator, in one command.

It asks the engine what it is first (served model, block size, context length, KV connector, and with
``VLLM_SERVER_DEV_MODE=1`` its ``kv_role``; see ``discover``), says so in one line, and then runs an
agent attached to it in the foreground (the same agent as ``vllm-disagg agent --attach``). What cannot
work is refused before anything registers: an engine that does not answer, a role its ``kv_role``
forbids, a role that cannot be told (a connector, no dev mode, no ``--role``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp

from vllm_disagg import logs
from vllm_disagg.agent import main as agent_main
from vllm_disagg.agent.discover import DiscoveryError, EngineFacts, check_role, discover
from vllm_disagg.agent.labels import add_label_arguments, labels_from_args
from vllm_disagg.config import AgentConfig
from vllm_disagg.protocol.messages import ROLES, Role, default_agent_id

EXIT_CANNOT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg connect``."""
    parser.add_argument(
        "--orchestrator", required=True, help="the orchestrator's agent endpoint (tcp://HOST:PORT)"
    )
    parser.add_argument("--url", required=True, help="the running vLLM's base URL, e.g. http://host:8000")
    parser.add_argument("--role", choices=ROLES, help="prefill, decode or both (default: from its kv_role)")
    parser.add_argument("--agent-id", default="", help="the instance's id (default: ROLE-HOST-PORT)")
    parser.add_argument("--model", default="", help="served name to register (default: the engine's first)")
    parser.add_argument("--kv-events-endpoint", default="", help="its KV-events PUB (default: what it says)")
    parser.add_argument("--curve-secret-key", default="", help="this agent's .key_secret (vllm-disagg keys)")
    parser.add_argument("--orchestrator-key", default="", help="the orchestrator's public .key file")
    parser.add_argument("--discover-timeout-s", type=float, default=10.0, help="each question to the engine")
    add_label_arguments(parser)
    logs.add_arguments(parser)


def choose_role(given: Role | None, facts: EngineFacts) -> Role:
    """The role to register with (``DiscoveryError`` when it cannot be told or is forbidden)."""
    if given is not None:
        check_role(given, facts)
        return given
    if facts.role is not None:
        return facts.role
    if not facts.kv_connector:
        return "both"  # no connector: it can only serve whole requests
    raise DiscoveryError(
        f"the engine has the KV connector {facts.kv_connector} but does not say its kv_role (start it with "
        "VLLM_SERVER_DEV_MODE=1, or pass --role prefill|decode)"
    )


def config_for(args: argparse.Namespace, facts: EngineFacts) -> AgentConfig:
    """The attached agent's config, from the flags and what the engine said."""
    role = choose_role(args.role, facts)
    if args.model and args.model not in facts.served_names:
        raise DiscoveryError(f"the engine serves {list(facts.served_names)}, not {args.model!r}")
    return AgentConfig(
        agent_id=args.agent_id or default_agent_id(role, args.url),
        role=role,
        orchestrator=args.orchestrator,
        engine="vllm",
        model=args.model or facts.served_names[0],
        attach_url=args.url,
        kv_events_endpoint=args.kv_events_endpoint or facts.kv_events_endpoint,
        curve_secret_key_file=args.curve_secret_key,
        orchestrator_key_file=args.orchestrator_key,
        labels=labels_from_args(args),
    )


async def _discover(url: str, timeout_s: float) -> EngineFacts:
    async with aiohttp.ClientSession() as http:
        return await discover(http, url, timeout_s=timeout_s)


def run(args: argparse.Namespace) -> int:
    """Discover, say what was found, then run the attached agent until stopped."""
    try:
        facts = asyncio.run(_discover(args.url, args.discover_timeout_s))
        cfg = config_for(args, facts)
    except DiscoveryError as exc:
        print(f"vllm-disagg connect: {exc}", file=sys.stderr)
        return EXIT_CANNOT
    caps = facts.capabilities
    resumes = " and ".join(r for r, chat in (("completions", False), ("chats", True)) if caps.resumes(chat))
    print(
        f"connect: {args.url} is vLLM {facts.version or '?'} serving {cfg.model!r} (block size "
        f"{facts.block_size or 'unknown'}, max model len {facts.max_model_len}, connector "
        f"{facts.kv_connector or 'none'}, kv_role {facts.kv_role or 'unknown'}, resumable streams: "
        f"{resumes or 'none'}); registering as "
        f"{cfg.agent_id} ({cfg.role}) with {cfg.orchestrator}",
        flush=True,
    )
    return agent_main.run_config(cfg, args.log_level, args.log_format)
