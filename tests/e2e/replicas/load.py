"""Load and leader actions for the replicas' failure tests.

``SpreadLoad`` is a streaming load spread over the replicas' ports as a load balancer spreads it
(``vllm_disagg.chaos.spread``: a refused connection goes to the next replica, uncounted), each answer
checked byte for byte (``vllm_disagg.chaos.check``: the simulated engine's output is a function of the
prompt) and recorded with its replica and its monotonic start and end. ``Toggler`` drains and undrains
the spare instance through given replicas in a loop, so that a leader has agents to command.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from tests.e2e.replicas.cluster import MODEL, SPARE, Replica
from tests.helpers import ADMIN
from vllm_disagg.chaos.load import Sent as Sent
from vllm_disagg.chaos.load import SpreadLoad as ChaosSpreadLoad


class SpreadLoad(ChaosSpreadLoad):
    """The chaos harness's spread load on the cluster's model: 12 workers, mostly streams."""

    def __init__(self, urls: Sequence[str], seed: int = 0, health_path: str = "") -> None:
        super().__init__(urls, MODEL, seed=seed, prefix="e2e", health_path=health_path)

    def since(self, t: float) -> list[Sent]:
        """Requests started at or after monotonic time ``t``."""
        return [s for s in self.results if s.started >= t]

    def completed(self, replica: int, since: float = 0.0) -> int:
        """Requests through ``replica`` started at or after ``since`` that completed."""
        return sum(
            1
            for s in self.results
            if s.replica == replica and s.started >= since and s.outcome == "completed"
        )

    def ended_since(self, t: float) -> list[Sent]:
        """Requests that ended at or after monotonic time ``t``."""
        return [s for s in self.results if s.ended >= t]


async def all_ready(replicas: Sequence[Replica]) -> bool:
    """Whether every replica passes its readiness check (``/health/ready``), as a load balancer asks."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        for replica in replicas:
            async with http.get(f"{replica.url}/health/ready") as resp:
                if resp.status != 200:
                    return False
    return True


def tally(sent: Sequence[Sent]) -> dict[int, Counter[str]]:
    """Outcomes per replica index."""
    per: dict[int, Counter[str]] = {}
    for s in sent:
        per.setdefault(s.replica, Counter())[s.outcome] += 1
    return per


def not_completed(sent: Sequence[Sent]) -> list[Sent]:
    return [s for s in sent if s.outcome != "completed"]


def killed_in_flight(sent: Sequence[Sent], replica: int, killed_at: float) -> list[Sent]:
    """Requests on ``replica`` that were in flight when it was killed (the only ones that may fail)."""
    return [s for s in sent if s.replica == replica and s.started <= killed_at <= s.ended]


# -- leader actions ---------------------------------------------------------------------------------


@dataclass
class Answered:
    """One admin write's answer."""

    at: float  # monotonic, when it was answered
    status: int
    body: str
    via: str  # the replica it was sent to


class Toggler:
    """Drains and undrains the spare instance, again and again, through the given replicas in turn:
    each drain or undrain the leader accepts is an agent command (a cordon would send none)."""

    def __init__(self, via: Sequence[Replica], pause_s: float = 0.05) -> None:
        self.via = list(via)
        self.pause_s = pause_s
        self.answers: list[Answered] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> list[Answered]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.answers

    async def _run(self) -> None:
        drain = True
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            n = 0
            while not self._stop.is_set():
                replica = self.via[n % len(self.via)]
                n += 1
                url = f"{replica.url}/admin/v1/instances/{SPARE}/{'drain' if drain else 'undrain'}"
                try:
                    async with http.post(url, headers=ADMIN) as resp:
                        body = await resp.text()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    status, body = 0, f"{type(exc).__name__}: {exc}"
                self.answers.append(Answered(time.monotonic(), status, body, replica.replica_id))
                if status == 200:
                    drain = not drain
                await asyncio.sleep(self.pause_s)
