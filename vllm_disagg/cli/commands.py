"""The ``vllm-disagg`` command. ``main(argv) -> int`` so every subcommand is testable in-process.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` (or
``add_arguments_for(name, parser)`` when one module serves several subcommands) and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vllm_disagg import __version__
from vllm_disagg.errors import ConfigError

# (subcommand, module, help). Nested commands use a space: "bench gateway".
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("up", "vllm_disagg.cli.up", "start a whole local cluster (orchestrator, agents, engines)"),
    ("orchestrator", "vllm_disagg.orchestrator.main", "run the orchestrator (gateway, registry, admin)"),
    ("agent", "vllm_disagg.agent.main", "run an agent that launches or attaches to one engine"),
    (
        "connect",
        "vllm_disagg.agent.connect",
        "attach a running vLLM: discover what it is, then run its agent",
    ),
    ("sim-engine", "vllm_disagg.sim_engine.cli", "run one simulated vLLM engine"),
    (
        "sim",
        "vllm_disagg.cluster_sim.cli",
        "replay a trace on a simulated cluster: goodput of routing policies, in virtual time",
    ),
    ("status", "vllm_disagg.cli.admin", "show the cluster's instances"),
    ("drain", "vllm_disagg.cli.admin", "drain an instance (no new requests)"),
    ("remove", "vllm_disagg.cli.admin", "forget a dead instance"),
    ("role", "vllm_disagg.cli.admin", "change what an instance serves (prefill, decode, both)"),
    (
        "add",
        "vllm_disagg.cli.admin",
        "attach a running engine by URL (the orchestrator runs its agent)",
    ),
    ("requests", "vllm_disagg.cli.admin", "recent requests: where each went, and why"),
    ("debug", "vllm_disagg.cli.admin", "the scheduler's and the planner's state now, as JSON"),
    (
        "rollout",
        "vllm_disagg.cli.admin",
        "roll a model to a new revision (the old drains out as the new is ready); pause, resume, rollback",
    ),
    (
        "events",
        "vllm_disagg.cli.admin",
        "cluster events: joins, deaths, breakers, fallbacks",
    ),
    ("keys", "vllm_disagg.keys", "make CurveZMQ keypairs that authenticate agents to the orchestrator"),
    ("chaos", "vllm_disagg.chaos.cli", "a sim cluster under load while engines and agents are SIGKILLed"),
    ("bench gateway", "vllm_disagg.bench.gateway", "gateway overhead vs talking to engines directly"),
    ("bench pd", "vllm_disagg.bench.pd", "real vLLM: colocated vs 1P1D through the gateway (TTFT, TPOT)"),
    ("bench scheduler", "vllm_disagg.bench.scheduler", "decision time incl. prefix lookup at N instances"),
    ("bench ha", "vllm_disagg.bench.ha", "replicas: leader failover time, requests lost, req/s vs workers"),
    (
        "bench planner",
        "vllm_disagg.bench.planner",
        "a workload shift on a sim cluster: the planner vs a static split",
    ),
    (
        "bench goodput",
        "vllm_disagg.bench.goodput_main",
        "goodput vs offered load on a sim cluster: the planner and SLO-aware path; admission past capacity",
    ),
    (
        "bench kv",
        "vllm_disagg.bench.kv_main",
        "agent-to-agent KV transfer GB/s vs a loopback socket; a pool and its disk tier under churn; "
        "real-vLLM TTFT from the pool, the disk tier, and another engine's host pool",
    ),
    (
        "bench calibrate",
        "vllm_disagg.bench.calibrate",
        "real vLLM: measure prefill and decode step costs, fit the cluster simulator's profile",
    ),
    ("model tiny", "vllm_disagg.model.tiny", "build the tiny offline test model"),
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser; subcommand modules add their own flags."""
    parser = argparse.ArgumentParser(prog="vllm-disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"vllm-disagg {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for name, module_name, help_text in COMMANDS:
        words = name.split()
        target = subparsers
        if len(words) == 2:
            if words[0] not in groups:
                group = subparsers.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", required=True, metavar="KIND")
            target = groups[words[0]]
        sub = target.add_parser(words[-1], help=help_text, description=help_text)
        sub.set_defaults(_module=module_name, _name=name)
        module = importlib.import_module(module_name)
        if hasattr(module, "add_arguments_for"):
            module.add_arguments_for(name, sub)
        else:
            module.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args))
    except ConfigError as exc:
        print(f"vllm-disagg {args._name}: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entrypoint() -> None:
    """Console-script entry point."""
    sys.exit(main())
