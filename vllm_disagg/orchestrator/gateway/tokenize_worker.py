"""One thread that runs slow tokenizations for the event loop, with a bounded queue.

A Hugging Face tokenizer and its jinja chat template take milliseconds of Python for a long prompt; run
on the loop, that time stalls every other request's relay. On this thread the loop still runs between
GIL switches (every ``sys.getswitchinterval()``, 5 ms by default), and a prompt stalls the loop for at
most that long instead of for its whole render. One thread is enough: the tokenizer and jinja hold the
GIL, so a second one would not run at the same time; and a fast tokenizer, whose truncation and
padding settings transformers sets on each call, is never used from two threads at once.

At most ``max_pending`` distinct tokenizations wait or run; beyond that a request is not delayed but
scheduled on its estimate (``submit`` answers None, counted). The same key in flight twice runs once.
Results reach the loop through ``call_soon_threadsafe``: ``done`` (the cache) first, then each waiter
still waiting, so a waiter cancelled by a client that left changes nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

log = logging.getLogger(__name__)

Ids = list[int] | None
_Outcome = concurrent.futures.Future[tuple[Ids, float]]
DEFAULT_MAX_PENDING = 64


class TokenizeMetrics(Protocol):
    """What the worker reports (``OrchestratorMetrics`` implements it)."""

    def tokenize_done(self, seconds: float) -> None: ...

    def tokenize_queue_full(self) -> None: ...

    def tokenize_queue_depth(self, depth: int) -> None: ...


class _NoMetrics:
    def tokenize_done(self, seconds: float) -> None:
        pass

    def tokenize_queue_full(self) -> None:
        pass

    def tokenize_queue_depth(self, depth: int) -> None:
        pass


@dataclass(eq=False, slots=True)
class _Job:
    loop: asyncio.AbstractEventLoop
    done: Callable[[Ids], object]
    waiters: list[asyncio.Future[Ids]] = field(default_factory=list)


def _timed(work: Callable[[], Ids]) -> tuple[Ids, float]:
    started = time.perf_counter()
    ids = work()
    return ids, time.perf_counter() - started


class TokenizeWorker:
    """Runs ``work`` callables on one thread, at most ``max_pending`` distinct keys at a time."""

    def __init__(
        self, max_pending: int = DEFAULT_MAX_PENDING, metrics: TokenizeMetrics | None = None
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self._max_pending = max_pending
        self._metrics = metrics or _NoMetrics()
        self._jobs: dict[Hashable, _Job] = {}  # waiting or running, by key; touched on the loop only
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # started on first use
        self._closed = False

    def submit(
        self, key: Hashable, work: Callable[[], Ids], done: Callable[[Ids], object]
    ) -> asyncio.Future[Ids] | None:
        """A future of ``work()`` run on the thread, or None at once when the queue is full or closed.

        Call on the event loop. A key already in flight shares that run (its ``work`` and ``done``).
        ``done`` gets the result on the loop before the waiters, even when they were all cancelled;
        a run that raised or was cancelled by ``close`` gives waiters None and skips ``done``.
        """
        job = self._jobs.get(key)
        if job is None:
            if self._closed or len(self._jobs) >= self._max_pending:
                self._metrics.tokenize_queue_full()
                return None
            job = self._start(key, work, done)
            if job is None:
                return None
        waiter: asyncio.Future[Ids] = job.loop.create_future()
        job.waiters.append(waiter)
        return waiter

    def pending(self) -> int:
        """Distinct tokenizations waiting or running."""
        return len(self._jobs)

    def close(self) -> None:
        """Stop the thread: queued work is dropped (its waiters get None), the running one finishes."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _start(self, key: Hashable, work: Callable[[], Ids], done: Callable[[Ids], object]) -> _Job | None:
        job = _Job(asyncio.get_running_loop(), done)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize-worker")
        try:
            outcome = self._executor.submit(_timed, work)
        except RuntimeError:  # the interpreter is shutting down
            return None
        self._jobs[key] = job
        self._metrics.tokenize_queue_depth(len(self._jobs))
        # Runs on the worker thread, or here if it is already done: either way _finish runs later,
        # from the loop's queue, once the job is in _jobs.
        outcome.add_done_callback(partial(self._hand_back, key, job))
        return job

    def _hand_back(self, key: Hashable, job: _Job, outcome: _Outcome) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            job.loop.call_soon_threadsafe(self._finish, key, job, outcome)

    def _finish(self, key: Hashable, job: _Job, outcome: _Outcome) -> None:
        if self._jobs.get(key) is job:
            del self._jobs[key]
        self._metrics.tokenize_queue_depth(len(self._jobs))
        ids: Ids = None
        if outcome.cancelled():
            pass  # dropped by close(): nothing was computed, nothing to remember
        elif (exc := outcome.exception()) is not None:
            log.warning("a tokenization failed on the worker thread", exc_info=exc)
        else:
            ids, seconds = outcome.result()
            self._metrics.tokenize_done(seconds)
            job.done(ids)
        for waiter in job.waiters:
            if not waiter.done():  # a cancelled waiter is done
                waiter.set_result(ids)
