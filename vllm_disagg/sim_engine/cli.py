"""``vllm-disagg sim-engine``: run one simulated vLLM engine until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys

from vllm_disagg.config import (
    SimEngineConfig,
    add_sim_timing_arguments,
    sim_timing_flags,
    sim_timing_from_args,
)
from vllm_disagg.runtime import run_service
from vllm_disagg.sim_engine.engine import start_engine

_DEFAULT = SimEngineConfig()

# (flag, config field, type); timing fields live in SimTiming, the rest in SimEngineConfig.
_ENGINE_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--model", "model", str),
    ("--host", "host", str),
    ("--port", "port", int),
    ("--engine-id", "engine_id", str),
    ("--max-model-len", "max_model_len", int),
    ("--default-max-tokens", "default_max_tokens", int),
    ("--kv-lease-s", "kv_lease_s", float),
    ("--kv-events-port", "kv_events_port", int),
    ("--kv-load-failure-policy", "kv_load_failure_policy", str),
)
_HELP = {
    "model": "served model name",
    "host": "address to listen on",
    "port": "port to listen on (0: any free port)",
    "engine_id": "id in kv_transfer_params (default host:port)",
    "max_model_len": "context window in tokens",
    "default_max_tokens": "max_tokens when a request gives none",
    "kv_lease_s": "seconds blocks held for a decoder survive without a pull",
    "kv_events_port": "publish vLLM-style KV-cache events on tcp://127.0.0.1:PORT (0: off)",
    "kv_load_failure_policy": "a KV pull that fails: 'fail' (500) or 'recompute' (locally), as vLLM's",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sim-engine`` flags; defaults are ``SimEngineConfig()``'s."""
    for flag, name, kind in _ENGINE_FLAGS:
        parser.add_argument(flag, dest=name, type=kind, default=getattr(_DEFAULT, name), help=_HELP[name])
    parser.add_argument(
        "--enable-prompt-tokens-details",
        dest="prompt_tokens_details",
        action="store_true",
        help="usage reports the prompt tokens served from cache, as vLLM's flag",
    )
    parser.add_argument(
        "--no-prefill-cache-in-handle",
        dest="prefill_cache_in_handle",
        action="store_false",
        help="a prefill's KV handle leaves out its own cache hits (vLLM 0.32 adds them, and D reports "
        "that figure as its cached tokens)",
    )
    add_sim_timing_arguments(parser, defaults=True)


def config_from_args(args: argparse.Namespace) -> SimEngineConfig:
    """The validated config the flags describe (``ConfigError`` on values that cannot work)."""
    return SimEngineConfig(
        timing=sim_timing_from_args(args),
        prompt_tokens_details=args.prompt_tokens_details,
        prefill_cache_in_handle=args.prefill_cache_in_handle,
        **{name: getattr(args, name) for _, name, _ in _ENGINE_FLAGS},
    )


def sim_engine_argv(config: SimEngineConfig) -> list[str]:
    """The arguments after ``sim-engine`` that reproduce ``config``."""
    argv: list[str] = []
    for flag, name, _ in _ENGINE_FLAGS:
        if name == "engine_id" and not config.engine_id:
            continue  # the default: derived from host and port
        argv += [flag, str(getattr(config, name))]
    if config.prompt_tokens_details:
        argv.append("--enable-prompt-tokens-details")
    if not config.prefill_cache_in_handle:
        argv.append("--no-prefill-cache-in-handle")
    for flag, name, _ in sim_timing_flags():
        argv += [flag, repr(getattr(config.timing, name))]  # repr: floats round-trip exactly
    return argv


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit 0 after a clean stop."""
    config = config_from_args(args)

    async def main(stop: asyncio.Event) -> int:
        server = await start_engine(config)
        print(f"sim-engine {config.model!r} serving at {server.url}", file=sys.stderr, flush=True)
        try:
            await stop.wait()
        finally:
            await server.close()
        return 0

    return run_service(main)
