"""The 1P1D NIXL cluster this package's modules share, and what they read off it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import aiohttp
import zmq

from tests.e2e.vllm.support import START_TIMEOUT_S, UpCluster
from tests.helpers import ADMIN, eventually, http_json, metric_sum, parse_prometheus
from vllm_disagg.errors import KvEventsError
from vllm_disagg.procfs import engine_servers
from vllm_disagg.wire.kv_events import BlockRemoved, BlockStored, decode_frames

# How long P keeps KV that no decode pulls (vLLM's default is 30 s): long, so that a machine-wide
# stall is not mistaken for a leak (test_recovery.py) nor lets a handoff's KV expire before D pulls it.
KV_LEASE_S = 900


class EngineBlocks:
    """The blocks an engine holds, from its KV-event publisher: a SUB socket read by a thread.

    Subscribed before the engine starts, it hears every event the engine ever publishes (a
    subscriber misses what is published while it joins), so its count is the engine's, to compare
    with the orchestrator's index of that instance at any moment both have caught up.
    """

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)  # connects whenever the engine binds
        self._held: set[int] = set()
        self._error: KvEventsError | None = None
        self.batches = 0
        self.keyed = 0  # stored blocks the index may not hold (LoRA, salt, multimodal)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="engine-kv-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            try:
                batch = decode_frames(self._sock.recv_multipart())
            except KvEventsError as exc:
                self._error = exc  # the count would be wrong from here on
                return
            with self._lock:
                self.batches += 1
                for event in batch.events:
                    if isinstance(event, BlockStored):
                        self._held.update(event.block_hashes)
                        self.keyed += len(event.block_hashes) if event.keyed else 0
                    elif isinstance(event, BlockRemoved):
                        self._held.difference_update(event.block_hashes)
                    else:
                        self._held.clear()

    def blocks(self) -> frozenset[int]:
        """The engine's hashes of the blocks it holds now, as far as its events have arrived."""
        if self._error is not None:
            raise self._error
        with self._lock:
            return frozenset(self._held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def metrics(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, text = http_json(f"{url}/metrics")
    assert status == 200 and isinstance(text, str)
    return parse_prometheus(text)


@dataclass
class Cluster(UpCluster):
    """A running ``vllm-disagg up`` 1P1D with NIXL."""

    prefill_blocks: EngineBlocks  # what prefill-0's first engine holds (until it is killed)

    def engine_group(self, agent_id: str) -> int:
        (pgid,) = engine_servers({int(str(self.instances()[agent_id]["url"]).rsplit(":", 1)[1])})
        return pgid

    async def both_ready(self) -> None:
        """Both instances ready, and each engine answering itself: right after an engine is killed,
        until its agent has seen it (a starved agent may take seconds), the registry still says ready
        (seen in CI: the next test's requests went to the dead decode engine)."""

        def ready() -> bool:
            instances = self.instances()
            if {i: v["state"] for i, v in instances.items()} != {"prefill-0": "ready", "decode-0": "ready"}:
                return False
            return all(http_json(f"{v['url']}/health")[0] == 200 for v in instances.values())

        await eventually(ready, timeout=START_TIMEOUT_S, interval=0.5, what="1P1D ready")

    async def explain(self, session: aiohttp.ClientSession, ids: list[str], events: list[int]) -> str:
        """Where streams that are not under way are: their events so far, the gateway's live requests
        (stage, pair, age), and what each engine is running and waiting for."""
        lines = [f"{request_id}: {n} events" for request_id, n in zip(ids, events, strict=True)]
        async with session.get(f"{self.base}/admin/v1/live-requests", headers=ADMIN) as resp:
            lines.append(f"live requests: {(await resp.text())[:3000]}")
        for agent_id, view in self.instances().items():
            samples = metrics(str(view["url"]))
            running = metric_sum(samples, "vllm:num_requests_running")
            waiting = metric_sum(samples, "vllm:num_requests_waiting")
            lines.append(
                f"{agent_id} ({view['state']}, in flight {view['in_flight']}): "
                f"engine running {running}, waiting {waiting}"
            )
        return "\n".join(lines)

    async def record(self, session: aiohttp.ClientSession, request_id: str) -> dict[str, Any]:
        async with session.get(f"{self.base}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
            assert resp.status == 200
            return dict(await resp.json())
