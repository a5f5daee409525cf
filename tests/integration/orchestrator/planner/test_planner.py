"""The planner at work on real sockets: a prefill pool too slow for its TTFT target gets one decode
instance, through the same role change as an operator's, while requests keep flowing and none fails."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import wait_ready
from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.config import SimTiming
from vllm_disagg.orchestrator.app import PLANNER_KEY, OrchestratorServer, start_orchestrator
from vllm_disagg.sim_engine.textgen import expected_text

PROMPT = "a prompt of a hundred or so bytes, which the simulated engine prefills as so many tokens. " * 2

PLANNER = """
apiVersion: vllm-disagg/v1alpha1
kind: PlannerConfig
dryRun: {dry_run}
intervalS: 0.2
windowS: 30
ttftTargetS: 0.05     # the slow prefill engine takes about 0.17 s a prompt
tpotTargetS: 10       # decode is never short here
sustain: 2
cooldownS: 3600       # one shift, then see
minSamples: 5
"""


async def serve_load(url: str, stop: asyncio.Event, outcomes: list[str]) -> None:
    """Streamed completions one after another until ``stop``: each outcome "ok" or what went wrong.
    Each prompt starts differently, so no prefix is cached and every prefill computes it all."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        while not stop.is_set():
            prompt = f"{len(outcomes)}: {PROMPT}"
            body = jsonutil.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True})
            async with http.post(f"{url}/v1/completions", data=body) as resp:
                raw = await resp.read()
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            text = "".join(
                c.get("text", "") for e in events[:-1] for c in jsonutil.loads(e).get("choices", [])
            )
            ok = resp.status == 200 and events[-1:] == [b"[DONE]"] and text == expected_text(prompt, 4)
            outcomes.append("ok" if ok else f"{resp.status}: {raw[:200]!r}")


async def planner_view(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/admin/v1/planner", headers=ADMIN) as resp:
        assert resp.status == 200
        return dict(await resp.json())


@dataclass
class Loaded:
    """A 1P2D cluster whose prefill engine is slow, under a load of streamed completions."""

    orch: OrchestratorServer
    agents: list[FakeAgent]
    stop: asyncio.Event
    outcomes: list[str]
    load: asyncio.Future[None]

    async def finish(self) -> None:
        """Stop the load and wait for its last request."""
        self.stop.set()
        await self.load


@contextlib.asynccontextmanager
async def slow_prefill_under_load(
    tmp_path: Path, sim_engine: EngineFactory, *, dry_run: bool
) -> AsyncIterator[Loaded]:
    config_file = tmp_path / "planner.yaml"
    config_file.write_text(PLANNER.format(dry_run=str(dry_run).lower()))
    orch = await start_orchestrator(orch_config(planner_config=str(config_file)), shutdown_timeout_s=2.0)
    slow = await sim_engine(timing=SimTiming(prefill_s_per_token=0.001))
    agents = [FakeAgent(orch.zmq_endpoint, "p0", slow.url, "prefill")]
    agents += [FakeAgent(orch.zmq_endpoint, f"d{i}", (await sim_engine()).url, "decode") for i in range(2)]
    stop = asyncio.Event()
    outcomes: list[str] = []
    load: asyncio.Future[None] | None = None
    try:
        for agent in agents:
            await agent.join()
        await wait_ready(orch, 1, 2)
        load = asyncio.ensure_future(serve_load(orch.url, stop, outcomes))
        yield Loaded(orch, agents, stop, outcomes, load)
    finally:
        stop.set()
        if load is not None:
            await asyncio.gather(load, return_exceptions=True)
        for agent in agents:
            await agent.close()
        await orch.close()


async def test_a_slow_prefill_pool_gets_one_decode_instance_and_no_request_fails(
    tmp_path: Path, sim_engine: EngineFactory
) -> None:
    async with (
        slow_prefill_under_load(tmp_path, sim_engine, dry_run=False) as cluster,
        aiohttp.ClientSession() as http,
    ):
        orch, agents, outcomes = cluster.orch, cluster.agents, cluster.outcomes

        def moved() -> list[str]:
            snap = orch.registry.snapshot()
            return [v.agent_id for v in snap.ready_prefill.get(MODEL, ()) if v.agent_id != "p0"]

        (mover,) = await eventually(moved, timeout=60, what="a decode instance moved to prefill")
        looks = (await planner_view(http, orch.admin_url))["last_look"]["at"]
        # Ten more looks under the same load: still short, but the cooldown holds.
        await eventually(
            lambda: orch.app[PLANNER_KEY].last_at > looks + 10 * 0.2 or None, timeout=60, what="more looks"
        )
        await cluster.finish()
        view = await planner_view(http, orch.admin_url)
        samples = await scrape(http, orch.url)
        async with http.get(f"{orch.admin_url}/admin/v1/events?follow=false", headers=ADMIN) as resp:
            events = await resp.text()
        assert outcomes and all(o == "ok" for o in outcomes), [o for o in outcomes if o != "ok"][:3]
        assert [(s["instance"], s["from"], s["to"], s["outcome"]) for s in view["shifts"]] == [
            (mover, "decode", "prefill", "done")
        ]
        assert "the prefill pool is short" in view["shifts"][0]["reason"]
        assert view["shifts"][0]["figures"]["prefill_pressure"] > 1
        assert "cooldown" in view["last_look"]["reason"] or "minimum" in view["last_look"]["reason"]
        assert view["config"]["dryRun"] is False
        assert (
            sample(
                samples,
                "vllm_disagg_planner_shifts_total",
                from_role="decode",
                to_role="prefill",
                outcome="done",
            )
            == 1
        )
        assert sample(samples, "vllm_disagg_planner_pressure", pool="prefill") > 1
        assert sample(samples, "vllm_disagg_planner_suggested_instances", role="prefill") >= 2
        assert "event: planner_shift" in events and f'"instance":"{mover}"' in events.replace(" ", "")
        moved_agent = next(a for a in agents if a.agent_id == mover)
        assert [c.args for c in moved_agent.commands if c.kind == "set_role"] == [{"role": "prefill"}]


async def test_in_dry_run_the_planner_explains_and_suggests_but_moves_nothing(
    tmp_path: Path, sim_engine: EngineFactory
) -> None:
    async with (
        slow_prefill_under_load(tmp_path, sim_engine, dry_run=True) as cluster,
        aiohttp.ClientSession() as http,
    ):

        async def explained() -> dict[str, Any] | None:
            view = await planner_view(http, cluster.orch.admin_url)
            return view if view["shifts"] else None

        view = await eventually(explained, timeout=60, what="a shift explained")
        await cluster.finish()
        (shift,) = view["shifts"]
        assert (shift["outcome"], shift["dry_run"], shift["to"]) == ("dry_run", True, "prefill")
        assert view["last_look"]["suggested"]["prefill"] >= 2
        snap = cluster.orch.registry.snapshot()
        assert [v.agent_id for v in snap.ready_prefill.get(MODEL, ())] == ["p0"], "nothing moved"
        assert all(a.commands == [] for a in cluster.agents)
