"""Topology through the real gateway: with ``required`` topology every request's prefill and decode
instances share a transfer domain (docs/scheduler.md, "Topology")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.helpers import ADMIN
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator.gateway.test_gateway import wait_ready
from tests.integration.orchestrator_support import MODEL, orch_config
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.orchestrator.scheduling.config import default_config_text
from vllm_disagg.protocol.messages import InstanceInfo, Role

DOMAINS = {"p-a": "nvl-a", "p-b": "nvl-b", "d-a": "nvl-a", "d-b": "nvl-b"}


@pytest.fixture
async def orch(tmp_path: Path) -> AsyncIterator[OrchestratorServer]:
    """An orchestrator whose scheduler requires P and D of MODEL to share a domain."""
    doc: dict[str, Any] = yaml.safe_load(default_config_text())
    next(p for p in doc["plugins"] if p["type"] == "topology-filter")["parameters"]["models"] = [MODEL]
    path = tmp_path / "scheduler.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    server = await start_orchestrator(orch_config(scheduler_config=str(path)), shutdown_timeout_s=2.0)
    try:
        yield server
    finally:
        await server.close()


async def test_required_topology_pairs_every_request_within_one_domain(
    orch: OrchestratorServer, http: aiohttp.ClientSession, fake_agent: AgentFactory, sim_engine: EngineFactory
) -> None:
    for agent_id, domain in DOMAINS.items():
        engine = await sim_engine(engine_id=agent_id)
        role: Role = "prefill" if agent_id.startswith("p") else "decode"
        info = InstanceInfo(url=engine.url, role=role, model=MODEL, engine="sim", labels={"domain": domain})
        await fake_agent(agent_id, engine.url, role, info=info)
    await wait_ready(orch, 2, 2)
    pairs = set()
    for n in range(24):
        body = {"model": MODEL, "prompt": f"topology {n} " * (n + 1), "max_tokens": 2}
        async with http.post(f"{orch.url}/v1/completions", data=jsonutil.dumps(body)) as resp:
            assert resp.status == 200, await resp.text()
            p, d = resp.headers["X-Disagg-Prefill"], resp.headers["X-Disagg-Decode"]
        assert resp.headers["X-Disagg-Mode"] == "disaggregated"
        assert DOMAINS[p] == DOMAINS[d], f"request {n} crossed domains: {p} -> {d}"
        pairs.add((p, d))
    assert len(pairs) == 2, f"both domains serve: {pairs}"
    async with http.get(f"{orch.url}/admin/v1/instances", headers=ADMIN) as resp:
        shown = await resp.json()
    rows = shown["instances"] if isinstance(shown, dict) else shown
    assert {row["agent_id"]: row["labels"] for row in rows} == {a: {"domain": d} for a, d in DOMAINS.items()}
