"""Real vLLM, two engines sharing their host's KV pool (``up --kv-connector vllm-disagg``: its pool
scope is ``node`` by default). The first agent runs the pool; the other's engine maps the same shared
memory, so a prompt the prefill engine saved is loaded by the decode engine with no transfer at all:
no ``kv_grant``, no ``kv_fetch``, no byte over TCP. Two vLLM instances.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.e2e.vllm.support import BLOCK, Case, ask, free_engine_ports, prompts_for, running_up, up_1p1d_argv
from tests.helpers import ADMIN, free_port, http_json, metric_sum, parse_prometheus

pytestmark = pytest.mark.timeout(1800)
SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


async def _sources(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        families = parse_prometheus(await resp.text())
    return {s: metric_sum(families, SOURCE, source=s) for s in SOURCES}


def _moved(base: str) -> dict[str, float]:
    """The gateway's count of the blocks its moves started: fetched by the receiver, or already there."""
    status, text = http_json(f"{base}/metrics")
    assert status == 200
    families = parse_prometheus(text)
    name = "vllm_disagg_kv_pool_transfer_blocks_total"
    return {outcome: metric_sum(families, name, outcome=outcome) for outcome in ("reserved", "already_held")}


async def test_the_decode_engine_loads_what_the_prefill_engine_saved_in_the_host_pool(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port()
    argv = [
        *up_1p1d_argv(tiny_model, port, free_port(), free_engine_ports(2)),
        "--kv-connector",
        "vllm-disagg",
    ]
    base = f"http://127.0.0.1:{port}"
    case = Case("node", False, False, prompts_for(tiny_model, 1, first_tokens=3 * BLOCK + 10)[0])
    with running_up(argv, tmp_path / "up.log"):
        status, body = http_json(f"{base}/admin/v1/instances", headers=ADMIN)
        assert status == 200, body
        instances = {i["agent_id"]: i for i in body["instances"]}
        p, d = instances["prefill-0"], instances["decode-0"]
        assert (p["kv_pool_node"], d["kv_pool_node"]) == ("", "prefill-0")  # one pool, the first agent's
        assert p["kv_pool_endpoint"] and not d["kv_pool_endpoint"]  # no TCP endpoint: no pool of its own
        async with aiohttp.ClientSession() as session:
            before = await _sources(session, d["url"])
            text, usage, headers = await ask(session, base, case)
            grew = {s: v - before[s] for s, v in (await _sources(session, d["url"])).items()}
            assert (headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"]) == ("prefill-0", "decode-0")
            full = int(usage["prompt_tokens"]) // BLOCK * BLOCK
            # Loaded, not computed: and decode-0's agent runs no pool, so it came from the shared memory.
            assert grew["external_kv_transfer"] == full and grew["local_cache_hit"] == 0
            assert _moved(base) == {"reserved": 0, "already_held": full // BLOCK}  # the move: a no-op
            own, _, _ = await ask(session, p["url"], case)  # the prefill engine's own answer
    assert own == text
