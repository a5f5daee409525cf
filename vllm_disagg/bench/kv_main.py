"""``vllm-disagg bench kv``: the parts asked for, in one object, as a table or JSON.

The transfer part always runs (``kv.py``: agents against a loopback socket); the churn
(``kv_churn.py``), the real-vLLM TTFT rounds (``kv_ttft.py``) and the handoff between two engines
(``kv_handoff.py``) where their flags ask for them.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.bench import kv, kv_churn, kv_handoff, kv_ttft
from vllm_disagg.bench.kv import transfer_part
from vllm_disagg.bench.kv_churn import churn_part, print_churn
from vllm_disagg.bench.kv_handoff import handoff_part, print_handoff
from vllm_disagg.bench.kv_ttft import ttft_part
from vllm_disagg.runtime import asyncio_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``vllm-disagg bench kv``."""
    kv.add_arguments(parser)
    kv_churn.add_arguments(parser)
    kv_ttft.add_arguments(parser)
    kv_handoff.add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Each part's keys in one object (a part not asked for is absent)."""
    with tempfile.TemporaryDirectory(prefix="vllm-disagg-bench-kv-") as tmp:
        keydir = Path(tmp) if args.curve else None
        result: dict[str, Any] = dict(vars(await transfer_part(args, keydir)))
        if args.churn_s > 0:
            result.update(vars(await churn_part(args, keydir)))
    if args.ttft_rounds > 0:
        result.update(asdict(await ttft_part(args)))
    if args.handoff_rounds > 0:
        result.update(asdict(await handoff_part(args)))
    return result


def run(args: argparse.Namespace) -> int:
    """Print the table (or JSON); 1 if a transfer went wrong or the churn broke a bound."""
    result = asyncio_run(run_bench(args))
    failed = result["errors"] > 0 or not result.get("churn_ok", True)
    if args.json:
        print(jsonutil.dumps(result).decode())
        return int(failed)
    mib = result["block_bytes"] / 2**20
    print(
        f"{result['blocks']} blocks of {mib:g} MiB ({args.layers} layers x {args.layer_block_kib} KiB), "
        f"{args.rounds} rounds; window {args.window} x {args.chunk_kib} KiB chunks"
        + (", CurveZMQ" if args.curve else "")
    )
    print("| path | GB/s (median) | rounds |")
    print("|---|---:|---|")
    print(f"| agents (KvTransfer, ZeroMQ) | {result['agent_gbps']} | {result['agent_rounds']} |")
    print(f"| loopback TCP (sendall / recv_into) | {result['loopback_gbps']} | {result['loopback_rounds']} |")
    errors = f" ({result['errors']} ROUNDS WENT WRONG)" if result["errors"] else ""
    print(f"agent / loopback (median of the rounds' ratios): {result['ratio']}{errors}")
    print_churn(result)
    if "ttft_rounds" in result:
        print(
            f"TTFT of a repeated {result['ttft_prefix_tokens']}-token prefix on real vLLM, "
            f"median of {result['ttft_rounds']} rounds (max_tokens=1 latency):"
        )
        print("| prefix | TTFT ms |")
        print("|---|---:|")
        print(f"| computed (never seen) | {result['ttft_computed_ms']} |")
        print(f"| loaded from the pool (engine cache reset) | {result['ttft_pool_ms']} |")
        print(f"| engine's own prefix cache | {result['ttft_local_ms']} |")
        print(f"| read back from the disk tier (memory emptied, index rebuilt) | {result['ttft_disk_ms']} |")
        print(
            f"tokens the engine loaded from the pool: {result['ttft_pool_loaded_tokens']}, "
            f"from the disk tier: {result['ttft_disk_loaded_tokens']}"
        )
    print_handoff(result)
    return int(failed)
