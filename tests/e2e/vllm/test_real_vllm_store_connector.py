"""Real vLLM P/D through a store connector: ``up --kv-connector shared-storage`` (vLLM's example
connector over a directory both engines read). The gateway's prefill leg carries no
``kv_transfer_params`` and its answer has none; the decode leg is the client's body, and the decode
engine loads the prompt's KV from the directory the prefill engine wrote, and answers as the engine
that computed the prompt does. Two vLLM instances.
"""

from __future__ import annotations

import stat
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.vllm.support import (
    BLOCK,
    Case,
    ask,
    free_engine_ports,
    prompts_for,
    running_up,
    up_1p1d_argv,
)
from tests.helpers import ADMIN, free_port, http_json, metric_sum, parse_prometheus

pytestmark = pytest.mark.timeout(1800)
SOURCE = "vllm:prompt_tokens_by_source_total"


async def _sources(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        families = parse_prometheus(await resp.text())
    return {s: metric_sum(families, SOURCE, source=s) for s in ("local_compute", "external_kv_transfer")}


async def test_the_decode_engine_loads_the_prompt_the_prefill_engine_wrote_to_the_store(
    tiny_model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    port = free_port()
    argv = up_1p1d_argv(tiny_model, port, free_port(), free_engine_ports(2))
    argv += [
        "--kv-connector",
        "shared-storage",
        "--kv-connector-config",
        f'{{"shared_storage_path": "{store}"}}',
    ]
    base = f"http://127.0.0.1:{port}"
    case = Case("store", False, False, prompts_for(tiny_model, 1, first_tokens=3 * BLOCK + 10)[0])
    with running_up(argv, tmp_path / "up.log"):
        status, body = http_json(f"{base}/admin/v1/instances", headers=ADMIN)
        assert status == 200, body
        instances = {i["agent_id"]: i for i in body["instances"]}
        assert {i["kv_connector"] for i in instances.values()} == {"ExampleConnector"}
        decode = instances["decode-0"]["url"]
        async with aiohttp.ClientSession() as session:
            before = await _sources(session, decode)
            text, usage, headers = await ask(session, base, case)
            grew = {s: v - before[s] for s, v in (await _sources(session, decode)).items()}
            assert headers["X-Disagg-Prefill"] == "prefill-0" and headers["X-Disagg-Decode"] == "decode-0"
            prompt_tokens = int(usage["prompt_tokens"])
            loaded = (prompt_tokens - 1) // BLOCK * BLOCK  # the example connector's whole blocks
            assert grew == {"external_kv_transfer": loaded, "local_compute": prompt_tokens - loaded}
            assert stat.S_IMODE(store.stat().st_mode) == 0o700  # prompts' KV: this user's alone
            assert any(store.iterdir()), "the prefill engine wrote the prompt's KV to the store"

            # The same request straight to the prefill engine, the store emptied: it answers from what
            # it computed itself (its own prefix cache), as the decode engine did from the store.
            for folder in store.iterdir():
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
            prefill = instances["prefill-0"]["url"]
            before = await _sources(session, prefill)
            own, _, _ = await ask(session, prefill, case)
            grew = {s: v - before[s] for s, v in (await _sources(session, prefill)).items()}
    assert grew["external_kv_transfer"] == 0
    assert own == text
