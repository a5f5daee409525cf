"""The benchmarks' stream timer counts the text events of a real SSE response, however it is chunked."""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from vllm_disagg.bench.streams import time_stream


async def test_text_events_are_counted_across_chunk_boundaries_and_timed_from_t0() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = b"".join(b'data: {"choices":[{"text":" w%d"}]}\n\n' % i for i in range(5))
        events += b'data: {"choices":[],"usage":{}}\n\ndata: [DONE]\n\n'
        for cut in range(0, len(events), 7):  # events split mid-way, as TCP may deliver them
            await resp.write(events[cut : cut + 7])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            t0 = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/") as resp:
                timing = await time_stream(resp, t0)
    finally:
        await runner.cleanup()
    assert timing.tokens == 5, "five text events; the usage event and [DONE] are not tokens"
    assert 0 < timing.ttft_s < time.perf_counter() - t0 and timing.tpot_s >= 0
