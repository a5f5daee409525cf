"""A role change on replicas that the leader leaves half done: the next leader goes on with it from
the step etcd recorded, and the engine restarts once.

Real agents (``agent.main.serve``, one session per replica) launch simulated engines with
``role_switch: restart`` (what a vLLM launched ``kv_producer`` or ``kv_consumer`` needs), so the
change goes drain → restart → ready; a stream on the instance keeps it draining while the leader
leaves (its engine stopped with SIGSTOP meanwhile, so that the stream cannot end first on a slow machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e.up_support import engine_pids
from tests.helpers import ADMIN, eventually, free_ports
from tests.integration.orchestrator.replicas.support import Replicas, one_leader
from tests.integration.orchestrator_support import MODEL, registered
from vllm_disagg import jsonutil
from vllm_disagg.agent.main import serve
from vllm_disagg.config import AgentConfig, SimTiming
from vllm_disagg.orchestrator.app import CONTROL_KEY, ROLES_KEY
from vllm_disagg.protocol.messages import Role
from vllm_disagg.sim_engine.textgen import expected_text

PROMPT = "a prompt for a role change that a new leader finishes: "
TOKENS = 150  # at 20 ms a token, a 3 s stream


@contextlib.contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) inside the block; their agent's /health checks, 5 s each, wait."""
    assert pids, "the engine's process"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def log_of(path: Path) -> list[dict[str, Any]]:
    return [jsonutil.loads(line) for line in path.read_text().splitlines()]


async def test_a_new_leader_finishes_a_role_change_the_old_one_left_draining_and_restarts_once(
    replicas: Replicas, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    servers = await replicas(2, role_drain_timeout_s=60.0)
    first = await one_leader(servers)
    second = next(s for s in servers if s is not first)
    endpoints = ",".join(s.zmq_endpoint for s in servers)
    stop = asyncio.Event()
    roles: dict[str, Role] = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    agents, ports = [], {}
    for agent_id, role in roles.items():
        ports[agent_id] = free_ports(1, offsets=(0, 2000))
        cfg = AgentConfig(
            agent_id=agent_id, role=role, orchestrator=endpoints, model=MODEL,
            engine_port=ports[agent_id], scrape_interval_s=0.05,
            sim=SimTiming(decode_step_s=0.02), role_switch="restart", stop_grace_s=2.0,
            command_log=str(tmp_path / f"{agent_id}.log"),
        )  # fmt: skip
        agents.append(asyncio.create_task(serve(cfg, stop)))
    try:

        def ready() -> bool:
            return all(len(s.registry.snapshot().ready_decode.get(MODEL, ())) == 2 for s in servers)

        await eventually(ready, timeout=60, what="1P2D ready on both replicas")
        async with http.post(f"{second.url}/admin/v1/instances/d0/cordon", headers=ADMIN) as resp:
            assert resp.status == 200  # the stream goes to d1
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "stream": True}
        async with http.post(f"{second.url}/v1/completions", json=body) as stream:
            assert stream.status == 200
            first_line = await stream.content.readline()
            async with http.post(f"{second.url}/admin/v1/instances/d0/uncordon", headers=ADMIN) as resp:
                assert resp.status == 200
            with paused(engine_pids([ports["d1"]])):  # the stream holds the drain until the leader is gone
                asked = asyncio.ensure_future(
                    http.post(
                        f"{second.url}/admin/v1/instances/d1/role", json={"role": "prefill"}, headers=ADMIN
                    )
                )

                def draining() -> bool:
                    recorded = second.app[ROLES_KEY].recorded.get("d1")
                    return recorded is not None and recorded["phase"] == "draining"

                await eventually(draining, what="the change recorded as draining, on the follower")
                old_epoch = first.app[CONTROL_KEY].leadership.epoch
                await first.close()  # the leader leaves half way; the operator's call to it ends with it
                servers.remove(first)
            with contextlib.suppress(aiohttp.ClientError):
                (await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(asked)), 30)).close()
            await one_leader(servers)
            text = first_line + await stream.content.read()
        events = [line[6:] for line in text.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", "the stream on the draining instance finished where it was"
        streamed = "".join(c["text"] for e in events[:-1] for c in jsonutil.loads(e)["choices"])
        assert streamed == expected_text(PROMPT, TOKENS)

        def moved() -> bool:
            view = registered(second, "d1")
            recorded = second.app[ROLES_KEY].recorded.get("d1")
            assert view.info.role == "prefill" and view.state == "ready" and recorded is None, (
                f"{view.info.role} {view.state} {view.engine_state} {recorded}"
            )
            return (
                view.info.role == "prefill"
                and view.state == "ready"
                and "d1" not in second.app[ROLES_KEY].recorded
            )

        await eventually(moved, timeout=60, what="d1 serving as prefill, the change ended")
        new_epoch = second.app[CONTROL_KEY].leadership.epoch
        set_roles = [
            (c["epoch"], c["accepted"], c["code"])
            for c in log_of(tmp_path / "d1.log")
            if c["kind"] == "set_role"
        ]
        # Asked once and refused (only a restart changes a role) by the leader of the time: the one that
        # left, or already the next one where etcd let the first's lease lapse before it left (a machine
        # stall of 1.5 s moves leadership early); then once more, with the restart, by the leader now.
        (asked_in, refused, code), done = set_roles[0], set_roles[1:]
        assert (refused, code) == (False, "restart_required"), set_roles
        assert asked_in in (old_epoch, new_epoch), set_roles
        assert done == [(new_epoch, True, "")], set_roles
        assert not registered(second, "d1").admin_draining, "the change's drain was put back"
    finally:
        stop.set()
        await asyncio.gather(*agents, return_exceptions=True)
