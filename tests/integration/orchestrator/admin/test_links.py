"""``GET /admin/v1/links``: what each P→D link was measured to deliver, behind the admin token, and
the same rates as the ``vllm_disagg_kv_link_gbps`` gauge."""

from __future__ import annotations

import time

import aiohttp
import pytest

from tests.helpers import ADMIN, metric_sum, parse_prometheus
from tests.integration.orchestrator_support import orch_config
from vllm_disagg.orchestrator.app import start_orchestrator
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role


async def test_learned_links_are_listed_with_their_rate_tier_and_age_and_exported_as_a_gauge(
    http: aiohttp.ClientSession,
) -> None:
    # A long timeout: these instances have no agent behind them, and must not die while the test reads.
    server = await start_orchestrator(orch_config(heartbeat_timeout_s=600.0), shutdown_timeout_s=1.0)
    try:
        reg, now = server.registry, time.monotonic()
        roles: tuple[tuple[str, Role], ...] = (("p0", "prefill"), ("d0", "decode"))
        for agent_id, role in roles:
            info = InstanceInfo(url="http://127.0.0.1:9", role=role, model="m", labels={"zone": "z1"})
            reg.hello(agent_id, info, now)
        for seq, (nbytes, seconds) in enumerate([(0.0, 0.0), (1e9, 0.1)], start=1):
            if nbytes:  # the first heartbeat is the counters' baseline
                reg.kv_sent("p0", "d0", 1000, now)
            metrics = MetricsSnapshot(scraped_at=float(seq), kv_in_bytes=nbytes, kv_in_seconds=seconds)
            reg.heartbeat("d0", Heartbeat(seq=seq, engine_state="ready", metrics=metrics), now)

        async with http.get(f"{server.admin_url}/admin/v1/links") as resp:
            assert resp.status == 401, "behind the admin token"
        async with http.get(f"{server.admin_url}/admin/v1/links", headers=ADMIN) as resp:
            assert resp.status == 200
            body = await resp.json()
        (link,) = body["links"]
        assert (link["prefill"], link["decode"], link["tier"], link["samples"]) == ("p0", "d0", "zone", 1)
        assert link["gbps"] == pytest.approx(80.0) and link["s_per_byte"] == pytest.approx(1e-10)
        assert 0.0 <= link["age_s"] < 60.0
        assert body["typical"]["zone"]["gbps"] == pytest.approx(80.0)
        assert body["bytes_per_token"] == {"m": pytest.approx(1e6)}

        async with http.get(f"{server.url}/metrics") as resp:
            samples = parse_prometheus(await resp.text())
        assert metric_sum(samples, "vllm_disagg_kv_link_gbps", prefill="p0", decode="d0") == pytest.approx(
            80.0
        )
        reg.goodbye("p0")
        async with http.get(f"{server.url}/metrics") as resp:
            samples = parse_prometheus(await resp.text())
        assert metric_sum(samples, "vllm_disagg_kv_link_gbps", prefill="p0", decode="d0") == 0.0, "forgotten"
    finally:
        await server.close()
