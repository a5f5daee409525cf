"""Recovery on real vLLM: engines killed under load, clients that leave, and nothing lost.

On the package's 1P1D cluster (conftest.py), after test_handoff.py:

- clients that leave at random points, mid-prefill included, leave no KV held on the prefill engine;
- the decode engine is SIGKILLed mid-stream: both streams resume on the instance left (the prefill
  engine, serving by itself) and each equals the reference, token for token;
- the prefill engine is frozen with requests inside and SIGKILLed: every request still completes,
  colocated on the decode engine, with the reference's tokens.

Each recovered request's trace (the package's OTLP receiver) shows the leg that took over, with the
surviving engine's own span under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal

import aiohttp
import pytest

from tests.e2e.vllm.nixl.cluster import Cluster, metrics
from tests.e2e.vllm.reference import Book, LongCase, long_cases, short_cases
from tests.e2e.vllm.support import JSON, Case, ask
from tests.helpers import eventually, eventually_sync, http_json, metric_sum, parse_prometheus, sse_text
from tests.otlp_receiver import ThreadedReceiver
from vllm_disagg import jsonutil
from vllm_disagg.procfs import group_members

pytestmark = pytest.mark.timeout(1800)
# How soon after P's last prefill the gateway must have freed the KV of clients that left: far below
# P's own lease (cluster.KV_LEASE_S), so a slow machine is not mistaken for a leak.
IDLE_WITHIN_S = 120
TRIES = 3  # pairs of long streams started, until the kill cuts one under way


@pytest.fixture(scope="module")
def reference(reference_book: Book, prompts: list[str]) -> dict[str, str]:
    return reference_book.answers([*long_cases(prompts), *short_cases(prompts)]).texts


def _engine_under(traces: ThreadedReceiver, request_id: str, leg: str, instance: str) -> bool:
    """Whether the request's trace holds a ``leg`` span with ``instance``'s vLLM span under it."""
    roots = [s for s in traces.spans if s.attributes.get("vllm_disagg.request_id") == request_id]
    if not roots:
        return False
    spans = traces.trace(roots[0].trace_id)
    legs = {s.span_id for s in spans if s.name == leg and s.parent_id == roots[0].span_id}
    return any(
        s.name == "llm_request" and s.parent_id in legs and s.resource.get("vllm_disagg.instance") == instance
        for s in spans
    )


def _kv_usage(url: str) -> float:
    return metric_sum(metrics(url), "vllm:kv_cache_usage_perc")


async def test_clients_that_leave_at_random_points_leave_no_kv_held_on_the_prefill_engine(
    cluster: Cluster, prompts: list[str]
) -> None:
    await cluster.both_ready()
    prefill_url = str(cluster.instances()["prefill-0"]["url"])
    rng = random.Random(9)
    async with aiohttp.ClientSession() as session:

        async def leave(i: int) -> None:
            # A new prompt each time (no prefix-cache shortcut), abandoned after a random moment:
            # during the prefill, between the legs, or during the decode.
            case = Case(f"leave-{i}", i % 2 == 1, i % 3 == 0, f"Leaving {i}. " + prompts[i % 8])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rng.uniform(0.0, 1.5)):
                    await ask(session, cluster.base, case)

        for start in range(0, 50, 5):  # 50 in all, 5 at a time
            await asyncio.gather(*(leave(i) for i in range(start, start + 5)))

        def no_work() -> bool:
            # The abandoned prefills run to their end (the gateway lets them, to hand their KV over):
            # on a loaded 2-core machine that takes a while. Blocks held after that are the leak.
            samples = metrics(prefill_url)
            return (
                metric_sum(samples, "vllm:num_requests_running")
                + metric_sum(samples, "vllm:num_requests_waiting")
                == 0
            )

        await eventually(no_work, timeout=120, interval=0.2, what="P done with every abandoned prefill")

        def idle() -> bool:
            return _kv_usage(prefill_url) == 0.0

        # P keeps an abandoned prefill's blocks for its lease (KV_LEASE_S here) unless the gateway
        # frees them: back at idle well within the lease is the gateway's doing, however slow the box.
        try:
            await eventually(idle, timeout=IDLE_WITHIN_S, interval=0.2, what="P's KV cache back at idle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: kv_cache_usage_perc {_kv_usage(prefill_url)}") from None
        status, text = http_json(f"{cluster.base}/metrics")
        assert status == 200 and isinstance(text, str)
        released = metric_sum(parse_prometheus(text), "vllm_disagg_kv_released_total")
        assert released > 0, "some clients left during a prefill, and their KV was released"


async def _pair_under_way(
    cluster: Cluster, session: aiohttp.ClientSession, cases: list[LongCase], ids: list[str]
) -> tuple[list[asyncio.Task[bytes]], bool]:
    """The streams started together; True once each has 8 events, False if one ended before that."""
    events = [0] * len(cases)

    async def stream(n: int, case: LongCase) -> bytes:
        body = jsonutil.dumps(case.body())
        headers = {**JSON, "X-Request-Id": ids[n]}
        async with session.post(cluster.base + case.route, data=body, headers=headers) as resp:
            assert resp.status == 200
            raw = b""
            async for chunk in resp.content.iter_any():
                raw += chunk
                events[n] = raw.count(b"\n\n")
            return raw

    tasks = [asyncio.ensure_future(stream(n, c)) for n, c in enumerate(cases)]
    try:
        await eventually(
            lambda: min(events) >= 8 or any(t.done() for t in tasks),
            timeout=300,
            what="both streams under way",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{await cluster.explain(session, ids, events)}") from None
    return tasks, min(events) >= 8


async def test_a_decode_engine_killed_mid_stream_resumes_and_every_stream_equals_the_reference(
    cluster: Cluster, prompts: list[str], reference: dict[str, str], traces: ThreadedReceiver
) -> None:
    cases = long_cases(prompts)
    async with aiohttp.ClientSession() as session:
        for attempt in range(1, TRIES + 1):
            await cluster.both_ready()  # the engine a previous attempt killed is back
            # Found before the streams start: the search reads /proc, which on a loaded machine took
            # long enough for a 96-token stream to end before the kill.
            pgid = cluster.engine_group("decode-0")
            ids = [f"{case.name}-{attempt}" for case in cases]
            tasks, under_way = await _pair_under_way(cluster, session, cases, ids)
            if under_way:
                os.killpg(pgid, signal.SIGKILL)
            raws = await asyncio.gather(*tasks)
            resumed = 0
            for case, request_id, raw in zip(cases, ids, raws, strict=True):
                # Whatever was cut: no error event (the tiny model may say "error" in its text), whole.
                assert b'data: {"error"' not in raw and raw.endswith(b"data: [DONE]\n\n"), raw[-500:]
                assert sse_text(raw, chat=case.chat) == reference[case.name], case.name
                record = await cluster.record(session, request_id)
                assert record["status"] == 200, record["attempts"]
                last = record["attempts"][-1]
                if record["resumes"]:
                    assert (last["leg"], last["outcome"]) == ("resume", "ok"), record["attempts"]
                    resumed += 1
                    took_over = (record["request_id"], last["instance"])  # the spans' id: the gateway's
                else:  # it had ended before the kill (or nothing was killed): on its decode leg, whole
                    assert (last["leg"], last["outcome"]) == ("decode", "ok"), record["attempts"]
            if resumed:
                break
            # Nothing was cut: one stream ran to its end before the other was under way, or both ended
            # before the kill landed (a loaded machine). Both were whole; the pair starts again.
        else:
            raise AssertionError(f"in {TRIES} tries, the kill never cut a stream under way")
    eventually_sync(lambda: not group_members({pgid}), timeout=60, what="the killed engine gone")
    request_id, instance = took_over
    await eventually(
        lambda: _engine_under(traces, request_id, "resume", instance),
        timeout=60,
        what=f"{request_id}'s resume leg with {instance}'s vLLM span under it",
    )


async def test_a_prefill_engine_killed_with_requests_inside_still_answers_every_one_like_the_reference(
    cluster: Cluster, prompts: list[str], reference: dict[str, str], traces: ThreadedReceiver
) -> None:
    await cluster.both_ready()  # the decode engine is back after the previous test
    pgid = cluster.engine_group("prefill-0")
    os.killpg(pgid, signal.SIGSTOP)  # frozen: requests sent now wait inside the prefill engine
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            cases = short_cases(prompts)
            tasks = [asyncio.ensure_future(ask(session, cluster.base, c)) for c in cases]
            await eventually(
                lambda: cluster.instances()["prefill-0"]["in_flight"] == len(cases),
                timeout=60,
                what="all on P",
            )
            os.killpg(pgid, signal.SIGKILL)
            answers = await asyncio.gather(*tasks)
    finally:
        if group_members({pgid}):
            os.killpg(pgid, signal.SIGKILL)
    for case, (text, _, headers) in zip(cases, answers, strict=True):
        assert text == reference[case.name], case.name
        assert (headers["X-Disagg-Mode"], headers["X-Disagg-Decode"]) == ("colocated", "decode-0")
    request_id = answers[0][2]["X-Disagg-Request-Id"]  # the engines' and spans' id: the gateway's own
    await eventually(
        lambda: _engine_under(traces, request_id, "decode", "decode-0"),
        timeout=60,
        what=f"{request_id}'s decode leg, after its failed prefill, with decode-0's vLLM span under it",
    )
    # The retried request's one trace: the prefill leg that failed on prefill-0, then the fallback.
    root = next(s for s in traces.spans if s.attributes.get("vllm_disagg.request_id") == request_id)
    failed = [
        s
        for s in traces.trace(root.trace_id)
        if s.name == "prefill" and s.parent_id == root.span_id and s.status == 2  # error
    ]
    assert [s.attributes["vllm_disagg.instance"] for s in failed] == ["prefill-0"], failed
    assert "fallback" in root.events, root.events
