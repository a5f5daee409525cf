"""The connector's GPU copy path, measured with torch alone: ``scripts/gpu_check.sh``.

Needs Python, torch with CUDA and this repository, nothing else (no vLLM, no network, none of the
project's other dependencies: it imports only ``arena`` and ``device_copy``). It builds a KV cache in
vLLM's CUDA layout (per layer ``[2, num_blocks, block_size, num_kv_heads, head_size]``, fp16), maps a
pool arena in shared memory as the agent does, and times, for the same bytes:

- **save**: ``BlockCopier.save`` of a set of blocks, layer by layer, then ``wait_saves`` (device to
  host, into the arena's page-locked slots);
- **load**: ``BlockCopier.load`` of those slots into other blocks, layer by layer, then a device
  synchronize (host to device);
- **plain**: one ``copy_`` each way between a contiguous device tensor and a ``pin_memory`` host
  tensor of the same size: the bus's figure, which the block copies are held to.

It checks the loaded blocks equal the saved ones, and that neither save nor load makes the host wait
for the compute stream: with a long matrix product queued, both return before it ends. Writes a JSON
of GB/s per direction. ``--device cpu`` runs the same code on the CPU fallback (the tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_disagg.agent.kv.arena import Geometry, SlotArena
from vllm_disagg.agent.kv.device_copy import BlockCopier


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the fallback)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved each way per round")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, rounds: int, run: Callable[[], None]) -> float:
    """Median seconds of ``run`` (finished on the device) over ``rounds``, after one warm-up."""
    run()
    _sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _host_waits(device: torch.device, move: Callable[[], None], issue_s: float) -> dict[str, Any]:
    """Queue matrix products on the compute stream for several times ``issue_s`` (the host's time to
    issue ``move``), then ``move``: whether the products were still running when ``move`` returned. A
    copier that synchronised the compute stream would have waited for them."""
    if device.type != "cuda":
        return {}
    a = torch.randn(4096, 4096, device=device, dtype=torch.float16)
    b = a @ a  # the first product loads the kernels: not timed
    _sync(device)
    t0 = time.perf_counter()
    b = a @ a
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-5)
    for _ in range(int(4 * issue_s / one) + 16):
        b = b @ a / 64.0
    queued = torch.cuda.Event()
    queued.record()  # after the products, before the copies
    t0 = time.perf_counter()
    move()
    in_call = time.perf_counter() - t0
    running = not queued.query()
    _sync(device)
    return {"compute_still_running_when_call_returned": running, "host_s_in_call": round(in_call, 4)}


def _arena_dir(nbytes: int) -> Path:
    """/dev/shm where it has room (a container's is often 64 MiB: writing past it is a SIGBUS), else
    the temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        stat = os.statvfs(shm)
        if stat.f_bavail * stat.f_frsize > 2 * nbytes:
            return shm
    return Path(os.environ.get("TMPDIR", "/tmp"))


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure and write the JSON; returns what it wrote."""
    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device (run with --device cpu for the fallback)")
    n = args.blocks
    shape = (
        2,
        2 * n,
        args.block_size,
        args.kv_heads,
        args.head_size,
    )  # saved from one half, loaded into the other
    caches = [torch.randn(shape, device=device, dtype=torch.float16) for _ in range(args.layers)]
    one = caches[0].select(1, 0)
    geometry = Geometry(args.layers, one.numel() * one.element_size(), args.block_size)
    nbytes = geometry.block_bytes * n
    arena = SlotArena(_arena_dir(nbytes) / f"vllm-disagg-gpu-check-{os.getpid()}", geometry, n, owner=True)
    copier = BlockCopier.for_caches(caches)
    try:
        pinned = copier.pin(arena.buffer)
        measured = _measure(device, caches, arena, copier, args.rounds)
    finally:
        copier.close()
        arena.close()
    seconds = measured.pop("seconds")
    gbps = {k: nbytes / v / 1e9 for k, v in seconds.items()}
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "layout": {"per_layer": list(shape), "dtype": "float16", "layers": args.layers, "blocks_moved": n},
        "bytes_each_way": nbytes,
        "arena_page_locked": pinned,
        "rounds": args.rounds,
        "gb_per_s": {k: round(v, 2) for k, v in gbps.items()},
        "share_of_plain": {
            "save": round(gbps["save_device_to_host"] / gbps["plain_device_to_host"], 3),
            "load": round(gbps["load_host_to_device"] / gbps["plain_host_to_device"], 3),
        },
        **measured,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _measure(
    device: torch.device, caches: list[torch.Tensor], arena: SlotArena, copier: BlockCopier, rounds: int
) -> dict[str, Any]:
    """Save the first half of each layer's blocks to the arena and load them into the second half."""
    n = caches[0].shape[1] // 2

    def slot(s: int, layer: int, like: torch.Tensor) -> torch.Tensor:
        raw = torch.frombuffer(arena.layer_view(s, layer), dtype=torch.uint8)
        return raw.view(like.dtype).view(like.shape)

    saves = [[(c.select(1, b), slot(b, i, c.select(1, b))) for b in range(n)] for i, c in enumerate(caches)]
    loads = [
        [(slot(b, i, c.select(1, n + b)), c.select(1, n + b)) for b in range(n)] for i, c in enumerate(caches)
    ]

    def issue_saves() -> None:
        for pairs in saves:
            copier.save(pairs)

    def save() -> None:
        issue_saves()
        copier.wait_saves()

    def load() -> None:
        for pairs in loads:
            copier.load(pairs)

    save_s = _timed(device, rounds, save)
    load_s = _timed(device, rounds, load)
    verified = all(torch.equal(c[:, :n], c[:, n:]) for c in caches)
    down, up = _plain(device, arena.geometry.block_bytes * n, rounds)
    waits = {"save": _host_waits(device, issue_saves, save_s), "load": _host_waits(device, load, load_s)}
    copier.wait_saves()
    return {
        "seconds": {
            "save_device_to_host": save_s,
            "load_host_to_device": load_s,
            "plain_device_to_host": down,
            "plain_host_to_device": up,
        },
        "loaded_equals_saved": verified,
        "host_waits": waits,
    }


def _plain(device: torch.device, nbytes: int, rounds: int) -> tuple[float, float]:
    """Median seconds of one contiguous copy each way between the device and pinned host memory."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def down() -> None:
        host.copy_(on_device, non_blocking=True)

    def up() -> None:
        on_device.copy_(host, non_blocking=True)

    return _timed(device, rounds, down), _timed(device, rounds, up)


if __name__ == "__main__":
    out = run(sys.argv[1:])
    print(json.dumps({k: out[k] for k in ("device", "gb_per_s", "share_of_plain", "loaded_equals_saved")}))
