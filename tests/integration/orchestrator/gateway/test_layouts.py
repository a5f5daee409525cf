"""KV layouts end to end: instances whose KV the decode instance cannot use are never paired with it,
the explanation says why, and the orchestrator counts the pairs it cannot make."""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import AgentFactory, EngineFactory
from tests.integration.orchestrator_support import MODEL, sample, scrape
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.protocol.messages import InstanceInfo, KvLayout, Role

SAME = KvLayout(tp_size=1, pp_size=1, dtype="bfloat16", kv_cache_dtype="bfloat16", kv_layout="LBHNC")


def info(url: str, role: Role, **layout: Any) -> InstanceInfo:
    return InstanceInfo(
        url=url, role=role, model=MODEL, engine="sim", layout=dataclasses.replace(SAME, **layout)
    )


async def test_incompatible_layouts_are_never_paired_and_say_why(
    orch: OrchestratorServer,
    fake_agent: AgentFactory,
    sim_engine: EngineFactory,
    http: aiohttp.ClientSession,
) -> None:
    ok, tp2, fp8, d = [await sim_engine() for _ in range(4)]
    await fake_agent("p-ok", ok.url, "prefill", info=info(ok.url, "prefill"))
    await fake_agent("p-tp2", tp2.url, "prefill", info=info(tp2.url, "prefill", tp_size=2))
    await fake_agent("p-fp8", fp8.url, "prefill", info=info(fp8.url, "prefill", kv_cache_dtype="fp8_e4m3"))
    await fake_agent("d0", d.url, "decode", info=info(d.url, "decode"))

    def ready() -> bool:
        snap = orch.registry.snapshot()
        return len(snap.ready_prefill.get(MODEL, ())) == 3 and len(snap.ready_decode.get(MODEL, ())) == 1

    await eventually(ready, what="3P1D ready")
    body = jsonutil.dumps({"model": MODEL, "prompt": "The quick brown fox " * 8, "max_tokens": 4})
    for i in range(6):  # the pick among prefill instances is random: several requests
        async with http.post(
            f"{orch.url}/v1/completions", data=body, headers={"X-Request-Id": f"l{i}"}
        ) as resp:
            assert resp.status == 200
        async with http.get(f"{orch.url}/admin/v1/requests/l{i}", headers=ADMIN) as resp:
            record = await resp.json()
        assert (record["prefill"], record["decode"]) == ("p-ok", "d0")
        filtered = record["explanation"]["prefill"]["filtered"]
        reasons = {f["id"]: f.get("reason") for f in filtered if f["filter"] == "kv-compat-filter"}
        assert reasons == {
            "p-tp2": "tp_size differs: prefill 2, decode 1",
            "p-fp8": "kv_cache_dtype differs: prefill fp8_e4m3, decode bfloat16",
        }

    samples = await scrape(http, orch.url)
    name = "vllm_disagg_kv_incompatible_pairs"
    assert sample(samples, name, model=MODEL, reason="tp_size") == 1
    assert sample(samples, name, model=MODEL, reason="kv_cache_dtype") == 1

    async with http.get(f"{orch.url}/admin/v1/instances", headers=ADMIN) as resp:
        shown = {i["agent_id"]: i for i in (await resp.json())["instances"]}
    assert shown["p-tp2"]["layout"]["tp_size"] == 2
    assert shown["d0"]["layout"]["kv_layout"] == "LBHNC"
