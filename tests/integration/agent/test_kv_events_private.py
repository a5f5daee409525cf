"""A launched engine's KV-cache events (every cached prompt's token ids) stay on its host.

The engine publishes as the agent configures it (vLLM's own ``ZmqEventPublisher`` fed the agent's
``--kv-events-config``; the simulated engine run by the agent's command line) on a host that also has
a non-loopback address: the root side of a veth pair into a network namespace (``netns_link``), which
stands for another host. From inside the namespace a TCP connect to that address at the events port is
refused and a ZeroMQ SUB hears nothing, while the agent's subscriber on the host (``forwarder_endpoint``)
hears the engine's batches during the same window. Before the fix vLLM bound ``tcp://*`` and the
namespace heard every prompt. Skipped where a namespace cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import zmq

from tests.chaos.netns_support import NetnsLink, netns_link
from tests.helpers import free_port
from vllm_disagg.agent.engine_command import SimEngineCommand, kv_events_endpoint, kv_events_port
from vllm_disagg.agent.kv_forwarder import forwarder_endpoint
from vllm_disagg.agent.vllm_command import VllmEngineCommand, kv_events_config
from vllm_disagg.config import AgentConfig
from vllm_disagg.wire import kv_events

DEADLINE_S = 60.0
LISTEN_S = 2.0  # how long the other host listens: the host's agent hears many batches meanwhile

# Inside the namespace: try a TCP connect, then listen with a SUB; say the outcome as JSON.
PROBE = """
import json, socket, sys, time, zmq
host, port, listen = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    socket.create_connection((host, port), timeout=5).close()
    tcp = "connected"
except OSError as exc:
    tcp = type(exc).__name__
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.LINGER, 0)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(f"tcp://{host}:{port}")
print("ready", flush=True)
received, end = 0, time.monotonic() + listen
while (left := end - time.monotonic()) > 0:
    if sub.poll(int(left * 1000) + 1):
        sub.recv_multipart()
        received += 1
print(json.dumps({"tcp": tcp, "received": received}), flush=True)
"""

# vLLM's own publisher, built from the --kv-events-config the agent gives vLLM (as vLLM builds it),
# publishing one BlockStored batch per line read until stdin closes.
VLLM_PUBLISHER = """
import json, sys, time
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch
pub = EventPublisherFactory.create(KVEventsConfig(**json.loads(sys.argv[1])), 0)
print("ready", flush=True)
for n, _ in enumerate(sys.stdin):
    event = BlockStored([n + 1], None, list(range(16)), 16, None, "GPU", None)
    pub.publish(KVEventBatch(ts=time.time(), events=[event]))
pub.shutdown()
"""


def _readline(proc: subprocess.Popen[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"{what} exited before answering (rc {proc.poll()})"
    return line


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=DEADLINE_S)


@contextlib.contextmanager
def _vllm_engine(cfg: AgentConfig) -> Iterator[Callable[[], None]]:
    pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed here")
    VllmEngineCommand("cpu").prepare(cfg)  # the agent's 0700 runtime directory, as before a launch
    proc = subprocess.Popen(
        [sys.executable, "-c", VLLM_PUBLISHER, json.dumps(kv_events_config(cfg))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _readline(proc, "vLLM's publisher") == "ready"
        assert proc.stdin is not None
        stdin = proc.stdin

        def publish() -> None:
            stdin.write("\n")
            stdin.flush()

        yield publish
    finally:
        _stop(proc)
        # Killed, vLLM leaves its socket file behind.
        Path(kv_events_endpoint(cfg).removeprefix("ipc://")).unlink(missing_ok=True)


@contextlib.contextmanager
def _sim_engine(cfg: AgentConfig) -> Iterator[Callable[[], None]]:
    proc = subprocess.Popen(SimEngineCommand().argv(cfg), stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{cfg.engine_port}"
    try:
        end = time.monotonic() + DEADLINE_S
        while not _answers(f"{url}/health"):
            assert proc.poll() is None and time.monotonic() < end, "the sim engine never became healthy"
            time.sleep(0.05)  # polling a condition with a deadline, not waiting for readiness blindly
        prompts = iter(range(1_000_000))

        def publish() -> None:  # a new prompt: its full blocks enter the cache and are published
            body = json.dumps({"model": cfg.model, "prompt": f"{next(prompts)} " * 40, "max_tokens": 1})
            request = urllib.request.Request(
                f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()

        yield publish
    finally:
        _stop(proc)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


ENGINES: dict[str, Callable[[AgentConfig], AbstractContextManager[Callable[[], None]]]] = {
    "vllm": _vllm_engine,
    "sim": _sim_engine,
}


@pytest.fixture
def link() -> Iterator[NetnsLink]:
    with netns_link() as made:
        yield made


@pytest.mark.parametrize("engine", sorted(ENGINES), ids=lambda e: f"{e}: only the host's agent hears it")
def test_kv_events_cannot_be_read_from_another_host(engine: str, link: NetnsLink) -> None:
    # Listening on every interface, as an engine other hosts send requests to does.
    port = free_port()
    cfg = AgentConfig(
        agent_id=f"private-{os.getpid()}",
        role="both",
        engine=engine,
        engine_host="0.0.0.0",
        engine_port=port,
        kv_events_port=free_port(),
        model_path="/unused",
    )
    agent_sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    agent_sub.setsockopt(zmq.LINGER, 0)
    agent_sub.setsockopt(zmq.SUBSCRIBE, b"")
    agent_sub.connect(forwarder_endpoint(cfg))
    probe_argv = [sys.executable, "-c", PROBE, link.outer_addr, str(kv_events_port(cfg)), str(LISTEN_S)]
    try:
        with ENGINES[engine](cfg) as publish:
            heard = _hear(agent_sub, publish, lambda: 0)  # the agent hears the engine at all
            assert heard > 0, "the agent on the host heard none of its engine's KV events"
            probe = subprocess.Popen(link.exec_argv(probe_argv), stdout=subprocess.PIPE, text=True)
            try:
                assert _readline(probe, "the probe in the namespace") == "ready"
                during = _hear(agent_sub, publish, probe.poll)  # while the other host listens
                outcome = json.loads(_readline(probe, "the probe in the namespace"))
            finally:
                _stop(probe)
    finally:
        agent_sub.close()
    assert during > 0, "nothing was published while the other host listened: the test proves nothing"
    assert outcome == {"tcp": "ConnectionRefusedError", "received": 0}


def _hear(sub: zmq.Socket[bytes], publish: Callable[[], None], done: Callable[[], int | None]) -> int:
    """Publish and read the agent's SUB until it has heard a batch and ``done()`` says so; how many."""
    heard, end = 0, time.monotonic() + DEADLINE_S
    while heard == 0 or done() is None:
        assert time.monotonic() < end, "no KV events reached the agent's subscriber in time"
        publish()
        while sub.poll(20):
            kv_events.decode_frames(sub.recv_multipart())  # the engine's real wire format
            heard += 1
    return heard
