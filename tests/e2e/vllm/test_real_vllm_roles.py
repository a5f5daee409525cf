"""Real vLLM changing roles as it runs: two ``kv_both`` engines (NIXL), attached by real agents, swap
prefill and decode duty through the admin API (the planner's path), and every answer stays
token-identical to the engine answering alone.

vLLM 0.32's NixlConnector reads a request's ``kv_transfer_params``, not the engine's ``kv_role``, to
decide whether to hold blocks for a remote decode or pull them from a remote prefill; a ``kv_both``
engine therefore serves either duty from one request to the next, and a role change is routing alone.
An engine started ``kv_producer`` or ``kv_consumer`` is held to its role by its agent (409, with the
reason). The note reports how long a change takes, from the admin call to the first request served
in the new arrangement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.vllm.support import JSON, MODEL, engine_client, free_engine_ports, running_vllms
from tests.e2e.vllm.test_real_vllm_attached import running
from tests.helpers import ADMIN, cli_argv, eventually
from tests.integration.orchestrator_support import orch_config
from vllm_disagg import jsonutil
from vllm_disagg.config import AdmissionConfig, AgentConfig
from vllm_disagg.orchestrator.app import GATEWAY_KEY, OrchestratorServer, start_orchestrator

pytestmark = pytest.mark.timeout(1800)
PROMPT = "Both engines can prefill and decode, so which does which is the router's choice alone: "


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two ``kv_both`` engines, a core each, in dev mode (their agents learn the kv_role)."""
    base = free_engine_ports(2)
    logs = tmp_path_factory.mktemp("engines")

    def engine(name: str, index: int) -> AgentConfig:
        return AgentConfig(
            agent_id=name, role="both", engine="vllm", model=MODEL, model_path=str(tiny_model),
            engine_port=base + index, omp_threads_bind=str(index % (os.cpu_count() or 1)),
        )  # fmt: skip

    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    with running_vllms(
        [(engine("a", 0), logs / "a.log"), (engine("b", 1), logs / "b.log")], env={"a": dev, "b": dev}
    ) as (a, b):
        yield a, b


async def complete(
    session: aiohttp.ClientSession, base: str, n: int, request_id: str = ""
) -> tuple[str, dict[str, str]]:
    body = {"model": MODEL, "prompt": f"{n}. {PROMPT * 4}", "max_tokens": 8, "temperature": 0}
    headers = {**JSON, **({"X-Request-Id": request_id} if request_id else {})}
    async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        return jsonutil.loads(raw)["choices"][0]["text"], dict(resp.headers)


async def set_role(
    session: aiohttp.ClientSession, admin: str, agent_id: str, role: str
) -> tuple[int, dict[str, Any]]:
    async with session.post(
        f"{admin}/admin/v1/instances/{agent_id}/role", json={"role": role}, headers=ADMIN
    ) as resp:
        return resp.status, await resp.json()


def attached(
    server: OrchestratorServer, engines: tuple[str, str], log: Path
) -> contextlib.AbstractContextManager[None]:
    """Agents ``a`` and ``b`` attached to the two engines, serving either duty."""
    flags = ["--model", MODEL, "--engine", "vllm", "--orchestrator", server.zmq_endpoint]
    flags += ["--health-timeout-s", "20", "--role", "both"]
    argvs = [
        cli_argv("agent", "--agent-id", name, "--attach", url, *flags)
        for name, url in zip(("a", "b"), engines, strict=True)
    ]
    return running(argvs, log)


async def both_ready(server: OrchestratorServer) -> None:
    def ready() -> bool:
        snap = server.registry.snapshot()
        return len(snap.ready_prefill.get(MODEL, ())) == 2 and len(snap.ready_decode.get(MODEL, ())) == 2

    await eventually(ready, timeout=300, what="both instances ready")


async def serving(server: OrchestratorServer, prefill: str, decode: str) -> None:
    """Both routed to in their new duties. The change itself is at once; an instance may still be
    suspect for a moment (a heartbeat late on a starved host), and then the gateway rightly answers
    alone."""

    def ready() -> bool:
        snap = server.registry.snapshot()
        return prefill in {v.agent_id for v in snap.ready_prefill.get(MODEL, ())} and decode in {
            v.agent_id for v in snap.ready_decode.get(MODEL, ())
        }

    await eventually(ready, timeout=300, what=f"{prefill} ready to prefill, {decode} to decode")


async def test_kv_both_engines_swap_duties_by_routing_and_stay_token_identical(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    a, b = engines
    config = orch_config(heartbeat_timeout_s=60.0, idle_timeout_s=120.0, connect_timeout_s=60.0)
    server = await start_orchestrator(config, shutdown_timeout_s=5.0)
    try:
        async with engine_client(300) as session:
            # What each prompt gives from one engine alone (temperature 0): the reference.
            reference = [(await complete(session, a, n))[0] for n in range(6)]
            assert reference == [(await complete(session, b, n))[0] for n in range(6)]
            for base in (a, b):  # so that the answers below come through the KV handoff, not a cache hit
                async with session.post(f"{base}/reset_prefix_cache") as resp:
                    assert resp.status == 200
            with attached(server, engines, tmp_path / "agents.log"):
                await both_ready(server)
                first, second = "a", "b"
                timings = []
                for prefill, decode, n in ((first, second, 2), (second, first, 4)):
                    started = time.monotonic()
                    for agent_id, role in ((prefill, "prefill"), (decode, "decode")):
                        status, body = await set_role(session, server.admin_url, agent_id, role)
                        assert status == 200 and body["role"] == role and body["pinned"], body
                    await serving(server, prefill, decode)
                    text, headers = await complete(session, server.url, n)
                    timings.append(time.monotonic() - started)
                    went = (headers["X-Disagg-Mode"], headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"])
                    assert went == ("disaggregated", prefill, decode)
                    assert text == reference[n], "token-identical after the change"
                    text, headers = await complete(session, server.url, n + 1)
                    assert text == reference[n + 1] and headers["X-Disagg-Prefill"] == prefill
                    view = server.registry.get(prefill)
                    assert view is not None and view.session == 1, "the same session: no restart"
                print(f"role change to first request served: {', '.join(f'{t:.3f} s' for t in timings)}")
    finally:
        await server.close()


async def test_a_burst_past_capacity_is_queued_or_refused_with_a_reason_and_never_a_5xx(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    """Admission in front of real engines: a budget of a millisecond makes any busy engine saturated,
    so the pair takes one request at a time and the queue (three places) holds the rest of a burst;
    those it holds get their answers, the burst beyond it and the sheddable class get 429s that say
    why and when to come back, and no request gets a 5xx."""
    # No limit on the wait that a slow machine could reach: each queued request waits for the ones
    # before it to be computed on CPU, which took over the default 30 s under a full test run's load.
    admission = AdmissionConfig(ttft_s=0.001, max_queue=3, sheddable_priority=1, max_wait_s=3600.0)
    config = orch_config(
        heartbeat_timeout_s=60.0, idle_timeout_s=120.0, connect_timeout_s=60.0, admission=admission
    )
    server = await start_orchestrator(config, shutdown_timeout_s=5.0)
    try:
        with attached(server, engines, tmp_path / "agents.log"):
            await both_ready(server)
            queue = server.app[GATEWAY_KEY].admission
            assert queue is not None
            async with engine_client(300) as session:

                async def send(n: int, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
                    body = {"model": MODEL, "prompt": f"{n}. {PROMPT * 4}", "max_tokens": 8}
                    async with session.post(
                        f"{server.url}/v1/completions", json=body, headers={**JSON, **headers}
                    ) as resp:
                        return resp.status, dict(resp.headers), await resp.read()

                burst = [asyncio.create_task(send(n, {})) for n in range(8)]
                await eventually(lambda: queue.queue.depth(MODEL) == 3, timeout=120, what="a full queue")
                bulk = await asyncio.gather(*(send(n, {"x-priority": "1"}) for n in range(3)))
                answers = await asyncio.gather(*burst)
        for status, headers, raw in bulk:
            assert (status, headers["X-Disagg-Shed-Reason"]) == (429, "sheddable"), raw
            assert 1 <= int(headers["Retry-After"]) <= 60
        served = [raw for status, _, raw in answers if status == 200]
        assert len(served) >= 3, "the queue's three, at least, got their answers"
        assert all(jsonutil.loads(raw)["choices"][0]["text"] for raw in served)
        for status, headers, raw in answers:
            if status != 200:
                assert (status, headers["X-Disagg-Shed-Reason"]) == (429, "queue_full"), raw
                assert jsonutil.loads(raw)["error"]["code"] == 429
    finally:
        await server.close()
