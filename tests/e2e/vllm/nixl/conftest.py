"""One 1P1D cluster with NIXL for the whole package: a cold start of two engines is a minute here.

Tracing is on: the orchestrator and both engines export their spans to the package's OTLP receiver
(``traces``). The modules run in name order, which is the order the cluster's life needs: ``test_handoff.py``
(token-identical handoffs, the engines' metrics, the prefix index: nothing killed yet),
``test_recovery.py`` (engines killed, their agents restart them), ``test_roles.py`` (the engines
restarted with swapped kv_roles, then ``up`` stopped). The cluster is stopped after the last of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.vllm.nixl.cluster import KV_LEASE_S, Cluster, EngineBlocks
from tests.e2e.vllm.reference import Book, shared_prompts
from tests.e2e.vllm.support import free_engine_ports, running_up, up_1p1d_argv
from tests.helpers import free_port
from tests.otlp_receiver import ThreadedReceiver
from vllm_disagg.agent.engine_command import kv_events_endpoint
from vllm_disagg.config import AgentConfig


@pytest.fixture(scope="package")
def prompts(tiny_model: Path) -> list[str]:
    return shared_prompts(tiny_model)


@pytest.fixture(scope="package")
def traces() -> Iterator[ThreadedReceiver]:
    """The OTLP receiver the cluster's orchestrator and both vLLM engines export their spans to."""
    receiver = ThreadedReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="package")
def cluster(
    tiny_model: Path, reference_book: Book, tmp_path_factory: pytest.TempPathFactory, traces: ThreadedReceiver
) -> Iterator[Cluster]:
    """Started after the reference book is filled: its engine and the cluster's two never run at once."""
    port, zmq_port, engine_base = free_port(), free_port(), free_engine_ports(2)
    log = tmp_path_factory.mktemp("up") / "up.log"
    # prefill-0's KV events, where its agent has vLLM publish them (an ipc socket on this host only).
    prefill_0 = AgentConfig(agent_id="prefill-0", role="prefill", engine="vllm", engine_port=engine_base)
    prefill_blocks = EngineBlocks(kv_events_endpoint(prefill_0))
    argv = [*up_1p1d_argv(tiny_model, port, zmq_port, engine_base), "--kv-lease-s", str(KV_LEASE_S)]
    argv += ["--otlp-traces-endpoint", traces.url]  # every engine's spans too (test_handoff.py)
    try:
        with running_up(argv, log) as proc:
            yield Cluster(proc, f"http://127.0.0.1:{port}", log, prefill_blocks)
    finally:
        prefill_blocks.close()
