"""Real vLLM on the project's connector with a disk tier (``up --kv-disk-dir``): what the pools held
outlives the cluster.

A cluster of one decode instance computes a prompt; its engine saves the prompt's full blocks in its
agent's pool. The cluster stops (its agent puts the pool's blocks on disk as it goes), and a new
cluster on the same directory starts: the new agent finds the blocks there, reports them to the
orchestrator as its pool's disk tier, and when the same prompt comes again its engine loads every full
block from them (read back into the pool) instead of computing it, and answers token for token as the
first engine did. One vLLM instance at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.vllm.support import BLOCK, Case, ask, free_engine_ports, prompts_for, running_up, up_1p1d_argv
from tests.helpers import ADMIN, eventually, free_port, http_json, metric_sum, parse_prometheus

pytestmark = pytest.mark.timeout(1800)
SOURCE = "vllm:prompt_tokens_by_source_total"


def _argv(model: Path, disk: Path) -> tuple[list[str], str]:
    port = free_port()
    argv = up_1p1d_argv(model, port, free_port(), free_engine_ports(1))
    argv[argv.index("--prefill") + 1] = "0"  # one decode instance alone: it computes and loads
    argv += ["--kv-connector", "vllm-disagg", "--kv-pool-capacity", "64MiB", "--kv-disk-dir", str(disk)]
    return argv, f"http://127.0.0.1:{port}"


async def _sources(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        families = parse_prometheus(await resp.text())
    return {s: metric_sum(families, SOURCE, source=s) for s in ("local_compute", "external_kv_transfer")}


async def _once(base: str, case: Case) -> tuple[str, dict[str, float], int]:
    """Ask ``case`` on the cluster at ``base``: its text, how its engine's prompt-token counters grew,
    and its prompt tokens."""
    status, body = http_json(f"{base}/admin/v1/instances", headers=ADMIN)
    assert status == 200, body
    url = next(i["url"] for i in body["instances"] if i["agent_id"] == "decode-0")
    async with aiohttp.ClientSession() as session:
        before = await _sources(session, url)
        text, usage, _ = await ask(session, base, case)
        after = await _sources(session, url)
    return text, {s: after[s] - before[s] for s in after}, int(usage["prompt_tokens"])


def _disk_blocks(base: str) -> int:
    status, body = http_json(f"{base}/admin/v1/debug/state", headers=ADMIN)
    assert status == 200, body
    tiers: dict[str, Any] = body["scheduler"]["kv_index"]["disk_tiers"]
    return int(tiers.get("decode-0", 0))


async def test_a_prompt_computed_before_a_restart_is_loaded_from_the_disk_tier_after_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    case = Case("disk", False, False, prompts_for(tiny_model, 1, first_tokens=3 * BLOCK + 10)[0])
    argv, base = _argv(tiny_model, disk)
    with running_up(argv, tmp_path / "first.log"):
        first, grew, prompt_tokens = await _once(base, case)
        assert grew["external_kv_transfer"] == 0  # computed: nothing held it yet
    full = prompt_tokens // BLOCK
    files = list(disk.glob("decode-0/*/*.kvb"))
    assert len(files) >= full, f"the stopped agent kept the pool's blocks on disk: {files}"

    argv, base = _argv(tiny_model, disk)
    with running_up(argv, tmp_path / "second.log"):

        async def reported() -> bool:
            return _disk_blocks(base) >= full

        await eventually(reported, timeout=120, what="the new agent reported its disk tier")
        again, grew, _ = await _once(base, case)
    assert again == first  # token for token: the KV read back from disk is the KV computed then
    assert grew["external_kv_transfer"] == full * BLOCK  # every full block, from disk via the pool
    assert grew["local_compute"] == prompt_tokens - full * BLOCK
