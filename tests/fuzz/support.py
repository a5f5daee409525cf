"""Support for the fuzz tests: servers on an event loop in a thread, a blocking raw agent socket, metrics.

Hypothesis runs a test body once per example and has no hook after the last one, but "the orchestrator
still serves afterwards" is checked after the last. So the servers under test (a real orchestrator,
real simulated engines, real fake agents) run on their own event loop in a thread, and a plain
synchronous test drives them from outside, over real sockets, before and after a nested ``@given``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import zmq
from hypothesis import HealthCheck, settings

from tests.helpers import ADMIN, metric_sum, parse_prometheus

T = TypeVar("T")

REFUSED = "vllm_disagg_protocol_refused_total"
CALL_TIMEOUT_S = 60.0  # a loaded 2-core box starts servers slowly; a hang still fails

# Every fuzz test's base settings; each sets its own max_examples.
FUZZ = settings(
    derandomize=True,  # the same examples on every run: a CI failure reproduces
    deadline=None,  # a loaded 2-core box; a hang is caught by each request's or reply's timeout instead
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)


class LoopThread:
    """An asyncio loop running in a daemon thread; ``run`` executes a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="fuzz-servers", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT_S) -> T:
        """Run ``coro`` on the loop; its result, or its exception re-raised here."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise AssertionError(f"{coro!r} did not finish within {timeout}s") from None

    def close(self) -> None:
        """Cancel what is left on the loop, stop it and join the thread."""

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_TIMEOUT_S)


class RawPeer:
    """A blocking ZeroMQ DEALER that sends any bytes, as a bad agent would.

    It chooses its routing id (agents leave that to the orchestrator's ROUTER; a bad peer may not).
    """

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, identity: bytes, monitor_events: int = 0
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        # ``monitor_events``: a monitor of these socket events, attached before the connection starts
        # (on loopback the handshake may be over before a monitor attached after ``connect`` hears it).
        self.monitor = self.sock.get_monitor_socket(monitor_events) if monitor_events else None
        # A DEALER without IMMEDIATE queues what is sent before the connection is up: no wait needed.
        self.sock.connect(endpoint)

    def send(self, parts: list[bytes]) -> None:
        """Send one message of these parts."""
        self.sock.send_multipart(parts)

    def recv(self, timeout_s: float) -> bytes:
        """The next single-part message, or fail after ``timeout_s`` (the orchestrator hung or died)."""
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no answer from the orchestrator within {timeout_s}s")
        parts = self.sock.recv_multipart()
        assert len(parts) == 1, f"the orchestrator sent a message of {len(parts)} parts"
        return parts[0]

    def close(self) -> None:
        """Close the socket (its queue is dropped), and its monitor."""
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """A blocking GET (with the admin token): status and body, whatever the status."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=ADMIN), timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()


def refused_counts(base_url: str) -> Counter[str]:
    """``vllm_disagg_protocol_refused_total`` by code, read from the orchestrator's ``/metrics``."""
    status, body = http_get(f"{base_url}/metrics")
    assert status == 200
    samples = parse_prometheus(body.decode())
    codes = {dict(labels).get("code", "") for name, labels in samples if name == REFUSED}
    return Counter({code: int(metric_sum(samples, REFUSED, code=code)) for code in codes})
