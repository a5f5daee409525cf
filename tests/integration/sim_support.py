"""Shared fixtures and helpers of the simulated-engine integration tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import eventually, free_port  # noqa: F401  (re-exported)
from vllm_disagg import jsonutil
from vllm_disagg.config import SimTiming
from vllm_disagg.sim_engine.engine import SimServer

MODEL = "sim-model"
BLOCK = 16
LONG_PROMPT = "The quick brown fox jumps over the lazy dog; " * 2 + "and then?"  # 99 tokens: 6 full blocks
STEPPED = SimTiming(decode_step_s=0.002, prefill_s_per_token=0.00001, block_size=BLOCK)
ZERO = SimTiming(block_size=BLOCK)
TIMINGS = pytest.mark.parametrize("timing", [ZERO, STEPPED], ids=["zero-delay", "stepped"])

StartEngine = Callable[..., Awaitable[SimServer]]


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, Mapping[str, str]]:
    data = body if isinstance(body, bytes) else jsonutil.dumps(body)
    async with http.post(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        raw = await r.read()
        ctype = r.headers.get("Content-Type", "")
        payload: Any = raw.decode() if ctype.startswith("text/event-stream") else jsonutil.loads(raw)
        return r.status, payload, CIMultiDict(r.headers)


def sse_events(text: str) -> list[Any]:
    """Each ``data:`` event of an SSE body, JSON-decoded, with ``[DONE]`` kept as the string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else jsonutil.loads(data))
    return events


async def scrape(http: aiohttp.ClientSession, server: SimServer) -> dict[tuple[str, frozenset[Any]], float]:
    async with http.get(server.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[tuple[str, frozenset[Any]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels`` (plus the engine's own labels)."""
    want = {("model_name", MODEL), ("engine", "0"), *labels.items()}
    hits = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


async def metric(http: aiohttp.ClientSession, server: SimServer, name: str, **labels: str) -> float:
    return value(await scrape(http, server), name, **labels)


# -- output and API shapes ---------------------------------------------------------------------
