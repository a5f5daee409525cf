"""Many hosts (issue 26): etcd, two orchestrator replicas and two agents, each on a host of its own.

Each host is a network namespace on one bridge (``hosts.py``): etcd on one, a replica on each of two
more, the prefill agent with its simulated engine on a fourth, the decode agent with its engine on a
fifth; the test itself is the client, in the root namespace, reaching the replicas by address. Every
link between two processes crosses the bridge: replicas to etcd, replica to replica (the peer link, a
forwarded admin write), agents to both replicas, each gateway to both engines, the decode engine to
the prefill engine (the simulator's KV pull). The replicas' hosts have no loopback at all, so nothing
a replica does can pass over one; etcd's host has one (its JSON gateway dials its own gRPC port), and
so do the agents' (an agent reads its own engine's KV events there). Every host uses the same ports,
as separate machines would. The processes share nothing but their command lines and the admin token
(in their environment); each agent's command log is written by the agent and read only by the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.netns.hosts import Network, hosts, stop_groups
from tests.etcd_support import EtcdMissing, etcd_binary
from tests.helpers import ADMIN, cli_argv, eventually, eventually_sync, http_json
from vllm_disagg.runtime import die_with_parent
from vllm_disagg.sim_engine.textgen import expected_text

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")

MODEL = "sim-model"
HOSTS = ("etcd", "orch-a", "orch-b", "prefill", "decode")
LOOPBACK = ("etcd", "prefill", "decode")  # the replicas' hosts have none
REPLICA_IDS = {"orch-a": "replica-a", "orch-b": "replica-b"}
AGENTS = {"prefill": "prefill-0", "decode": "decode-0"}
ETCD_PORT, HTTP_PORT, AGENTS_PORT, PEER_PORT, ENGINE_PORT = 2379, 8000, 5555, 5556, 8100
READY_S = 120.0  # five hosts' processes starting on a loaded 2-core machine
ACT_S = 30.0
DISAGGREGATED_TRIES = 10


@dataclass
class Deployment:
    """The hosts and what runs on them (``log``, every process's output, is shown when a test fails)."""

    net: Network
    log: Path
    command_logs: dict[str, Path]  # agent id: its --command-log

    def addr(self, host: str) -> str:
        return self.net[host].addr

    def base(self, host: str) -> str:
        return f"http://{self.addr(host)}:{HTTP_PORT}"


def _spawn(deployment: Deployment, host: str, argv: list[str]) -> subprocess.Popen[bytes]:
    with deployment.log.open("ab") as out:
        return subprocess.Popen(
            deployment.net[host].exec_argv(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _etcd_argv(d: Deployment, data_dir: Path) -> list[str]:
    url, peer = f"http://{d.addr('etcd')}:{ETCD_PORT}", f"http://{d.addr('etcd')}:{ETCD_PORT + 1}"
    return [
        etcd_binary(),
        "--name", "hosts", "--data-dir", str(data_dir),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"hosts={peer}", "--initial-cluster-state", "new",
        "--logger", "zap", "--log-outputs", "stderr", "--log-level", "error",
    ]  # fmt: skip


def _replica_argv(d: Deployment, host: str) -> list[str]:
    return cli_argv(
        "orchestrator",
        "--host", "0.0.0.0", "--port", str(HTTP_PORT),
        "--zmq-endpoint", f"tcp://0.0.0.0:{AGENTS_PORT}", "--insecure-agents",
        "--etcd", f"http://{d.addr('etcd')}:{ETCD_PORT}", "--cluster", "many-hosts",
        "--replica-id", REPLICA_IDS[host], "--advertise-host", d.addr(host),
        "--peer-port", str(PEER_PORT), "--lease-ttl-s", "2",
        "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "3.0",
        "--no-preload-tokenizer-libs",
    )  # fmt: skip


def _agent_argv(d: Deployment, host: str) -> list[str]:
    replicas = ",".join(f"tcp://{d.addr(h)}:{AGENTS_PORT}" for h in REPLICA_IDS)
    return cli_argv(
        "agent", "--engine", "sim", "--role", host, "--agent-id", AGENTS[host],
        "--orchestrator", replicas, "--model", MODEL,
        "--engine-host", d.addr(host), "--engine-port", str(ENGINE_PORT),
        "--command-log", str(d.command_logs[AGENTS[host]]),
    )  # fmt: skip


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    try:
        etcd_binary()
    except EtcdMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    with hosts(HOSTS, loopback=LOOPBACK) as net:
        d = Deployment(
            net, tmp_path / "hosts.log", {a: tmp_path / f"{a}.commands.jsonl" for a in AGENTS.values()}
        )
        etcd: list[subprocess.Popen[bytes]] = []
        replicas: list[subprocess.Popen[bytes]] = []
        agents: list[subprocess.Popen[bytes]] = []
        try:
            etcd.append(_spawn(d, "etcd", _etcd_argv(d, tmp_path / "etcd")))
            eventually_sync(
                lambda: (
                    http_json(f"http://{d.addr('etcd')}:{ETCD_PORT}/health", timeout=1.0)[1]
                    == {"health": "true"}
                ),
                timeout=READY_S,
                what="etcd healthy, reached from the root namespace",
            )
            replicas += [_spawn(d, host, _replica_argv(d, host)) for host in REPLICA_IDS]
            agents += [_spawn(d, host, _agent_argv(d, host)) for host in AGENTS]
            yield d
        finally:
            # Agents first (they say Goodbye), then the replicas (they resign in etcd), etcd last; the
            # namespaces' teardown kills whatever is left.
            for stage in (agents, replicas, etcd):
                stop_groups(stage)


def replicas_view(base: str) -> dict[str, Any]:
    status, body = http_json(f"{base}/admin/v1/replicas", headers=ADMIN, timeout=2.0)
    assert status == 200, body
    assert isinstance(body, dict)
    return body


def agreed(d: Deployment) -> tuple[str, int, dict[str, Any]] | None:
    """(leader, epoch, a view) once both replicas name the same leader and list and link both."""
    views = [replicas_view(d.base(host)) for host in REPLICA_IDS]
    if len({(v["leader"], v["epoch"]) for v in views}) != 1 or not views[0]["leader"]:
        return None
    if not all(len(v["replicas"]) == 2 and all(r["linked"] for r in v["replicas"]) for v in views):
        return None
    return str(views[0]["leader"]), int(views[0]["epoch"]), views[0]


def instances(d: Deployment, host: str) -> dict[str, tuple[str, str]]:
    """Agent id: (state, engine URL), as the replica on ``host`` sees them."""
    status, body = http_json(f"{d.base(host)}/admin/v1/instances", headers=ADMIN, timeout=2.0)
    assert status == 200, body
    items = body["instances"] if isinstance(body, dict) else body
    return {i["agent_id"]: (i["state"], i["url"]) for i in items}


async def complete(http: aiohttp.ClientSession, base: str, prompt: str) -> tuple[int, str, str, str]:
    """(status, text, prefill instance, decode instance)."""
    async with http.post(
        f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}
    ) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, raw.decode(errors="replace"), "", ""
        prefill, decode = resp.headers.get("X-Disagg-Prefill", ""), resp.headers.get("X-Disagg-Decode", "")
        return 200, json.loads(raw)["choices"][0]["text"], prefill, decode


def commands(d: Deployment, agent_id: str) -> list[dict[str, Any]]:
    path = d.command_logs[agent_id]
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_replicas_and_agents_on_separate_hosts_elect_one_leader_forward_its_commands_and_serve(
    deployment: Deployment,
) -> None:
    d = deployment
    leader_id, epoch, view = await eventually(
        lambda: agreed(d), timeout=READY_S, what="one leader, both linked"
    )
    by_id = {rid: host for host, rid in REPLICA_IDS.items()}
    leader, follower = by_id[leader_id], next(h for h in REPLICA_IDS if REPLICA_IDS[h] != leader_id)
    # Each replica is known at its own host's address, never at loopback or a wildcard.
    assert {r["id"]: (r["http"], r["peer"], r["agents"]) for r in view["replicas"]} == {
        rid: (d.base(host), f"tcp://{d.addr(host)}:{PEER_PORT}", f"tcp://{d.addr(host)}:{AGENTS_PORT}")
        for host, rid in REPLICA_IDS.items()
    }
    engines = {AGENTS[h]: ("ready", f"http://{d.addr(h)}:{ENGINE_PORT}") for h in AGENTS}
    await eventually(
        lambda: all(instances(d, h) == engines for h in REPLICA_IDS),
        timeout=READY_S,
        what="both instances ready on both replicas",
    )

    async with aiohttp.ClientSession() as http:
        for host in REPLICA_IDS:
            # Disaggregated: the prefill engine on its host, then the decode engine on its own pulling
            # the KV from it. Every request succeeds; a starved moment may serve one colocated.
            modes = []
            for i in range(DISAGGREGATED_TRIES):
                prompt = f"through {host} {i}"
                status, text, prefill, decode = await complete(http, d.base(host), prompt)
                assert (status, text, decode) == (200, expected_text(prompt, 4), "decode-0")
                modes.append(prefill)
                if prefill == "prefill-0":
                    break
            assert modes[-1] == "prefill-0", f"no request through {host} went disaggregated: {modes}"

        # An operator's drain sent to the follower: forwarded to the leader, which sends the command.
        async with http.post(f"{d.base(follower)}/admin/v1/instances/prefill-0/drain", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers.get("X-Vllm-Disagg-Leader") == leader_id
            answer = await resp.json()
        assert answer["ack"]["ok"], answer
        logged = await eventually(
            lambda: [c for c in commands(d, "prefill-0") if c["id"] == answer["ack"]["id"]],
            timeout=ACT_S,
            what="the drain in the agent's command log",
        )
        assert [(c["kind"], c["epoch"], c["from"], c["accepted"]) for c in logged] == [
            ("drain", epoch, f"tcp://{d.addr(leader)}:{AGENTS_PORT}", True)
        ], "carried out by the leader, in its epoch, over its link to the agent's host"
        await eventually(
            lambda: all(instances(d, h)["prefill-0"][0] == "draining" for h in REPLICA_IDS),
            timeout=ACT_S,
            what="prefill-0 draining as both replicas see it",
        )
        for host in REPLICA_IDS:
            prompt = f"drained, through {host}"
            assert await complete(http, d.base(host), prompt) == (
                200,
                expected_text(prompt, 4),
                "",
                "decode-0",
            )
    # Agents without keys on a network endpoint: allowed by --insecure-agents, and said loudly by each.
    assert d.log.read_text(errors="replace").count("INSECURE: agents connect to tcp://0.0.0.0") == len(
        REPLICA_IDS
    )
