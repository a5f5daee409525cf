"""Real vLLM on the project's own connector (``up --kv-connector vllm-disagg``): the agents' prefix
pools carry the KV from prefill to decode, and a prefix computed once serves the other instance.

First one plain vLLM (no connector) answers every request: the reference. Then 1P1D on the project's
connector serves the same requests through the gateway, token for token; the decode engine's own
counters say the prompts' full blocks were loaded (``external_kv_transfer``), not computed. Then a
prompt is computed on the prefill engine alone, and a second prompt sharing its long prefix is sent
to the decode instance: its engine loads that prefix from its pool (which its agent fetched from the
prefill agent's) and computes only the rest. A salted prompt moves from P to D under its salted
keys. At most two vLLM instances run at once (2 cores).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.vllm.reference import Book, PoolPrompts, pool_cases, pool_prompts
from tests.e2e.vllm.support import (
    BLOCK,
    JSON,
    Answers,
    Case,
    UpCluster,
    ask,
    free_engine_ports,
    running_up,
    up_1p1d_argv,
)
from tests.helpers import eventually, free_port, metric_sum, parse_prometheus
from vllm_disagg import jsonutil

pytestmark = pytest.mark.timeout(1800)
SOURCE = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> PoolPrompts:
    return pool_prompts(tiny_model)


def _cases(prompts: PoolPrompts) -> list[Case]:
    return pool_cases(prompts)


@pytest.fixture(scope="module")
def reference(reference_book: Book, prompts: PoolPrompts) -> Answers:
    return reference_book.answers(_cases(prompts))


@pytest.fixture(scope="module")
def cluster(
    tiny_model: Path, reference: Answers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpCluster]:
    port, zmq_port = free_port(), free_port()
    argv = [*up_1p1d_argv(tiny_model, port, zmq_port, free_engine_ports(2)), "--kv-connector", "vllm-disagg"]
    # One pool per agent, blocks moved between them over TCP (the node pool: test_real_vllm_node_pool.py).
    argv += ["--kv-pool-capacity", "256MiB", "--kv-pool-scope", "agent"]
    # This 2-core machine stalls for seconds at times (up_1p1d_argv): these tests prove where the KV
    # comes from, so a move must not give up on a stall (the defaults give up after 1 s and 2 s).
    argv += ["--kv-grant-timeout-s", "60", "--kv-fetch-timeout-s", "60"]
    log = tmp_path_factory.mktemp("up") / "up.log"
    with running_up(argv, log) as proc:
        yield UpCluster(proc, f"http://127.0.0.1:{port}", log)


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[Any, float]:
    async with session.get(f"{url}/metrics") as resp:
        return parse_prometheus(await resp.text())


async def test_prefill_to_decode_through_the_pools_is_token_identical_and_the_kv_is_loaded(
    cluster: UpCluster, reference: Answers, prompts: PoolPrompts
) -> None:
    decode_url = cluster.instances()["decode-0"]["url"]
    cases = _cases(prompts)[:-2]
    async with aiohttp.ClientSession() as session:
        before = await _metrics(session, decode_url)
        for case in cases:
            text, _, headers = await ask(session, cluster.base, case)
            assert text == reference.texts[case.name], case.name
            assert headers["X-Disagg-Decode"] == "decode-0", case.name
        after = await _metrics(session, decode_url)

    def grew(source: str) -> float:
        return metric_sum(after, SOURCE, source=source) - metric_sum(before, SOURCE, source=source)

    # Each prompt's first time on D (its completion, then its chat form): every full block came from
    # the pool, which D's agent had fetched from P's. Later sends of the same prompt are D's own hits.
    first_seen = [f"{kind}-nonstream-{i}" for kind in ("completions", "chat") for i in range(3)]
    full_blocks = sum(reference.prompt_tokens[name] // BLOCK * BLOCK for name in first_seen)
    assert grew("external_kv_transfer") >= full_blocks
    # What D computed is at most each request's partial last block (and the one token vLLM always
    # computes when a prompt is all full blocks).
    assert grew("local_compute") < BLOCK * len(cases)


async def test_a_prefix_computed_on_one_instance_is_loaded_from_the_pool_by_the_other(
    cluster: UpCluster, reference: Answers, prompts: PoolPrompts
) -> None:
    urls = {agent: i["url"] for agent, i in cluster.instances().items()}
    prefix_case, sharing_case = _cases(prompts)[-2:]
    shared_blocks = reference.prompt_tokens["prefix"] // BLOCK
    async with aiohttp.ClientSession() as session:

        async def pooled_on_p() -> float:
            async with session.get(f"{cluster.base}/metrics") as resp:
                families = parse_prometheus(await resp.text())
            return metric_sum(families, "vllm_disagg_kv_pool_index_blocks", instance="prefill-0")

        # Computed on the prefill engine alone: its connector saves the prompt's full blocks in its
        # agent's pool (the pool has room: nothing is evicted), and the agent reports them to the
        # orchestrator's index.
        pooled = await pooled_on_p()
        text, _, _ = await ask(session, urls["prefill-0"], prefix_case)
        assert text == reference.texts["prefix"]

        async def indexed() -> bool:
            return await pooled_on_p() >= pooled + shared_blocks

        await eventually(indexed, timeout=60, what="the prefill agent's pool blocks indexed")
        before = await _metrics(session, urls["decode-0"])
        text, _, headers = await ask(session, cluster.base, sharing_case)
        after = await _metrics(session, urls["decode-0"])

    assert text == reference.texts["sharing"]
    # Straight to the decode instance: its agent fetched the shared prefix from the prefill agent's
    # pool, and its engine loaded it instead of computing it.
    assert (headers["X-Disagg-Decode"], headers["X-Disagg-Prefill"]) == ("decode-0", "")
    loaded = metric_sum(after, SOURCE, source="external_kv_transfer") - metric_sum(
        before, SOURCE, source="external_kv_transfer"
    )
    computed = metric_sum(after, SOURCE, source="local_compute") - metric_sum(
        before, SOURCE, source="local_compute"
    )
    hit = metric_sum(after, SOURCE, source="local_cache_hit") - metric_sum(
        before, SOURCE, source="local_cache_hit"
    )
    assert hit == 0  # D had never seen any of it
    assert loaded == shared_blocks * BLOCK
    assert computed == reference.prompt_tokens["sharing"] - shared_blocks * BLOCK


async def test_a_salted_prompt_moves_to_decode_with_its_salt_and_is_loaded_there(
    cluster: UpCluster, reference: Answers, prompts: PoolPrompts
) -> None:
    # vLLM keys a salted prompt's blocks with the salt: D's own cache (of the unsalted prompt) misses,
    # and the blocks P saved move to D's pool only because its agent checks their keys with the salt.
    case = next(c for c in _cases(prompts) if not c.chat and not c.stream)
    decode_url = cluster.instances()["decode-0"]["url"]
    body = jsonutil.dumps({**case.body(), "cache_salt": "tenant-a"})
    async with aiohttp.ClientSession() as session:
        before = await _metrics(session, decode_url)
        async with session.post(cluster.base + case.route, data=body, headers=JSON) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
            headers = resp.headers
        after = await _metrics(session, decode_url)

    def grew(source: str) -> float:
        return metric_sum(after, SOURCE, source=source) - metric_sum(before, SOURCE, source=source)

    assert (headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"]) == ("prefill-0", "decode-0")
    assert answer["choices"][0]["text"] == reference.texts[case.name]  # the salt changes no answer
    assert grew("local_cache_hit") == 0
    assert grew("external_kv_transfer") == reference.prompt_tokens[case.name] // BLOCK * BLOCK
