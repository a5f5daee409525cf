"""The connector's block copies (``device_copy``) and the GPU check script, on the CPU fallback.

The CUDA path (side stream, events, page-locked arena) runs only where a GPU is: ``scripts/gpu_check.sh``
measures it there (docs/kv-pool.md). Here: the fallback copies exactly, through a real arena, in both
KV layouts the connector meets, and the script runs end to end on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vllm_disagg.agent.kv.arena import Geometry, SlotArena
from vllm_disagg.agent.kv.device_copy import BlockCopier
from vllm_disagg.agent.kv.gpu_check import run

ROOT = Path(__file__).resolve().parents[4]

# (per-layer shape, the dimension that indexes blocks): vLLM's CPU layout and its CUDA backends' one.
LAYOUTS = [((6, 2, 4, 2 * 8), 0), ((2, 6, 4, 2, 8), 1)]


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[SlotArena]:
    geometry = Geometry(num_layers=3, layer_block_bytes=2 * 4 * 2 * 8 * 2, block_size=4)
    made = SlotArena(tmp_path / "pool", geometry, 4, owner=True)
    yield made
    made.close()


def _slot(arena: SlotArena, slot: int, layer: int, like: torch.Tensor) -> torch.Tensor:
    raw = torch.frombuffer(arena.layer_view(slot, layer), dtype=torch.uint8)
    return raw.view(like.dtype).view(like.shape)


@pytest.mark.parametrize(("shape", "dim"), LAYOUTS)
def test_blocks_saved_to_slots_load_back_into_other_blocks_bit_for_bit(
    arena: SlotArena, shape: tuple[int, ...], dim: int
) -> None:
    caches = [torch.randn(shape, dtype=torch.float16) for _ in range(3)]
    copier = BlockCopier.for_caches(caches)
    assert not copier.cuda
    saved = {0: 1, 3: 2}  # block -> slot
    for layer, cache in enumerate(caches):
        copier.save(
            [(cache.select(dim, b), _slot(arena, s, layer, cache.select(dim, b))) for b, s in saved.items()]
        )
    copier.wait_saves()
    for layer, cache in enumerate(caches):
        # Slot 1 (block 0) into block 5, slot 2 (block 3) into block 4.
        copier.load(
            [
                (_slot(arena, s, layer, cache.select(dim, 5 - s + 1)), cache.select(dim, 5 - s + 1))
                for s in (1, 2)
            ]
        )
    for cache in caches:
        assert torch.equal(cache.select(dim, 5), cache.select(dim, 0))
        assert torch.equal(cache.select(dim, 4), cache.select(dim, 3))
        assert not torch.equal(cache.select(dim, 1), cache.select(dim, 0))  # nothing else was written
    copier.close()


def test_an_asynchronous_load_copies_every_layer_and_says_when_it_is_done(arena: SlotArena) -> None:
    (shape, dim) = LAYOUTS[0]
    caches = [torch.randn(shape, dtype=torch.float16) for _ in range(3)]
    copier = BlockCopier.for_caches(caches)
    for layer, cache in enumerate(caches):
        _slot(arena, 2, layer, cache.select(dim, 0)).copy_(cache.select(dim, 0))
    assert copier.saves_done().query()  # on CPU nothing is ever in flight
    done = copier.load_async(
        [
            (_slot(arena, 2, layer, cache.select(dim, 4)), cache.select(dim, 4))
            for layer, cache in enumerate(caches)
        ]
    )
    assert done.query()
    assert all(torch.equal(cache.select(dim, 4), cache.select(dim, 0)) for cache in caches)
    copier.close()


def test_a_cpu_cache_pins_nothing_and_closes_cleanly(arena: SlotArena) -> None:
    copier = BlockCopier(torch.device("cpu"))
    assert copier.pin(arena.buffer) is False
    copier.close()
    arena.close()  # no view of the mapping left behind by ``pin``


def test_the_check_measures_both_directions_and_proves_the_loaded_blocks_are_the_saved_ones(
    tmp_path: Path,
) -> None:
    out = tmp_path / "check.json"
    result = run(["--device", "cpu", "--layers", "2", "--blocks", "4", "--rounds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["loaded_equals_saved"] is True
    assert result["bytes_each_way"] == 2 * 4 * (2 * 16 * 8 * 128 * 2)  # layers x blocks x one layer's block
    assert set(result["gb_per_s"]) == {
        "save_device_to_host",
        "load_host_to_device",
        "plain_device_to_host",
        "plain_host_to_device",
    }
    assert all(v > 0 for v in result["gb_per_s"].values())
    assert result["arena_page_locked"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs the check itself")
def test_the_check_without_a_gpu_says_so_and_how_to_run_the_fallback(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no CUDA device.*--device cpu"):
        run(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_the_check_imports_nothing_but_torch_and_the_standard_library() -> None:
    # The GPU machine has torch and nothing else of ours: no vLLM, no aiohttp, no ZeroMQ, no msgpack.
    code = (
        "import sys, vllm_disagg.agent.kv.gpu_check\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'vllm', 'aiohttp', 'zmq', 'msgpack', 'prometheus_client', 'yaml'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_script_runs_from_anywhere_and_writes_where_it_was_told(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHON": sys.executable}
    done = subprocess.run(
        [
            str(ROOT / "scripts" / "gpu_check.sh"),
            "gpu.json",
            "--device",
            "cpu",
            "--layers",
            "2",
            "--blocks",
            "4",
        ],
        env=env,
        cwd=tmp_path,  # a relative OUT is the caller's, although the script runs in the repository
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "gpu.json").read_text())["loaded_equals_saved"] is True
    assert json.loads(done.stdout)["loaded_equals_saved"] is True
