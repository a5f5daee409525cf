"""docs/grafana/vllm-disagg.json: every query names a metric the orchestrator really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp

from tests.helpers import eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator_support import MODEL
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer

DASHBOARD = Path(__file__).parents[3] / "docs" / "grafana" / "vllm-disagg.json"
_METRIC = re.compile(r"\bvllm_disagg_[a-z_]+")
_SUFFIXES = ("_bucket", "_sum", "_count")


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs, "the dashboard has queries"
    names = set()
    for expr in exprs:
        for name in _METRIC.findall(expr):
            for suffix in _SUFFIXES:
                if name.endswith(suffix):
                    name = name[: -len(suffix)]
            names.add(name)
    return names


async def test_every_dashboard_query_names_a_metric_the_orchestrator_exports(
    orch: OrchestratorServer,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
) -> None:
    await fake_agent("p0", (await sim_engine()).url, "prefill")
    await fake_agent("d0", (await sim_engine()).url, "decode")
    await eventually(lambda: orch.registry.snapshot().ready_prefill, what="p0 ready")
    await eventually(lambda: orch.registry.snapshot().ready_decode, what="d0 ready")
    body = jsonutil.dumps({"model": MODEL, "prompt": "fill the histograms", "max_tokens": 2})
    async with http.post(f"{orch.url}/v1/completions", data=body) as resp:
        assert resp.status == 200
    async with http.get(f"{orch.url}/metrics") as resp:
        text = await resp.text()
    exported = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))
    exported |= {name.removesuffix("_total") for name in exported}
    exported |= {f"{name}_total" for name in exported}
    missing = sorted(dashboard_metrics() - exported)
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}"
    stages = {"schedule", "kv_handoff", "queue", "time_per_output_token"}
    assert {f"vllm_disagg_{stage}_seconds" for stage in stages} <= dashboard_metrics()
    assert "vllm_disagg_role_changes_total" in dashboard_metrics()
    admission = {"queue_depth", "oldest_wait_seconds", "wait_seconds", "requests_total", "saturated"}
    assert {f"vllm_disagg_admission_{name}" for name in admission} <= dashboard_metrics()
