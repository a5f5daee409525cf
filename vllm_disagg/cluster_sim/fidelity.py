"""The simulator against a live cluster: a trace whose prompts a small vocabulary can carry, and a
client that replays it against a gateway, measuring each request as the simulator's ``Outcome`` does.

``token_trace`` draws a seeded open-loop workload whose prompts are token ids below ``vocab`` (the
simulated model has 320), so the very ids the simulator routes and caches on are the ones a real
engine accepts. ``replay`` sends each request at its arrival time, streamed, with ``X-Request-Id``
``req-{n}`` as ``Cluster`` names it, and times it client-side: TTFT from the send to the first
streamed token, TPOT = (last token - first token) / (n - 1).
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest, block_token_ids, prompt_token_ids

_JSON = {"Content-Type": "application/json"}


@functools.cache
def _one_token_blocks() -> dict[int, int]:
    """Token id -> a block id whose one-token block is that token (``block_token_ids`` maps ids to
    tokens one to one, a multiplication modulo its vocabulary: the first 2**16 ids spell them all)."""
    spelled: dict[int, int] = {}
    for block_id in range(1 << 16):
        spelled.setdefault(block_token_ids(block_id, 1)[0], block_id)
    return spelled


def token_request(at_s: float, token_ids: Sequence[int], output_tokens: int) -> TraceRequest:
    """A trace request whose prompt is exactly ``token_ids`` (``prompt_token_ids`` gives them back).

    Its blocks are single tokens, so its ids say nothing of shared prefixes (``traces.describe``
    cannot read them); what is shared is what the token ids share.
    """
    spelled = _one_token_blocks()
    missing = [t for t in token_ids if t not in spelled]
    if missing:
        raise ValueError(f"token ids {missing[:5]} are beyond the traces' vocabulary")
    return TraceRequest(at_s, len(token_ids), output_tokens, tuple(spelled[t] for t in token_ids), 1)


def token_trace(
    *,
    seed: int,
    rate_per_s: float,
    duration_s: float,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    vocab: int,
    name: str = "fidelity",
) -> Trace:
    """Poisson arrivals over ``duration_s``; prompts of random token ids below ``vocab`` and lengths
    uniform in ``prompt_tokens`` (inclusive), outputs uniform in ``output_tokens``. Random ids make a
    shared cached block (16 tokens) vanishingly rare: every prompt costs its full prefill."""
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    t = 0.0
    while t <= duration_s:
        ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_tokens))]
        requests.append(token_request(t, ids, rng.randint(*output_tokens)))
        t += rng.expovariate(rate_per_s)
    return Trace(name, requests, f"seed={seed} rate={rate_per_s}/s over {duration_s} s")


@dataclass(frozen=True, slots=True)
class Measured:
    """One replayed request as its client saw it (``ttft_s``/``tpot_s`` as ``Outcome`` defines them)."""

    request_id: str
    sent_s: float  # since the replay began
    ok: bool
    status: int
    output_tokens: int  # tokens streamed
    ttft_s: float | None
    tpot_s: float | None
    mode: str
    prefill: str
    decode: str
    error: str = ""


def _tokens(event: bytes) -> int:
    """Output tokens in one SSE event (a completion or chat chunk); -1 for an error event."""
    payload = jsonutil.loads(event)
    if not isinstance(payload, dict):
        return 0
    if "error" in payload:
        return -1
    n = 0
    for choice in payload.get("choices") or ():
        delta = choice.get("delta")
        text = choice.get("text") if delta is None else delta.get("content")
        n += 1 if text else 0
    return n


async def complete(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    request_id: str,
    request: TraceRequest,
    *,
    origin: float | None = None,
) -> Measured:
    """Stream one completion of ``request`` (its token ids as the prompt, ``max_tokens`` its output)
    and time it; ``origin``: the ``perf_counter`` that ``sent_s`` counts from."""
    body = {
        "model": model,
        "prompt": prompt_token_ids(request),
        "max_tokens": request.output_tokens,
        "stream": True,
    }
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    error = ""
    headers = {**_JSON, "X-Request-Id": request_id}
    async with session.post(f"{base_url}/v1/completions", data=jsonutil.dumps(body), headers=headers) as resp:
        status = resp.status
        where = resp.headers
        if status != 200:
            error = (await resp.read()).decode(errors="replace")[:300]
        else:
            buffer = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                *events, buffer = (buffer + chunk).split(b"\n\n")
                fresh = 0
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    n = _tokens(event[6:])
                    if n < 0:
                        error = event[6:].decode(errors="replace")[:300]
                    else:
                        fresh += n
                if fresh:
                    if not tokens:
                        first = now
                    last = now
                    tokens += fresh
    ok = status == 200 and not error and tokens == request.output_tokens
    return Measured(
        request_id=request_id,
        sent_s=sent - (sent if origin is None else origin),
        ok=ok,
        status=status,
        output_tokens=tokens,
        ttft_s=first - sent if tokens else None,
        tpot_s=(last - first) / (tokens - 1) if tokens > 1 else None,
        mode=where.get("X-Disagg-Mode", ""),
        prefill=where.get("X-Disagg-Prefill", ""),
        decode=where.get("X-Disagg-Decode", ""),
        error=error or ("" if ok else f"{tokens} of {request.output_tokens} tokens"),
    )


async def replay(base_url: str, trace: Trace, model: str, *, timeout_s: float = 60.0) -> list[Measured]:
    """Send every request of ``trace`` at its arrival time (open loop: nobody waits for an answer),
    as ``req-{n}``; each request's measurement, in trace order."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    loop = asyncio.get_running_loop()
    first_at = trace.requests[0].at_s if trace.requests else 0.0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        origin = time.perf_counter()
        start = loop.time()

        async def one(n: int, request: TraceRequest) -> Measured:
            await asyncio.sleep(max(0.0, start + request.at_s - first_at - loop.time()))
            try:
                return await complete(session, base_url, model, f"req-{n}", request, origin=origin)
            except (aiohttp.ClientError, TimeoutError) as exc:
                return Measured(f"req-{n}", 0.0, False, 0, 0, None, None, "", "", "", repr(exc))

        return list(await asyncio.gather(*(one(n, r) for n, r in enumerate(trace.requests))))
