"""The bounded streaming load: ``concurrency`` workers send a seeded mix of requests until a deadline
or a request count, whichever comes first, and every response is judged by the checker.

Requests mix ``/v1/completions`` and ``/v1/chat/completions``, streaming (by default most) and not;
prompts are a shared prefix (one of a few, so prefixes repeat and the prefix cache matters) plus a
varied tail. Each request carries its own ``X-Request-Id``, which fixes the response id. With replicas
the requests are spread over them (``spread.py``: round robin, a refused connection tried on the next),
one connection per request, and a failure on a replica killed while the request was in flight is
counted apart.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_disagg.chaos.check import Checker, Outcome, RequestSpec, Verdict
from vllm_disagg.chaos.spread import NO_REPLICA, Targets, health_check, post_spread

HEAD_BYTES = 300  # of a failed or garbled response, kept as an example
TAIL_BYTES = 300  # and its end, where an error event or a cut shows
FAILURE_BACKOFF_S = 0.05  # a worker's pause after a failed request, doubled while failures go on
FAILURE_BACKOFF_MAX_S = 1.0
_VOCABULARY = (
    "cache block decode prefill token stream engine agent gateway router batch queue latency "
    "kernel tensor layer model prompt answer request replica shard node pod signal restart "
    "session heartbeat budget window buffer socket frame packet retry resume fallback"
).split()
_ROLES = ("system", "user", "assistant")


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(rng.randint(low, high)))


class RequestPlanner:
    """A seeded stream of ``RequestSpec``: the same seed gives the same requests in the same order."""

    def __init__(
        self,
        rng: random.Random,
        run_tag: str,
        *,
        min_tokens: int,
        max_tokens: int,
        stream_fraction: float,
        chat_fraction: float = 0.5,
        usage_fraction: float = 0.2,
        prefixes: int = 8,
    ) -> None:
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}..{max_tokens}")
        self._rng = rng
        self._tag = run_tag
        self._min, self._max = min_tokens, max_tokens
        self._stream, self._chat, self._usage = stream_fraction, chat_fraction, usage_fraction
        # A few long shared openings (several KV blocks each): many prompts start the same way.
        self._prefixes = [f"Context {i}: {_words(rng, 15, 40)}." for i in range(prefixes)]
        self._count = 0

    def next(self) -> RequestSpec:
        """The next request."""
        rng = self._rng
        self._count += 1
        request_id = f"chaos-{self._tag}-{self._count}"
        stream = rng.random() < self._stream
        usage = stream and rng.random() < self._usage
        max_tokens = rng.randint(self._min, self._max)
        prefix = rng.choice(self._prefixes)
        tail = f"Question {self._count}: {_words(rng, 3, 12)}?"
        if rng.random() < self._chat:
            messages: list[tuple[str, str]] = [(_ROLES[0], prefix)]
            if rng.random() < 0.3:  # an earlier turn, as a conversation would have
                messages += [(_ROLES[1], _words(rng, 2, 8)), (_ROLES[2], _words(rng, 2, 8))]
            messages.append((_ROLES[1], tail))
            return RequestSpec(
                request_id, "chat", stream, max_tokens, messages=tuple(messages), include_usage=usage
            )
        return RequestSpec(
            request_id, "completion", stream, max_tokens, prompt=f"{prefix} {tail}", include_usage=usage
        )


@dataclass
class Tally:
    """Counts of outcomes and a few examples of each kind of failure."""

    max_examples: int = 5
    sent: int = 0
    completed: int = 0
    failed: int = 0
    garbled: int = 0
    abandoned: int = 0  # in flight when the run was interrupted: judged neither way
    failed_on_killed_replicas: int = 0  # of ``failed``: in flight on a replica when it was killed
    # Replicas: outcomes per replica index (a failure on a killed one as "killed").
    per_replica: dict[int, dict[str, int]] = field(default_factory=dict)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"failed": [], "garbled": []})

    def add(
        self,
        spec: RequestSpec,
        verdict: Verdict,
        status: int | None,
        body: bytes,
        at_s: float,
        *,
        replica: int | None = None,
        on_killed_replica: bool = False,
    ) -> None:
        """Count one judged response (and keep it as an example while there is room); ``replica``: the
        replica that took it, ``on_killed_replica``: it was killed while the request was in flight."""
        self.sent += 1
        if replica is not None:
            counts = self.per_replica.setdefault(replica, {})
            outcome = "killed" if verdict.outcome == "failed" and on_killed_replica else verdict.outcome
            counts[outcome] = counts.get(outcome, 0) + 1
        if verdict.outcome == "completed":
            self.completed += 1
            return
        if verdict.outcome == "failed":
            self.failed += 1
            self.failed_on_killed_replicas += on_killed_replica
        else:
            self.garbled += 1
        kept = self.examples[verdict.outcome]
        if len(kept) < self.max_examples:
            kept.append(
                {
                    "request_id": spec.request_id,
                    "path": spec.path,
                    "stream": spec.stream,
                    "status": status,
                    "reason": verdict.reason,
                    "head": body[:HEAD_BYTES].decode("utf-8", "replace"),
                    "tail": body[-TAIL_BYTES:].decode("utf-8", "replace") if len(body) > HEAD_BYTES else "",
                    "at_s": round(at_s, 3),
                    **(
                        {}
                        if replica is None
                        else {"replica": replica, "on_killed_replica": on_killed_replica}
                    ),
                }
            )


@dataclass(frozen=True)
class LoadConfig:
    """Where the load goes and its bounds."""

    base_url: str
    model: str
    concurrency: int
    duration_s: float
    max_requests: int
    request_timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    replica_urls: tuple[str, ...] = ()  # replicas: spread over these instead of ``base_url``

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_requests < 1 or not self.duration_s > 0:
            raise ValueError("concurrency, max_requests and duration_s must be positive")
        for url in (self.base_url, *self.replica_urls):
            if not url.startswith(("http://127.", "http://localhost", "http://[::1]")):
                raise ValueError(f"load goes to loopback only, not {url}")


class LoadGenerator:
    """Runs the workers; ``in_flight`` and the tally can be read while it runs."""

    def __init__(
        self,
        cfg: LoadConfig,
        planner: RequestPlanner,
        checker: Checker,
        tally: Tally,
        targets: Targets | None = None,
    ) -> None:
        self.cfg = cfg
        # Replicas: the rotation whoever kills them keeps (``ReplicaSet.targets``).
        self.targets = targets or Targets(cfg.replica_urls or (cfg.base_url,))
        self.replicated = len(self.targets.urls) > 1
        self.planner = planner
        self.checker = checker
        self.tally = tally
        self.in_flight = 0
        self._issued = 0
        self._started = time.monotonic()

    async def run(self, stop: asyncio.Event) -> float:
        """Send until the deadline, the request count or ``stop``; the seconds it ran.

        At the deadline no new request starts and those in flight finish (each bounded by the request
        timeout); ``stop`` abandons them at once.
        """
        cfg = self.cfg
        self._started = time.monotonic()
        deadline = self._started + cfg.duration_s
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
        # Replicas: one connection per request, as a load balancer's (a kept-alive one to a replica
        # that died would fail a request no live replica failed).
        connector = aiohttp.TCPConnector(limit=cfg.concurrency, force_close=self.replicated)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            workers = [
                asyncio.ensure_future(self._worker(session, deadline, stop)) for _ in range(cfg.concurrency)
            ]
            everyone = asyncio.gather(*workers, return_exceptions=True)
            stopped = asyncio.ensure_future(stop.wait())
            waits: list[asyncio.Future[Any]] = [everyone, stopped]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                for w in workers:
                    w.cancel()
                results = await everyone
        for result in results:
            if isinstance(result, Exception):  # a bug in the harness, not a failed request
                raise result
        return time.monotonic() - self._started

    async def _worker(self, session: aiohttp.ClientSession, deadline: float, stop: asyncio.Event) -> None:
        backoff = 0.0
        while not stop.is_set() and time.monotonic() < deadline and self._issued < self.cfg.max_requests:
            self._issued += 1
            if await self._one(session, self.planner.next()) != "failed":
                backoff = 0.0
                continue
            # A cluster with no instance left for a role fails every request at once: without a pause
            # the workers would spin, and the count of failures would measure only the client's speed.
            backoff = min(FAILURE_BACKOFF_MAX_S, max(FAILURE_BACKOFF_S, 2 * backoff))
            await asyncio.sleep(max(0.0, min(backoff, deadline - time.monotonic())))

    async def _one(self, session: aiohttp.ClientSession, spec: RequestSpec) -> Outcome:
        self.in_flight += 1
        headers = {"Content-Type": "application/json", "X-Request-Id": spec.request_id}
        started = time.monotonic()
        try:
            answer = await post_spread(
                session,
                self.targets,
                spec.path,
                spec.body(self.checker.model),
                headers,
                self.cfg.request_timeout_s,
            )
        except asyncio.CancelledError:
            self.tally.abandoned += 1
            raise
        finally:
            self.in_flight -= 1
        now = time.monotonic()
        verdict = self.checker.check(spec, answer.status, answer.body, answer.error)
        killed = answer.replica != NO_REPLICA and self.targets.killed_between(answer.replica, started, now)
        self.tally.add(
            spec,
            verdict,
            answer.status,
            answer.body,
            now - self._started,
            replica=answer.replica if self.replicated else None,
            on_killed_replica=killed,
        )
        return verdict.outcome


@dataclass(frozen=True)
class Sent:
    """One request of a ``SpreadLoad``: where it went, how it ended, and when (monotonic)."""

    replica: int  # index into the replicas' URLs; NO_REPLICA when every one refused the connection
    request_id: str
    outcome: Outcome
    reason: str
    started: float
    ended: float
    refused: int  # replicas that refused its connection first (not failures)


@dataclass
class SpreadLoad:
    """``concurrency`` workers sending requests over replicas' URLs, as a load balancer spreads them
    (``spread.post_spread``: a refused connection goes to the next replica, uncounted), each answer
    checked byte for byte and recorded with its replica; until ``stop``."""

    urls: Sequence[str]
    model: str
    concurrency: int = 12
    seed: int = 0
    prefix: str = "spread"  # of the request ids
    min_tokens: int = 24
    max_tokens: int = 48
    stream_fraction: float = 0.8
    request_timeout_s: float = 30.0
    health_path: str = ""  # checked on every replica as a load balancer does ("": no check)
    health_interval_s: float = 0.1
    results: list[Sent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.targets = Targets(self.urls)
        self._planner = RequestPlanner(
            random.Random(self.seed),
            f"{self.prefix}{self.seed}",
            min_tokens=self.min_tokens,
            max_tokens=self.max_tokens,
            stream_fraction=self.stream_fraction,
        )
        self._checker = Checker(self.model)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the workers."""
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> list[Sent]:
        """Start no more requests, let those in flight end; every result."""
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.results

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=3)
        # One connection per request, as a load balancer's: a kept-alive connection that a replica
        # closes as the client reuses it would fail a request that no replica failed.
        connector = aiohttp.TCPConnector(force_close=True, limit=self.concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            checks = None
            if self.health_path:  # its own connections: never queued behind the workers' requests
                checks = asyncio.ensure_future(
                    health_check(self.targets, self.health_path, self.health_interval_s)
                )
            try:
                await asyncio.gather(*(self._worker(http) for _ in range(self.concurrency)))
            finally:
                if checks is not None:
                    checks.cancel()
                    await asyncio.gather(checks, return_exceptions=True)

    async def _worker(self, http: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            spec = self._planner.next()
            started = time.monotonic()
            headers = {"Content-Type": "application/json", "X-Request-Id": spec.request_id}
            body = spec.body(self.model)
            answer = await post_spread(http, self.targets, spec.path, body, headers, self.request_timeout_s)
            verdict = self._checker.check(spec, answer.status, answer.body, answer.error)
            self.results.append(
                Sent(answer.replica, spec.request_id, verdict.outcome, verdict.reason, started,
                     time.monotonic(), answer.refused)
            )  # fmt: skip
            if verdict.outcome != "completed":
                await asyncio.sleep(0.05)  # a cluster that fails everything must not be spun against
