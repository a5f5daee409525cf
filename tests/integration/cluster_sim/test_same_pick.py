"""The simulator and the orchestrator route alike (issue 13, part 2): given the same state, the cluster
simulator and a real orchestrator's gateway pick the same (prefill, decode) pair, for the same reasons.

The simulator replays a small trace of requests that read a few shared documents, so prefixes are
cached on different instances and loads change from one moment to the next. Its scheduler is wrapped
to keep, for each request, the state its decision was taken on. A real orchestrator (in-process, with
scripted agents in front of zero-delay simulated engines) is then given each chosen request's state:

- the agents say Hello with the simulator's instance infos (their URLs the real engines'), in the
  simulator's join order;
- their heartbeats carry the metrics the simulator's registry held (its engines' ``snapshot()``);
- they forward the KV events the simulator's engines had published by then;
- the simulator's requests in flight are held in the orchestrator's registry (as the gateway's own
  ``acquire`` holds one for each leg it has sent).

Once the orchestrator's registry and KV index say what the simulator's said, the request is sent with
the simulator's request id and token ids, one at a time, and the response's ``X-Disagg-*`` headers
must name the simulator's pair. ``now`` differs (virtual against monotonic seconds); it matters only
to breakers and the planner, and every breaker is closed here.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import pytest

from tests.helpers import ADMIN, eventually
from tests.integration.conftest import AgentFactory
from tests.integration.orchestrator_support import FakeAgent
from tests.integration.sim_support import ZERO, StartEngine
from vllm_disagg import jsonutil
from vllm_disagg.cluster_sim.cluster import MODEL, Cluster, ClusterSpec
from vllm_disagg.cluster_sim.fidelity import complete, token_request
from vllm_disagg.cluster_sim.profile import from_sim_timing
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest, prompt_token_ids
from vllm_disagg.config import SimTiming
from vllm_disagg.model.sim import VOCAB_SIZE
from vllm_disagg.orchestrator.app import OrchestratorServer
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import RegistrySnapshot
from vllm_disagg.protocol.messages import KvEvent, KvEvents

# A busy 2P2D cluster: prompts cost prefill time and batches cost decode time, so loads differ.
TIMING = SimTiming(
    prefill_s_per_token=0.001, decode_step_s=0.02, decode_step_s_per_seq=0.002, kv_transfer_s_per_token=0.0005
)
PREFILL, DECODE = 2, 2
DOCUMENTS = 4  # shared documents of DOCUMENT_TOKENS tokens (whole blocks), each prompt reads one
DOCUMENT_TOKENS = 64
REQUESTS = 80
PROBES = range(20, REQUESTS, 6)  # the requests whose decisions the orchestrator must repeat


def documents_trace(seed: int = 3) -> Trace:
    """Poisson arrivals (8/s); each prompt = one of the documents (Zipf-ish) + a question of its own."""
    rng = random.Random(seed)
    docs = [[rng.randrange(VOCAB_SIZE) for _ in range(DOCUMENT_TOKENS)] for _ in range(DOCUMENTS)]
    requests: list[TraceRequest] = []
    t = 0.0
    for _ in range(REQUESTS):
        doc = docs[min(int(rng.expovariate(0.8)), DOCUMENTS - 1)]
        question = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(8, 40))]
        requests.append(token_request(t, doc + question, rng.randint(4, 24)))
        t += rng.expovariate(8.0)
    return Trace("documents", requests)


class RecordingIndex(KvIndex):
    """The simulator's KV index, keeping every agent's events in the order they were applied."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, list[KvEvent]]] = []

    def apply(self, agent_id: str, events: Sequence[KvEvent]) -> int:
        self.log.append((agent_id, list(events)))
        return super().apply(agent_id, events)


@dataclasses.dataclass(frozen=True)
class Taken:
    """One decision and what it was taken on: the request, the registry's snapshot (immutable), how
    far the KV index's log had got, and how many blocks it held per instance."""

    request: SchedulingRequest
    snapshot: RegistrySnapshot
    kv_mark: int
    blocks: Mapping[str, int]
    decision: Decision


class RecordingScheduler:
    """The shipped plugin scheduler, keeping each first decision with its state."""

    def __init__(self, index: RecordingIndex) -> None:
        self.inner = PluginScheduler()
        self.index = index
        self.taken: dict[str, Taken] = {}

    def decide(self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float) -> Decision:
        decision = self.inner.decide(request, snapshot, now)
        blocks = {a: self.index.blocks_of(a) for a in snapshot.by_id}
        self.taken[request.request_id] = Taken(request, snapshot, len(self.index.log), blocks, decision)
        return decision

    def pick_prefill(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, decode: str
    ) -> str | None:
        return self.inner.pick_prefill(request, snapshot, now, decode)

    def pick_decode(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, prefill: str | None
    ) -> str | None:
        return self.inner.pick_decode(request, snapshot, now, prefill)


def simulate(trace: Trace) -> tuple[Cluster, RecordingScheduler]:
    """The trace through a simulated 2P2D cluster whose scheduler keeps what it decided on."""
    index = RecordingIndex()
    scheduler = RecordingScheduler(index)
    cluster = Cluster(ClusterSpec(PREFILL, DECODE, from_sim_timing(TIMING)), scheduler)
    cluster.kv_index = index  # before any event: the engines publish through the cluster's index
    cluster.run(trace)
    return cluster, scheduler


def routing_state(snapshot: RegistrySnapshot) -> dict[str, Any]:
    """What the scheduler reads of a snapshot (besides the request): per instance in join order, its
    role, state, breaker, last heartbeat's metrics and in-flight count; and the links held shut."""
    return {
        "instances": [
            (v.agent_id, v.info.role, v.state, v.breaker.state, v.metrics, snapshot.in_flight_of(v.agent_id))
            for v in snapshot.instances
        ],
        "blocked_links": snapshot.blocked_links,
    }


def hold_in_flight(registry: Registry, wanted: Mapping[str, int]) -> None:
    """Make the registry count ``wanted`` requests in flight per instance."""
    have = registry.own_in_flight()
    for agent_id in set(have) | set(wanted):
        for _ in range(wanted.get(agent_id, 0) - have.get(agent_id, 0)):
            registry.acquire(agent_id)
        for _ in range(have.get(agent_id, 0) - wanted.get(agent_id, 0)):
            registry.release(agent_id)


def why(explanation: Mapping[str, Any]) -> dict[str, Any]:
    """An explanation without the scheduler config's source (a file name for the orchestrator's)."""
    return {k: v for k, v in explanation.items() if k != "config"}


def mirror(
    agents: Mapping[str, FakeAgent],
    registry: Registry,
    t: Taken,
    log: Sequence[tuple[str, list[KvEvent]]],
    since: int,
) -> None:
    """Tell the orchestrator the simulator's state at ``t``: the metrics its registry held, the KV
    events its engines had published (those of ``log`` from ``since`` on), its requests in flight."""
    for agent_id, agent in agents.items():
        agent.metrics = t.snapshot.by_id[agent_id].metrics
        agent.heartbeat_now()
    for seq in range(since, t.kv_mark):  # a batch's place in the log: each agent's seq grows
        agent_id, events = log[seq]
        agents[agent_id].transport.send(KvEvents(seq=seq + 1, events=events))
    hold_in_flight(registry, t.snapshot.in_flight)


def same_state(orch: OrchestratorServer, t: Taken, tokens: Sequence[int]) -> bool:
    """Does the orchestrator see what the simulator saw at ``t`` (registry, KV index, this prompt's
    cached prefixes)?"""
    index = orch.kv_index
    return (
        routing_state(orch.registry.snapshot()) == routing_state(t.snapshot)
        and {a: index.blocks_of(a) for a in t.blocks} == t.blocks
        and index.cached_tokens(tokens) == dict(t.request.cached_tokens)
    )


@pytest.mark.timeout(120)
async def test_the_orchestrator_picks_the_simulators_pair_for_the_simulators_state(
    orch: OrchestratorServer,
    fake_agent: AgentFactory,
    engines: StartEngine,
    http: aiohttp.ClientSession,
) -> None:
    trace = documents_trace()
    cluster, recorder = simulate(trace)
    probes = [(f"req-{n}", trace.requests[n]) for n in PROBES]
    taken = [recorder.taken[request_id] for request_id, _ in probes]
    outcomes = {o.request_id: o for o in cluster.outcomes}
    for (request_id, _), t in zip(probes, taken, strict=True):  # the simulator acted on its decision
        out = outcomes[request_id]
        assert (out.mode, out.prefill, out.decode) == (t.decision.mode, t.decision.prefill, t.decision.decode)
    # A choice worth checking: different pairs, different prefix holders, loads that differ.
    assert len({(t.decision.prefill, t.decision.decode) for t in taken}) >= 3
    assert len({frozenset(t.request.cached_tokens) for t in taken}) >= 3
    assert any(t.snapshot.in_flight for t in taken)
    assert len({v.metrics.num_running for t in taken for v in t.snapshot.instances}) >= 3

    # The orchestrator's instances: the simulator's, in its join order, each before a real engine.
    agents: dict[str, FakeAgent] = {}
    for view in cluster.registry.snapshot().instances:
        engine = await engines(ZERO, prefill_cache_in_handle=False)  # no KV audit of scripted counters
        info = dataclasses.replace(view.info, url=engine.url)
        agents[view.agent_id] = await fake_agent(view.agent_id, engine.url, view.info.role, info=info)

    forwarded = 0
    for (request_id, request), t in zip(probes, taken, strict=True):
        mirror(agents, orch.registry, t, recorder.index.log, forwarded)
        forwarded = t.kv_mark
        tokens = prompt_token_ids(request)
        await eventually(
            functools.partial(same_state, orch, t, tokens),
            timeout=20,
            what=f"the simulator's state before {request_id}",
        )

        seen = await complete(http, orch.url, MODEL, request_id, request)
        assert seen.ok, seen
        wanted = t.decision
        picked = (seen.mode, seen.prefill or None, seen.decode)  # the X-Disagg-* response headers
        assert picked == (wanted.mode, wanted.prefill, wanted.decode), request_id
        # And for the same reasons: every candidate's every score, the filters, the decider's call.
        async with http.get(f"{orch.admin_url}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
            record = jsonutil.loads(await resp.read())
        assert wanted.explanation is not None
        assert why(record["explanation"]) == why(wanted.explanation.to_json()), request_id

    hold_in_flight(orch.registry, {})
