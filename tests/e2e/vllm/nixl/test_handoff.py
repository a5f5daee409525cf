"""Real vLLM under the agents: 1P1D with NIXL on CPU is token-identical to one colocated vLLM.

The tiny model is built offline at test time. One plain vLLM (no KV connector) has answered every
request (the reference book); the package's ``vllm-disagg up`` 1P1D (two agents, two vLLM engines,
NIXL) then answers the same requests through the gateway. Nothing has been killed yet: the recovery
and role modules come after (conftest.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp
import pytest

from tests.e2e.vllm.nixl.cluster import Cluster
from tests.e2e.vllm.reference import Book, concurrent_cases, routes_and_modes
from tests.e2e.vllm.support import BLOCK, JSON, MAX_TOKENS, MODEL, Answers, Case, ask
from tests.helpers import ADMIN, eventually, http_json, metric_sum, parse_prometheus
from tests.otlp_receiver import ThreadedReceiver
from vllm_disagg import jsonutil

pytestmark = pytest.mark.timeout(1800)


def _cases(prompts: list[str]) -> list[Case]:
    return routes_and_modes(prompts[:4])


@pytest.fixture(scope="module")
def reference(reference_book: Book, prompts: list[str]) -> Answers:
    return reference_book.answers(_cases(prompts) + concurrent_cases(prompts))


def test_reference_prompts_are_longer_than_two_kv_blocks(reference: Answers) -> None:
    assert len(reference.prompt_tokens) >= 4 + 16
    assert all(n > 2 * BLOCK for n in reference.prompt_tokens.values()), reference.prompt_tokens


async def test_1p1d_output_is_token_identical_to_colocated_and_the_kv_travelled(
    cluster: Cluster, reference: Answers, prompts: list[str]
) -> None:
    decode_url = cluster.instances()["decode-0"]["url"]
    async with aiohttp.ClientSession() as session:

        async def decode_metrics() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
            async with session.get(f"{decode_url}/metrics") as resp:
                return parse_prometheus(await resp.text())

        before = await decode_metrics()
        # Every route and mode, one at a time.
        for case in _cases(prompts):
            text, _, headers = await ask(session, cluster.base, case)
            assert headers["X-Disagg-Mode"] == "disaggregated", case.name
            assert (headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"]) == ("prefill-0", "decode-0")
            assert text == reference.texts[case.name], case.name
        # Sixteen at once.
        concurrent = concurrent_cases(prompts)
        answers = await asyncio.gather(*(ask(session, cluster.base, c) for c in concurrent))
        for case, (text, _, headers) in zip(concurrent, answers, strict=True):
            assert headers["X-Disagg-Mode"] == "disaggregated"
            assert text == reference.texts[case.name], case.name
        after = await decode_metrics()

        async def audit() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
            async with session.get(f"{cluster.base}/metrics") as resp:
                return parse_prometheus(await resp.text())

        requests = len(_cases(prompts)) + len(concurrent)

        # The orchestrator's KV audit judges every leg from D's counters once a scrape includes it.
        async def judged() -> bool:
            return (
                metric_sum(await audit(), "vllm_disagg_kv_audited_legs_total", outcome="loaded") >= requests
            )

        await eventually(judged, timeout=180, what="every decode leg audited as loaded")
        orchestrator = await audit()

    assert metric_sum(orchestrator, "vllm_disagg_kv_audited_legs_total", outcome="recomputed") == 0
    assert metric_sum(orchestrator, "vllm_disagg_kv_recomputed_total") == 0

    def grew(source: str) -> float:
        name = "vllm:prompt_tokens_by_source_total"
        return metric_sum(after, name, source=source) - metric_sum(before, name, source=source)

    # What the KV audit relies on: every prompt token D did not compute, it pulled or found cached.
    handed = sum(
        reference.prompt_tokens[c.name.replace("-stream-", "-nonstream-")]
        for c in _cases(prompts) + concurrent
    )
    assert grew("external_kv_transfer") + grew("local_cache_hit") == handed
    assert grew("local_compute") == 0
    # A prompt D has seen before is a local prefix-cache hit there; the first time, its KV must come
    # from P. Distinct prompts: the 4 completions, their 4 chat forms, and the 12 other concurrent ones.
    first_seen = [f"{kind}-nonstream-{i}" for kind in ("completions", "chat") for i in range(4)]
    first_seen += [f"concurrent-{i}" for i in range(4, len(concurrent))]
    full_blocks = sum(reference.prompt_tokens[name] // BLOCK * BLOCK for name in first_seen)
    all_full_blocks = sum(
        reference.prompt_tokens[c.name.replace("-stream-", "-nonstream-")] // BLOCK * BLOCK
        for c in _cases(prompts) + concurrent
    )
    assert grew("external_kv_transfer") >= full_blocks
    assert grew("external_kv_transfer") + grew("local_cache_hit") >= all_full_blocks
    assert grew("local_compute") < BLOCK * requests
    assert metric_sum(after, "vllm:nixl_num_failed_transfers_total") == 0
    assert metric_sum(after, "vllm:nixl_bytes_transferred_sum") > metric_sum(
        before, "vllm:nixl_bytes_transferred_sum"
    )


async def test_agents_report_what_they_scrape_from_real_vllm(cluster: Cluster, prompts: list[str]) -> None:
    cases = concurrent_cases(prompts)
    async with aiohttp.ClientSession() as session:
        for case in cases[:2]:
            await ask(session, cluster.base, case)
        sent = time.monotonic()

        # Each agent's windowed snapshot (TTFT/TPOT from histogram deltas over its last 10 s) reflects
        # real vLLM /metrics. A machine that stalls for longer than the window (a CI run once froze for
        # 15 s) ages the requests out of it before anyone looks: then one more request is sent.
        async def scraped() -> dict[str, dict[str, Any]] | None:
            nonlocal sent
            metrics = {a: i["metrics"] for a, i in cluster.instances().items()}
            done = all(m["requests_finished"] > 0 and m["prompt_tokens"] > 0 for m in metrics.values())
            latency = metrics["decode-0"]["ttft_s"] is not None and metrics["decode-0"]["tpot_s"] is not None
            if done and latency:
                return metrics
            if time.monotonic() - sent > 5:
                await ask(session, cluster.base, cases[0])
                sent = time.monotonic()
            return None

        metrics = await eventually(scraped, timeout=60, what="agents' snapshots of vLLM metrics")
    decode = metrics["decode-0"]
    assert decode["generation_tokens"] >= MAX_TOKENS
    assert decode["ttft_s"] is not None and decode["ttft_s"] > 0
    assert decode["tpot_s"] is not None and decode["tpot_s"] > 0
    assert 0 <= decode["kv_cache_usage"] <= 1
    # The prefill engine generated exactly one token per request it served.
    assert metrics["prefill-0"]["generation_tokens"] == metrics["prefill-0"]["requests_finished"]


async def _explained(
    session: aiohttp.ClientSession, base: str, case: Case, request_id: str
) -> dict[str, Any]:
    body = case.body()
    headers = {**JSON, "X-Request-Id": request_id}
    async with session.post(base + case.route, data=jsonutil.dumps(body), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    async with session.get(f"{base}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
        assert resp.status == 200
        record: dict[str, Any] = await resp.json()
        return record


def _indexed_blocks(base: str, agent_id: str) -> float:
    status, text = http_json(f"{base}/metrics")
    assert status == 200 and isinstance(text, str)
    return metric_sum(parse_prometheus(text), "vllm_disagg_kv_index_blocks", instance=agent_id)


def _index_state(cluster: Cluster, request: dict[str, Any]) -> str:
    """What a failure of the index test needs said: both counts, the instance, how the request ran."""
    status, text = http_json(f"{cluster.base}/metrics")
    samples = parse_prometheus(text) if status == 200 and isinstance(text, str) else {}
    events = cluster.prefill_blocks
    prefill = cluster.instances()["prefill-0"]
    counts = {
        name: metric_sum(samples, f"vllm_disagg_{name}", instance="prefill-0")
        for name in ("kv_index_blocks", "kv_events_total", "kv_events_missed_total")
    }
    return (
        f"engine holds {len(events.blocks())} blocks ({events.keyed} keyed, {events.batches} batches); "
        f"orchestrator {counts}; prefill-0 {[prefill.get(k) for k in ('state', 'session', 'engine_state')]}; "
        f"request {[request.get(k) for k in ('mode', 'prefill', 'status', 'fallback', 'attempts')]}"
    )


async def test_the_index_follows_the_prefill_engines_kv_events_and_scores_a_repeat_as_a_hit(
    cluster: Cluster, prompts: list[str]
) -> None:
    async with aiohttp.ClientSession() as session:
        attempts = itertools.count()

        async def warm() -> bool | None:
            i = next(attempts)
            case = Case("warm", False, False, f"Warm-up {i}. " + prompts[5])
            record = await _explained(session, cluster.base, case, f"warm-{i}")
            return True if record["explanation"]["request"]["tokenized"] else None

        await eventually(warm, timeout=120, interval=0.5, what="the gateway's tokenizer loaded")

        def agreed() -> frozenset[int] | None:
            # The index equals the engine's blocks once the agent has forwarded all the engine
            # published. Compare at such moments only: P's agent forwards a moment after the engine
            # publishes (seconds on a loaded host), so counts read at one instant may differ.
            held = cluster.prefill_blocks.blocks()
            return held if held and _indexed_blocks(cluster.base, "prefill-0") == len(held) else None

        before = await eventually(agreed, timeout=60, what="the index equal to P's blocks")
        sent: list[tuple[Case, dict[str, Any]]] = []

        async def prefilled_on_p() -> tuple[Case, dict[str, Any]] | None:
            # A prompt run colocated reaches D only, and P's blocks stay as they were: try a new one.
            # (The gateway avoids P while the P->D link's breaker is open: it opens after decode legs
            # that recomputed the prompt, e.g. when a machine-wide stall let P's KV lease expire.)
            case = Case("fresh", False, False, f"A prompt never sent before ({len(sent)}). " + prompts[6])
            sent.append((case, await _explained(session, cluster.base, case, f"index-first-{len(sent)}")))
            record = sent[-1][1]
            return sent[-1] if (record["mode"], record["prefill"]) == ("disaggregated", "prefill-0") else None

        try:
            fresh, first = await eventually(prefilled_on_p, timeout=120, interval=1.0, what="a prompt on P")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {_index_state(cluster, sent[-1][1] if sent else {})}") from None
        prompt_tokens = first["explanation"]["request"]["prompt_tokens"]
        full = prompt_tokens // BLOCK

        def grown() -> int | None:
            held = agreed()
            return len(held - before) if held is not None and held - before else None

        try:
            new_blocks = await eventually(grown, timeout=60, what="the index equal to P's blocks again")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {_index_state(cluster, first)}") from None
        # P reported the prompt's full blocks (and nothing of it was cached before).
        assert new_blocks == full >= 2
        assert "prefill-0" not in first["explanation"]["request"]["cached_tokens"]

        again = await _explained(session, cluster.base, fresh, "index-repeat")
    request = again["explanation"]["request"]
    assert request["tokenized"] is True and request["prompt_tokens"] == prompt_tokens
    assert request["cached_tokens"]["prefill-0"] == full * BLOCK
    (row,) = again["explanation"]["prefill"]["candidates"]
    assert row["id"] == "prefill-0"
    assert row["scores"]["prefix-scorer"] == pytest.approx(full * BLOCK / prompt_tokens, abs=1e-5)


async def test_one_trace_holds_the_gateways_spans_and_both_vllm_engines_spans_under_their_legs(
    cluster: Cluster, traces: ThreadedReceiver, prompts: list[str]
) -> None:
    trace_id, client_span = "5b8aa5a2d2c872e8321cf37308d69df2", "051581bf3cb55c13"
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 4, "temperature": 0}
    headers = {**JSON, "X-Request-Id": "traced-real", "traceparent": f"00-{trace_id}-{client_span}-01"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(cluster.base + "/v1/completions", data=jsonutil.dumps(body), headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        assert r.headers["X-Disagg-Mode"] == "disaggregated"

    def whole() -> bool:  # each process exports in batches (every 5 s by default)
        names = [s.name for s in traces.trace(trace_id)]
        return names.count("llm_request") == 2 and "POST /v1/completions" in names and "decode" in names

    await eventually(whole, timeout=60, what="the gateway's and both engines' spans")
    spans = traces.trace(trace_id)
    [root] = [s for s in spans if s.name == "POST /v1/completions"]
    assert (root.parent_id, root.service) == (client_span, "vllm-disagg")
    legs = {s.name: s for s in spans if s.parent_id == root.span_id and s.name in ("prefill", "decode")}
    engines = {str(s.resource["vllm_disagg.instance"]): s for s in spans if s.name == "llm_request"}
    assert engines["prefill-0"].parent_id == legs["prefill"].span_id, "P's span under the prefill leg"
    assert engines["decode-0"].parent_id == legs["decode"].span_id, "D's span under the decode leg"
    assert {s.service for s in engines.values()} == {"vllm"}
    for leg in legs.values():
        assert root.start_ns <= leg.start_ns <= leg.end_ns <= root.end_ns
