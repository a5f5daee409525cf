"""``vllm-disagg orchestrator``: run the gateway, registry, control plane and admin API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.app import start_orchestrator
from vllm_disagg.orchestrator.gateway.tokenize import preload_tokenizer_libs
from vllm_disagg.orchestrator.scheduling.config import load_scheduler_config
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.runtime import run_service

_DEFAULTS = OrchestratorConfig()
# (flag, OrchestratorConfig field, type, help)
_RECOVERY_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    (
        "--suspect-after-s",
        "suspect_after_s",
        float,
        "no heartbeat this long: stop routing to the instance before it is dead (default: off)",
    ),
    ("--prefill-attempts", "prefill_attempts", int, "prefill instances tried before running colocated"),
    ("--decode-attempts", "decode_attempts", int, "decode instances tried before the first byte"),
    ("--max-resumes", "max_resumes", int, "mid-stream resumes of one request on another instance"),
    ("--breaker-failures", "breaker_failures", int, "consecutive failed legs that open a breaker"),
    ("--breaker-open-s", "breaker_open_s", float, "first open period of a breaker before its probe"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg orchestrator``."""
    d = _DEFAULTS
    parser.add_argument("--host", default=d.host, help="HTTP bind address (gateway, admin, metrics)")
    parser.add_argument("--port", type=int, default=d.port, help="HTTP port (0: any free port)")
    parser.add_argument(
        "--zmq-endpoint", default=d.zmq_endpoint, help="ZeroMQ ROUTER endpoint agents connect to"
    )
    parser.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s)
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=d.heartbeat_timeout_s,
        help="an instance silent this long is dead",
    )
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger bodies get 413")
    parser.add_argument("--connect-timeout-s", type=float, default=d.connect_timeout_s, help="to an engine")
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=d.idle_timeout_s,
        help="no byte from an engine for this long fails the leg (never a total: streams may run for hours)",
    )
    recovery = parser.add_argument_group("recovery (docs/operations.md)")
    for flag, name, kind, help_text in _RECOVERY_FLAGS:
        recovery.add_argument(flag, dest=name, type=kind, default=getattr(d, name), help=help_text)
    parser.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes, help="agent frame limit")
    parser.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=10.0,
        help="on SIGTERM, wait this long for in-flight requests",
    )
    parser.add_argument(
        "--scheduler-config",
        default=d.scheduler_config,
        metavar="FILE",
        help="scheduler YAML (plugins, profiles, weights; see docs/scheduler.md); default: the shipped one",
    )
    parser.add_argument(
        "--no-preload-tokenizer-libs",
        dest="preload_tokenizer_libs",
        action="store_false",
        help="do not import transformers at start (saves memory and seconds when no engine is vLLM)",
    )
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def config_from_args(args: argparse.Namespace) -> OrchestratorConfig:
    """The validated config the flags describe (raises ``ConfigError``)."""
    return OrchestratorConfig(
        host=args.host,
        port=args.port,
        zmq_endpoint=args.zmq_endpoint,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        max_body_bytes=args.max_body_bytes,
        connect_timeout_s=args.connect_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        **{name: getattr(args, name) for _, name, _, _ in _RECOVERY_FLAGS},
        max_frame_bytes=args.max_frame_bytes,
        scheduler_config=args.scheduler_config,
        preload_tokenizer_libs=args.preload_tokenizer_libs,
    )


def run(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; returns the exit code."""
    config = config_from_args(args)  # before anything starts: a bad flag exits 2 via the CLI
    scheduler = PluginScheduler(load_scheduler_config(config))  # so is a bad scheduler config
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )

    if config.preload_tokenizer_libs:
        preload_tokenizer_libs()

    async def main(stop: asyncio.Event) -> int:
        server = await start_orchestrator(
            config, scheduler=scheduler, shutdown_timeout_s=args.shutdown_timeout_s
        )
        try:
            print(f"orchestrator: http {server.url}  agents {server.zmq_endpoint}", flush=True)
            await stop.wait()
        finally:
            await server.close()
        return 0

    return run_service(main)
