"""``bench ha``'s failover and staleness measurements, on a running ``HaCluster`` of replicas.

**Failover** (one run): a streaming load spread over every replica's port (``chaos.spread``: a refused
connection goes to the next replica, as a load balancer's retry; every answer checked byte for byte by
``chaos.check``), and a loop that drains and undrains the spare instance through a surviving replica
(each one the leader accepts is an agent command). Once every replica serves and the leader has
commanded, and after ``before_s`` of steady load, the leader leaves the rotation (a load balancer's
health check) and is SIGKILLed. Failover time: from the monotonic clock read right before ``os.kill``
to the first command of a newer epoch that an agent accepted, as its ``--command-log`` says (one host:
the agents' monotonic clocks are this process's). Requests in flight on the killed replica's
connections fail with it; every other one must complete.

**Staleness** (one sample): with no other load, one long stream is sent to replica A while two tasks
poll A's and B's ``GET /admin/v1/instances`` without pause; how much later B's in-flight counts include
the request than A's do (B hears them over the replicas' link), and how much later they stop
including it once it ends.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.bench.compare import percentile
from vllm_disagg.bench.ha_cluster import MODEL, SPARE, HaCluster, Leadership
from vllm_disagg.chaos.load import Sent, SpreadLoad
from vllm_disagg.orchestrator.admin.auth import admin_headers

_JSON = {"Content-Type": "application/json"}
_WAIT_S = 60.0  # for a new leader's first command, or enough load: far beyond any failover


@dataclass(frozen=True)
class FailoverRun:
    """One SIGKILL of the leader under load."""

    killed: str  # the replica id
    new_leader: str
    old_epoch: int
    new_epoch: int
    failover_s: float  # SIGKILL -> an agent accepted the new epoch's first command
    survivors_requests: int  # requests the replicas that lived took, before and after the kill
    survivors_failed: int  # of those, not completed with the right bytes: should be 0
    victim_in_flight: int  # requests on the killed replica's connections when it died
    victim_failed: int
    admin_writes_refused: int  # drain/undrain answers other than 200 between the kill and the failover
    before_p50_ms: float  # survivors' requests that ended in the ``before_s`` before the kill
    before_p99_ms: float
    during_p50_ms: float  # survivors' requests in flight between the kill and 1 s after the first command
    during_p99_ms: float
    during_requests: int


@dataclass(frozen=True)
class StalenessSample:
    """One long request on replica ``a``: when ``a``'s and ``b``'s in-flight counts showed it."""

    a: str
    b: str
    start_lag_ms: float  # b's counts included it this much later than a's
    end_lag_ms: float  # b's counts dropped it this much later than a's
    a_start_ms: float  # from sending the request to a's counts including it
    poll_ms: float  # the median time one admin poll took: the resolution of the figures above


class Toggler:
    """Drains and undrains the spare through one replica, again and again: (time, status) answers."""

    def __init__(self, cluster: HaCluster, via: int, pause_s: float = 0.05) -> None:
        self.url = cluster.urls[via]
        self.headers = admin_headers(cluster.token)
        self.pause_s = pause_s
        self.answers: list[tuple[float, int]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start toggling."""
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop after the write in progress."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        drain = True
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while not self._stop.is_set():
                url = f"{self.url}/admin/v1/instances/{SPARE}/{'drain' if drain else 'undrain'}"
                try:
                    async with http.post(url, headers=self.headers) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError):
                    status = 0
                self.answers.append((time.monotonic(), status))
                if status == 200:
                    drain = not drain
                await asyncio.sleep(self.pause_s)


async def until(
    probe: Callable[[], object], what: str, timeout_s: float = _WAIT_S, interval_s: float = 0.02
) -> None:
    """Poll ``probe()`` until it is true; ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench ha: no {what} within {timeout_s:g} s")
        await asyncio.sleep(interval_s)  # other processes' doing: the loop's own clock


async def failover_run(
    cluster: HaCluster, agreed: Leadership, *, concurrency: int, before_s: float, seed: int
) -> FailoverRun:
    """SIGKILL the leader under load and measure; the killed replica stays dead (the caller restarts it)."""
    victim = cluster.index_of(agreed.leader)
    survivor = next(i for i in range(len(cluster.urls)) if i != victim)
    load = SpreadLoad(
        cluster.urls, MODEL, concurrency, seed, prefix="ha", min_tokens=16, max_tokens=32, stream_fraction=1.0
    )
    toggler = Toggler(cluster, survivor)
    load.start()
    toggler.start()
    try:
        await until(lambda: _warm(cluster, load, agreed.epoch), "load on every replica and leader commands")
        await asyncio.sleep(before_s)
        load.targets.take_out(victim)
        killed_at = cluster.kill(victim)
        load.targets.killed(victim, killed_at)
        first: list[float] = []
        await until(lambda: _first_newer(cluster, agreed.epoch, first), "command of a newer epoch")
        acted_at = first[0]
        await until(lambda: any(s.started > acted_at + 1.0 for s in load.results), "load after the failover")
    finally:
        sent = await load.stop()
        await toggler.stop()
    new = await cluster.ready([i for i in range(len(cluster.urls)) if i != victim], _WAIT_S)
    assert new is not None
    return _summarise(agreed, new, sent, toggler.answers, victim, killed_at, acted_at, before_s)


def _warm(cluster: HaCluster, load: SpreadLoad, epoch: int) -> bool:
    done = [s.replica for s in load.results if s.outcome == "completed"]
    commanded = sum(1 for r in cluster.command_logs() if r.accepted and r.epoch == epoch)
    return commanded >= 2 and all(done.count(i) >= 3 for i in range(len(cluster.urls)))


def _first_newer(cluster: HaCluster, epoch: int, found: list[float]) -> bool:
    newer = [r.mono for r in cluster.command_logs() if r.accepted and r.epoch > epoch]
    if newer:
        found.append(min(newer))
    return bool(newer)


def _summarise(
    old: Leadership,
    new: Leadership,
    sent: list[Sent],
    answers: list[tuple[float, int]],
    victim: int,
    killed_at: float,
    acted_at: float,
    before_s: float,
) -> FailoverRun:
    on_victim = [s for s in sent if s.replica == victim and s.started <= killed_at <= s.ended]
    survivors = [s for s in sent if s.replica != victim]
    before = [
        s for s in survivors if killed_at - before_s <= s.ended < killed_at and s.outcome == "completed"
    ]
    during = [s for s in survivors if s.ended >= killed_at and s.started <= acted_at + 1.0]
    b50, b99 = _p50_p99(before)
    d50, d99 = _p50_p99([s for s in during if s.outcome == "completed"])
    return FailoverRun(
        killed=old.leader,
        new_leader=new.leader,
        old_epoch=old.epoch,
        new_epoch=new.epoch,
        failover_s=acted_at - killed_at,
        survivors_requests=len(survivors),
        survivors_failed=sum(1 for s in survivors if s.outcome != "completed"),
        victim_in_flight=len(on_victim),
        victim_failed=sum(1 for s in on_victim if s.outcome != "completed"),
        admin_writes_refused=sum(
            1 for at, status in answers if killed_at <= at <= acted_at and status != 200
        ),
        before_p50_ms=b50,
        before_p99_ms=b99,
        during_p50_ms=d50,
        during_p99_ms=d99,
        during_requests=len(during),
    )


def _p50_p99(sent: list[Sent]) -> tuple[float, float]:
    latencies = [s.ended - s.started for s in sent]
    if not latencies:
        return 0.0, 0.0
    return statistics.median(latencies) * 1e3, percentile(latencies, 0.99) * 1e3


async def staleness_sample(cluster: HaCluster, a: int, b: int, max_tokens: int) -> StalenessSample:
    """One long stream on replica ``a``, polled on ``a`` and ``b`` (no other load may run)."""
    stop = asyncio.Event()
    seen: dict[int, list[tuple[float, int]]] = {a: [], b: []}
    polls: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        pollers = [asyncio.ensure_future(_poll(cluster, http, i, seen[i], polls, stop)) for i in (a, b)]
        try:
            await until(lambda: len(seen[a]) > 2 and len(seen[b]) > 2, "admin answers")
            body = {"model": MODEL, "prompt": "staleness " * 8, "max_tokens": max_tokens, "stream": True}
            sent_at = time.monotonic()
            async with http.post(
                f"{cluster.urls[a]}/v1/completions", data=jsonutil.dumps(body), headers=_JSON
            ) as resp:
                await resp.read()
            ended_at = time.monotonic()
            await until(
                lambda: _dropped(seen[a], ended_at) and _dropped(seen[b], ended_at), "count back to 0"
            )
        finally:
            stop.set()
            await asyncio.gather(*pollers)
    a_on, a_off = _edges(seen[a], sent_at)
    b_on, b_off = _edges(seen[b], sent_at)
    names = [f"orchestrator-{i}" for i in (a, b)]
    return StalenessSample(
        a=names[0],
        b=names[1],
        start_lag_ms=(b_on - a_on) * 1e3,
        end_lag_ms=(b_off - a_off) * 1e3,
        a_start_ms=(a_on - sent_at) * 1e3,
        poll_ms=statistics.median(polls) * 1e3,
    )


async def _poll(
    cluster: HaCluster,
    http: aiohttp.ClientSession,
    index: int,
    into: list[tuple[float, int]],
    durations: list[float],
    stop: asyncio.Event,
) -> None:
    """``GET /admin/v1/instances`` on ``index`` without pause: (midpoint time, total in flight)."""
    while not stop.is_set():
        t0 = time.monotonic()
        body = await cluster.get(http, index, "/admin/v1/instances")
        t1 = time.monotonic()
        if isinstance(body, dict) and isinstance(body.get("instances"), list):
            total = sum(int(i.get("in_flight", 0)) for i in body["instances"] if isinstance(i, dict))
            into.append(((t0 + t1) / 2, total))
            durations.append(t1 - t0)


def _dropped(seen: list[tuple[float, int]], after: float) -> bool:
    return any(t > after and n == 0 for t, n in seen)


def _edges(seen: list[tuple[float, int]], sent_at: float) -> tuple[float, float]:
    """When the counts first included the request (after ``sent_at``), and when they first no longer
    did after the last poll that showed it (a gap between its two legs is not its end)."""
    shown = [t for t, n in seen if t >= sent_at and n > 0]
    off = next((t for t, n in seen if shown and t > shown[-1] and n == 0), None)
    if not shown or off is None:
        raise RuntimeError(
            "bench ha: a poll never saw the request in flight (make it longer: --stale-tokens)"
        )
    return shown[0], off
