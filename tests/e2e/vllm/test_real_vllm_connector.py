"""The project's connector inside one real vLLM, with its agent's pool served by the test: blocks a
transfer is still landing are loaded asynchronously once they land (the engine serves other requests
meanwhile), and blocks whose transfer fails are recomputed; either way the answer is the engine's
own. A prompt prefilled over several steps sends each of its blocks to the pool once. Blocks the pool
moved to its disk tier are read back into it when the engine asks, and a corrupt file is computed
again.

The pool runs on an event loop in a thread of this process (as it runs on the agent's loop), so the
engine's worker can open it while the test waits for the engine; the test plays the landing transfer
itself: it reserves the prompt's blocks as pending, then writes them layer by layer (or marks them
failed) while the engine waits on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.e2e.vllm.pool_thread import PoolThread
from tests.e2e.vllm.support import BLOCK, MODEL, running_vllms
from tests.helpers import eventually_sync, free_ports, http_json, metric_sum, parse_prometheus
from vllm_disagg import jsonutil
from vllm_disagg.agent.kv.arena import FAILED, SlotArena
from vllm_disagg.agent.kv.pool import PrefixPool
from vllm_disagg.config import AgentConfig
from vllm_disagg.wire.block_hash import prompt_block_hashes

pytestmark = pytest.mark.timeout(1200)
T = TypeVar("T")
SOURCE = "vllm:prompt_tokens_by_source_total"
PROMPT = [(i * 7919) % 1500 + 20 for i in range(2 * BLOCK + 9)]  # two full blocks and a tail
KEYS = prompt_block_hashes(PROMPT, BLOCK)


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, PoolThread]]:
    port = free_ports(1, (0, 2000, 3000))
    cfg = AgentConfig(
        agent_id="connector-e2e", role="both", engine="vllm", model=MODEL, model_path=str(tiny_model),
        engine_port=port, kv_connector="vllm-disagg", kv_pool_capacity="64",
        extra_engine_args=("--max-num-batched-tokens", str(BLOCK)),  # a block of prefill per step
        kv_disk_dir=str(tmp_path_factory.mktemp("disk")), kv_disk_capacity="64MiB",
    )  # fmt: skip
    pool = PoolThread(cfg)
    log = tmp_path_factory.mktemp("connector") / "vllm.log"
    try:
        with running_vllms([(cfg, log)], env={cfg.agent_id: {"VLLM_SERVER_DEV_MODE": "1"}}) as (base,):
            eventually_sync(lambda: pool.call(lambda: pool.pool.node.arena is not None), timeout=60,
                            what="the engine's worker opened the pool")  # fmt: skip
            yield base, pool
    finally:
        pool.close()


def _complete(base: str, prompt: list[int] = PROMPT) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    status, answer = http_json(
        f"{base}/v1/completions", method="POST", body=jsonutil.dumps(body), timeout=120
    )
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def _sources(base: str) -> dict[str, float]:
    status, text = http_json(f"{base}/metrics")
    assert status == 200
    families = parse_prometheus(text)
    return {s: metric_sum(families, SOURCE, source=s) for s in ("local_compute", "external_kv_transfer")}


def _grown(base: str, before: dict[str, float]) -> dict[str, float]:
    """How the engine's prompt-token counters grew since ``before``."""
    after = _sources(base)
    return {source: after[source] - before[source] for source in after}


def _pool(pool: PoolThread) -> PrefixPool:
    assert pool.pool.node.pool is not None
    return pool.pool.node.pool


def _arena(pool: PoolThread) -> SlotArena:
    assert pool.pool.node.arena is not None
    return pool.pool.node.arena


def _forget(base: str, pool: PoolThread) -> None:
    """Neither the engine's prefix cache nor the pool holds the prompt any more (the arena stays: the
    engine's worker has it mapped)."""
    assert http_json(f"{base}/reset_prefix_cache", method="POST", body=b"{}")[0] == 200
    pool.call(lambda: _pool(pool).clear())


def _pinned_by_the_request(pool: PoolThread) -> bool:
    # The test's own reservation is one reference; the engine's lookup for the request is another.
    return pool.call(lambda: _pool(pool).references(KEYS[0])) >= 2


@pytest.fixture(scope="module")
def reference(engine: tuple[str, PoolThread]) -> tuple[str, dict[bytes, bytes]]:
    """The engine's answer when it computes the prompt, and the blocks it saved for it."""
    base, pool = engine
    text = _complete(base)["choices"][0]["text"]

    def saved() -> dict[bytes, bytes]:
        slots = {k: _pool(pool).slot_of(k) for k in KEYS}
        return {k: bytes(_arena(pool).block_view(s)) for k, s in slots.items() if s is not None}

    blocks = pool.call(saved)
    assert set(blocks) == set(KEYS), "the engine saved both full blocks of the prompt"
    return text, blocks


def _reserve_landing(pool: PoolThread) -> list[int]:
    """The prompt's blocks as a landing transfer holds them: pending, nothing written yet."""

    def reserve() -> list[int]:
        got = _pool(pool).reserve(
            "xfer:test", [(k, KEYS[i - 1] if i else None, ()) for i, k in enumerate(KEYS)]
        )
        for slot in got.values():
            view = _arena(pool).block_view(slot)
            view[:] = bytes(len(view))  # whatever the slot held before is not this prompt's KV
            _arena(pool).set_layers_ready(slot, 0)
        return list(got.values())

    slots = pool.call(reserve)
    assert len(slots) == len(KEYS)
    return slots


def _while_waiting(
    base: str,
    pool: PoolThread,
    land: Callable[[list[int]], None],
    meanwhile: Callable[[], None] = lambda: None,
) -> tuple[str, dict[str, float]]:
    """Ask for the prompt while a transfer holds its blocks pending; once the engine waits on them,
    ``meanwhile()``, then ``land(slots)`` plays the rest of the transfer. The answer, and how the
    engine's counters grew."""
    _forget(base, pool)
    slots = _reserve_landing(pool)
    before = _sources(base)
    with ThreadPoolExecutor(1) as ex:
        answer = ex.submit(_complete, base)
        eventually_sync(lambda: _pinned_by_the_request(pool), timeout=60, what="the landing blocks pinned")
        meanwhile()
        assert not answer.done(), "the request waits for its blocks"
        land(slots)
        text = answer.result(120)["choices"][0]["text"]
    return text, _grown(base, before)


def test_blocks_still_landing_are_loaded_once_they_land_and_the_engine_serves_others_meanwhile(
    engine: tuple[str, PoolThread], reference: tuple[str, dict[bytes, bytes]]
) -> None:
    base, pool = engine
    text, blocks = reference
    others: list[str] = []

    def meanwhile() -> None:  # the engine is not stuck on the landing blocks: another prompt is answered
        others.append(_complete(base, [t + 1 for t in PROMPT[:40]])["choices"][0]["text"])

    def land(slots: list[int]) -> None:
        arena = _arena(pool)
        size = arena.geometry.layer_block_bytes
        for layer in range(arena.geometry.num_layers):  # as a transfer lands them: a layer at a time
            for key, slot in zip(KEYS, slots, strict=True):
                arena.layer_view(slot, layer)[:] = blocks[key][layer * size : (layer + 1) * size]
                arena.set_layers_ready(slot, layer + 1)
        pool.call(lambda: (_pool(pool).commit("xfer:test", KEYS), _pool(pool).release("xfer:test")))

    answer, grew = _while_waiting(base, pool, land, meanwhile)
    assert answer == text and len(others) == 1
    assert grew["external_kv_transfer"] == len(KEYS) * BLOCK
    assert grew["local_compute"] == len(PROMPT) - len(KEYS) * BLOCK + 40


def test_a_prompt_prefilled_over_several_steps_sends_each_block_to_the_pool_once(
    engine: tuple[str, PoolThread],
) -> None:
    base, pool = engine
    prompt = [(i * 104729) % 1500 + 20 for i in range(3 * BLOCK + 5)]  # three steps of prefill
    service = pool.pool.service
    before = pool.call(lambda: service.offered)
    _complete(base, prompt)
    keys = prompt_block_hashes(prompt, BLOCK)
    assert pool.call(lambda: [k in _pool(pool) for k in keys]) == [True, True, True]
    assert pool.call(lambda: service.offered) - before == len(keys)


def test_blocks_whose_transfer_fails_are_recomputed_and_the_answer_is_the_same(
    engine: tuple[str, PoolThread], reference: tuple[str, dict[bytes, bytes]]
) -> None:
    base, pool = engine
    text, _ = reference

    def fail(slots: list[int]) -> None:
        for slot in slots:  # the transfer died: what the landing side marks, then lets go
            _arena(pool).set_layers_ready(slot, FAILED)
        pool.call(lambda: _pool(pool).release("xfer:test"))

    answer, grew = _while_waiting(base, pool, fail)
    assert answer == text
    # The connector reported the blocks as load errors with the receive, before vLLM scheduled the
    # request: it computed the whole prompt (the slots hold zeros: see the next test for what loading
    # them gives).
    assert grew == {"local_compute": len(PROMPT), "external_kv_transfer": 0}


def test_what_lands_is_what_the_engine_uses(
    engine: tuple[str, PoolThread], reference: tuple[str, dict[bytes, bytes]]
) -> None:
    """The contrast to the failed transfer: the same zeroed blocks, said to have landed, are loaded,
    and the answer is not the engine's own."""
    base, pool = engine
    text, _ = reference
    _forget(base, pool)
    slots = _reserve_landing(pool)
    for slot in slots:
        _arena(pool).set_layers_ready(slot, _arena(pool).geometry.num_layers)
    pool.call(lambda: (_pool(pool).commit("xfer:test", KEYS), _pool(pool).release("xfer:test")))
    assert _complete(base)["choices"][0]["text"] != text


def _to_disk(pool: PoolThread) -> None:
    """Every block of the pool goes to its disk tier and leaves memory, as eviction does one by one."""

    def move() -> None:
        assert all(key in _pool(pool) for key in KEYS)
        assert pool.pool.node.spill_all() == len(_pool(pool))
        _pool(pool).clear()

    pool.call(move)


def _after_disk(
    base: str, pool: PoolThread, damage: Callable[[Path], None] | None = None
) -> tuple[str, dict[str, float]]:
    _forget(base, pool)
    _complete(base)  # computed and saved
    _to_disk(pool)
    assert http_json(f"{base}/reset_prefix_cache", method="POST", body=b"{}")[0] == 200
    if damage is not None:
        disk = pool.pool.node.disk
        assert disk is not None
        damage(disk.directory / (KEYS[1].hex() + ".kvb"))
    before = _sources(base)
    text = _complete(base)["choices"][0]["text"]
    return text, _grown(base, before)


def test_blocks_on_the_disk_tier_are_read_back_and_loaded(
    engine: tuple[str, PoolThread], reference: tuple[str, dict[bytes, bytes]]
) -> None:
    base, pool = engine
    text, _ = reference
    answer, grew = _after_disk(base, pool)
    assert answer == text
    assert grew["external_kv_transfer"] == len(KEYS) * BLOCK  # both blocks, from disk via the pool
    assert grew["local_compute"] == len(PROMPT) - len(KEYS) * BLOCK
    disk = pool.pool.node.disk
    assert disk is not None and pool.call(lambda: disk.stats().loads) >= len(KEYS)


def test_a_corrupt_block_file_is_computed_and_the_answer_is_the_engine_s_own(
    engine: tuple[str, PoolThread], reference: tuple[str, dict[bytes, bytes]]
) -> None:
    base, pool = engine
    text, _ = reference

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a payload byte: only the checksum can tell
        path.write_bytes(bytes(data))

    answer, grew = _after_disk(base, pool, flip)
    assert answer == text
    assert grew["external_kv_transfer"] == BLOCK  # the first block; the second is computed
    assert grew["local_compute"] == len(PROMPT) - BLOCK
