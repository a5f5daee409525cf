"""Real vLLM engines restarted with swapped kv_roles keep answering like the reference; then ``up``
stops and leaves no vLLM process behind. The last of the package's modules (conftest.py).
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from tests.e2e.vllm.nixl.cluster import Cluster
from tests.e2e.vllm.reference import Book, routes_and_modes
from tests.e2e.vllm.support import START_TIMEOUT_S, Answers, ask
from tests.helpers import ADMIN, eventually, eventually_sync, stop_process_group
from vllm_disagg.procfs import engine_servers, group_members

pytestmark = pytest.mark.timeout(1800)
_SWAPPED = {"prefill-0": "decode", "decode-0": "prefill"}


@pytest.fixture(scope="module")
def reference(reference_book: Book, prompts: list[str]) -> Answers:
    return reference_book.answers(routes_and_modes(prompts[:4]))


def _port_of(instance: dict[str, Any]) -> int:
    return int(str(instance["url"]).rsplit(":", 1)[1])


async def settled(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The instances once both are ready in their new roles. Each change ended with its engine ready
    and its link proven, but a starved host can still make one suspect for a while (a heartbeat late,
    or an engine whose step vLLM gave up on and its agent restarted, proving its link again)."""
    last: dict[str, dict[str, Any]] = {}

    def ready() -> dict[str, dict[str, Any]] | None:
        nonlocal last
        last = cluster.instances()
        roles = {a: last[a]["role"] for a in ("prefill-0", "decode-0")}
        ok = all(last[a]["state"] == "ready" for a in roles) and roles == _SWAPPED
        return last if ok else None

    try:
        return await eventually(ready, timeout=START_TIMEOUT_S, what="both ready in their new roles")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None


async def test_producer_and_consumer_swap_roles_by_restart_and_stay_token_identical(
    cluster: Cluster, reference: Answers, prompts: list[str]
) -> None:
    """``up`` launches prefill as ``kv_producer`` and decode as ``kv_consumer``: a role change drains
    the instance and its agent restarts vLLM with the other kv_role, in the same session."""
    await cluster.both_ready()  # the engines test_recovery.py killed are back
    before = cluster.instances()
    timings = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2 * START_TIMEOUT_S)) as session:
        for agent_id, role in (("prefill-0", "decode"), ("decode-0", "prefill")):
            started = time.monotonic()
            url = f"{cluster.base}/admin/v1/instances/{agent_id}/role"
            async with session.post(url, json={"role": role}, headers=ADMIN) as resp:
                body = await resp.json()
            assert resp.status == 200 and (body["role"], body["how"]) == (role, "restart"), body
            timings.append((agent_id, time.monotonic() - started, body["timeline"]))
        after = await settled(cluster)
        for agent_id in ("prefill-0", "decode-0"):
            assert after[agent_id]["session"] == before[agent_id]["session"], "the same session"
        cases = [c for c in routes_and_modes(prompts[:4]) if not c.chat][:3]
        # Ready means the KV link works: each restarted engine was routed to only after a warm-up
        # request moved KV over its link (the orchestrator's, not a user's), so NIXL's side-channel
        # handshake, which vLLM gives a fixed 5 s and a starved host can miss, is done: the very first
        # user request crosses the swapped pair, and so does every one after it.
        assert all(after[a]["kv_link_ready"] for a in ("prefill-0", "decode-0")), after
        for case in cases:
            text, _, headers = await ask(session, cluster.base, case)
            went = (headers["X-Disagg-Mode"], headers["X-Disagg-Prefill"], headers["X-Disagg-Decode"])
            assert went == ("disaggregated", "decode-0", "prefill-0"), case.name
            assert text == reference.texts[case.name], case.name
    for agent_id, seconds, timeline in timings:
        print(f"role change of {agent_id} by restart: {seconds:.1f} s, steps {timeline}")


def test_after_up_stops_no_vllm_process_remains(cluster: Cluster) -> None:
    ports = {_port_of(i) for i in cluster.instances().values()}
    pgids = set(engine_servers(ports))
    assert pgids, "expected running engines before the stop"
    assert stop_process_group(cluster.proc, timeout=120) == 0
    # Gone and reaped: not even a zombie is left (this container's init does not reap orphans).
    eventually_sync(
        lambda: not group_members(pgids, zombies=True), timeout=60, what="every vLLM process gone"
    )
    assert engine_servers(ports) == []
