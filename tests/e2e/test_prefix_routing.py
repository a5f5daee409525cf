"""Prefix-aware routing on a simulated 4P4D cluster started through ``vllm-disagg up``.

Eight conversations grow turn by turn, interleaved. Each turn's prompt extends the previous one, so
the prefill instance that served turn k holds the longest cached prefix of turn k+1. The scheduler,
fed by the engines' KV events, must send turn k+1 there; pinning prefill round-robin (the client
override) is the baseline, and lands there about a quarter of the time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.e2e.up_support import Cluster, start_up, stop
from tests.helpers import ADMIN, metric_sum, parse_prometheus
from vllm_disagg import jsonutil

MODEL = "sim-model"
PREFILL = 4
CONVERSATIONS = 8
TURNS = 6
BLOCK = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = start_up(tmp_path_factory.mktemp("up4p4d"), PREFILL, 4)
    yield running
    stop(running)


def _turn_order(seed: int) -> list[tuple[int, int]]:
    """(conversation, turn) pairs, conversations interleaved at random, turns of each in order."""
    rng = random.Random(seed)
    pending = {c: 0 for c in range(CONVERSATIONS)}
    order = []
    while pending:
        c = rng.choice(sorted(pending))
        order.append((c, pending[c]))
        pending[c] += 1
        if pending[c] == TURNS:
            del pending[c]
    return order


def _prompt(phase: str, conversation: int, turn: int) -> str:
    system = f"[{phase}] conversation {conversation}: you are a careful assistant. " * 8
    turns = "".join(
        f"user turn {t} of {conversation}: tell me more about topic {t * 7 % 13}. " for t in range(turn + 1)
    )
    return system + turns


async def _prefill_hits(session: aiohttp.ClientSession, cluster: Cluster) -> float:
    total = 0.0
    for item in cluster.instances():
        if item["role"] == "prefill":
            async with session.get(f"{item['url']}/metrics") as resp:
                total += metric_sum(parse_prometheus(await resp.text()), "vllm:prefix_cache_hits_total")
    return total


async def _run_phase(
    session: aiohttp.ClientSession, cluster: Cluster, phase: str, *, round_robin: bool
) -> tuple[float, float, list[str]]:
    """Serve every turn; returns (share of turns sent to the previous turn's P, engine hit ratio, ids)."""
    served: dict[int, str] = {}  # conversation -> prefill instance of its last turn
    prompt_of: dict[int, str] = {}
    landed = follow_ups = 0
    ideal_hits = 0
    request_ids = []
    hits_before = await _prefill_hits(session, cluster)
    for n, (c, turn) in enumerate(_turn_order(seed=len(phase))):
        prompt = _prompt(phase, c, turn)
        request_id = f"{phase}-{c}-{turn}"
        headers = {"X-Request-Id": request_id}
        if round_robin:
            headers["X-Disagg-Prefill"] = f"prefill-{n % PREFILL}"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        async with session.post(
            f"{cluster.base}/v1/completions", data=jsonutil.dumps(body), headers=headers
        ) as resp:
            assert resp.status == 200, await resp.text()
            prefill = resp.headers["X-Disagg-Prefill"]
        if c in served:
            follow_ups += 1
            landed += prefill == served[c]
            ideal_hits += len(prompt_of[c].encode()) // BLOCK * BLOCK
        served[c], prompt_of[c] = prefill, prompt
        request_ids.append(request_id)
    engine_ratio = (await _prefill_hits(session, cluster) - hits_before) / ideal_hits
    return landed / follow_ups, engine_ratio, request_ids


async def test_turns_land_on_the_prefill_instance_holding_their_prefix(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as session:
        baseline, _, _ = await _run_phase(session, cluster, "rr", round_robin=True)
        ours, engine_ratio, ids = await _run_phase(session, cluster, "prefix", round_robin=False)

        async def record(request_id: str) -> dict[str, Any]:
            async with session.get(f"{cluster.base}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
                assert resp.status == 200
                found: dict[str, Any] = await resp.json()
                return found

        last = await record(ids[-1])
    assert baseline < 0.5, f"round-robin landed on the holder {baseline:.0%} of the time (expected about 25%)"
    assert ours >= 0.9, f"prefix-aware routing landed on the holder only {ours:.0%} of the time"
    # The engines agree: their prefix caches served (nearly) every previous turn's full blocks.
    assert engine_ratio >= 0.9, engine_ratio
    explanation = last["explanation"]
    assert explanation["request"]["tokenized"] is True
    pick = explanation["prefill"]["pick"]
    assert pick == last["prefill"]
    scores = {row["id"]: row["scores"]["prefix-scorer"] for row in explanation["prefill"]["candidates"]}
    assert scores[pick] == max(scores.values()) > 0.5, scores
    assert set(last["timeline"]) >= {
        "scheduled",
        "prefill_start",
        "prefill_end",
        "decode_start",
        "last_token",
    }
