"""Blocks of LoRA and salted requests in the pool, on one real vLLM with a LoRA adapter of the tiny
model (``model/tiny_lora.py``) and the project's connector: vLLM keys such blocks with their extra
keys (the adapter, the salt), the engine saves them under those keys with the keys' parts, and the
pool serves each block only to a request with the same adapter and salt; a request with another, or
none, computes the prompt and answers as that model does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm.pool_thread import PoolThread
from tests.e2e.vllm.support import BLOCK, MODEL, running_vllms
from tests.helpers import eventually_sync, free_ports, http_json, metric_sum, parse_prometheus
from vllm_disagg import jsonutil
from vllm_disagg.agent.kv.pool import PrefixPool
from vllm_disagg.config import AgentConfig
from vllm_disagg.model.tiny_lora import RANK, build_tiny_lora
from vllm_disagg.wire.block_hash import Extra, block_hash, none_hash

pytestmark = pytest.mark.timeout(1200)
SOURCE = "vllm:prompt_tokens_by_source_total"
PROMPT = [(i * 7919) % 1500 + 20 for i in range(2 * BLOCK + 9)]  # two full blocks and a tail
ADAPTER = "ada"


@pytest.fixture(scope="module")
def engine(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, PoolThread, Path]]:
    lora = build_tiny_lora(tmp_path_factory.mktemp("lora") / ADAPTER)
    port = free_ports(1, (0, 2000, 3000))
    lora_args = ("--enable-lora", "--lora-modules", f"{ADAPTER}={lora}", "--max-lora-rank", str(RANK))
    cfg = AgentConfig(
        agent_id="exact-keys", role="both", engine="vllm", model=MODEL, model_path=str(tiny_model),
        engine_port=port, kv_connector="vllm-disagg", kv_pool_capacity="64", extra_engine_args=lora_args,
    )  # fmt: skip
    pool = PoolThread(cfg)
    log = tmp_path_factory.mktemp("exact-keys") / "vllm.log"
    try:
        with running_vllms([(cfg, log)], env={cfg.agent_id: {"VLLM_SERVER_DEV_MODE": "1"}}) as (base,):
            eventually_sync(lambda: pool.call(lambda: pool.pool.node.arena is not None), timeout=60,
                            what="the engine's worker opened the pool")  # fmt: skip
            yield base, pool, lora
    finally:
        pool.close()


def _ask(base: str, model: str = MODEL, salt: str = "") -> tuple[str, dict[str, float]]:
    """The answer to PROMPT, its engine's prefix cache emptied first (so what it does not compute it
    loads from the pool), and how the engine's prompt-token counters grew."""
    assert http_json(f"{base}/reset_prefix_cache", method="POST", body=b"{}")[0] == 200
    before = _sources(base)
    body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    if salt:
        body["cache_salt"] = salt
    status, answer = http_json(
        f"{base}/v1/completions", method="POST", body=jsonutil.dumps(body), timeout=120
    )
    assert status == 200, answer
    after = _sources(base)
    return answer["choices"][0]["text"], {s: after[s] - before[s] for s in after}


def _sources(base: str) -> dict[str, float]:
    status, text = http_json(f"{base}/metrics")
    assert status == 200
    families = parse_prometheus(text)
    return {s: metric_sum(families, SOURCE, source=s) for s in ("local_compute", "external_kv_transfer")}


def _keys(first: Extra | None, rest: Extra | None) -> list[bytes]:
    """PROMPT's full blocks' keys with these extra keys (the first block's, then every other's)."""
    parent, keys = none_hash(), []
    for b in range(len(PROMPT) // BLOCK):
        parent = block_hash(parent, PROMPT[b * BLOCK : (b + 1) * BLOCK], first if b == 0 else rest)
        keys.append(parent)
    return keys


def _pool(pool: PoolThread) -> PrefixPool:
    assert pool.pool.node.pool is not None
    return pool.pool.node.pool


LOADED = {"external_kv_transfer": 2 * BLOCK, "local_compute": len(PROMPT) - 2 * BLOCK}
COMPUTED = {"external_kv_transfer": 0, "local_compute": len(PROMPT)}


def test_a_lora_request_s_blocks_are_keyed_with_the_adapter_and_served_only_to_it(
    engine: tuple[str, PoolThread, Path],
) -> None:
    base, pool, lora = engine
    adapter: Extra = (("lora", ADAPTER, str(lora)),)
    keyed = _keys(adapter, adapter)
    own, grew = _ask(base, ADAPTER)
    assert grew == COMPUTED
    held = pool.call(lambda: {k: _pool(pool).extra_of(k) for k in keyed if k in _pool(pool)})
    assert held == {k: adapter for k in keyed}  # saved under vLLM's keys, with the parts they cover
    assert _ask(base, ADAPTER) == (own, LOADED)  # served back to the adapter, token for token

    base_text, grew = _ask(base, MODEL)  # the same tokens without the adapter: nothing to load
    assert grew == COMPUTED and base_text != own
    assert _ask(base, MODEL) == (base_text, LOADED)  # the base model's own blocks, saved apart


def test_a_salted_request_s_blocks_are_served_only_to_the_same_salt(
    engine: tuple[str, PoolThread, Path],
) -> None:
    base, pool, _ = engine
    salted = _keys((("cache_salt", "s1"),), None)  # the salt is in the first block's key, so in all
    text, grew = _ask(base, salt="s1")
    assert grew == COMPUTED
    assert pool.call(lambda: [k in _pool(pool) for k in salted]) == [True, True]
    assert _ask(base, salt="s1") == (text, LOADED)
    assert _ask(base, salt="s2") == (text, COMPUTED)  # the same model: the same answer, computed
