"""Shared test helpers: free ports, polling a condition with a deadline, HTTP JSON calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


# The admin token of every orchestrator the tests start (see tests/conftest.py), and its header.
ADMIN_TOKEN = "tests-admin-token-4f1c2b9e7d"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# Ports for the servers tests start. Below Linux's ephemeral range (32768-60999): a port picked
# there can be taken by any outgoing connection's local end between the pick and the server's bind.
# And never the same port twice in a run: bind(0) may hand a just-closed port out again, and two
# picks that collide start two servers on one port (seen in CI: up's ZMQ port was its first
# engine's, and that engine never started).
_ALL_TEST_PORTS = range(10000, 30000)


def _share(ports: range) -> range:
    """This process's share of ``ports``: each pytest-xdist worker picks from its own slice, so two
    workers never pick one port (each checks only its own picks)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return ports
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = len(ports) // count
    start = ports.start + int(worker[2:]) * size
    return range(start, start + size)


_TEST_PORTS = _share(_ALL_TEST_PORTS)
_handed_out: set[int] = set()
_port_rng = random.Random(os.getpid())


def port_free(port: int) -> bool:
    """True when nothing listens on ``port`` on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, offsets: tuple[int, ...] = (0,)) -> int:
    """A base port where ``base + k + d`` (k < n, d in ``offsets``) are all free now and were never
    handed out before in this run; they are handed out now."""
    while True:
        base = _port_rng.randrange(_TEST_PORTS.start, _TEST_PORTS.stop - n - max(offsets))
        ports = {base + k + d for k in range(n) for d in offsets}
        if ports & _handed_out or not all(port_free(p) for p in ports):
            continue
        if len(_handed_out) > len(_TEST_PORTS) // 2:
            _handed_out.clear()  # a long run: the earliest ports' servers are long gone
        _handed_out.update(ports)
        return base


def free_port() -> int:
    """A TCP port free on loopback right now, and not handed out before in this run."""
    return free_ports(1)


# Overloads, not one union: mypy cannot solve ``T`` from a union of callables (an async probe's ``T``
# would be its coroutine). The async form is tried first, so a coroutine probe's result is what it returns.
@overload
async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    what: str = "condition",
) -> T: ...


@overload
async def eventually(
    probe: Callable[[], T | None],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    what: str = "condition",
) -> T: ...


async def eventually(
    probe: Callable[[], Awaitable[T | None]] | Callable[[], T | None],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns something truthy, or fail after ``timeout`` seconds.

    Exceptions from the probe count as "not yet" (a server still starting), and the last one is
    reported if the deadline passes.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = probe()
            if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
                result = await result
            if result:
                return result
        except Exception as exc:  # a probe of a starting server may fail any way
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_error!r}")
        await asyncio.sleep(interval)


def eventually_sync(
    probe: Callable[[], T | None], *, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
) -> T:
    """``eventually`` for synchronous fixtures."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = probe()
            if result:
                return result
        except Exception as exc:  # a probe of a starting server may fail any way
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_error!r}")
        time.sleep(interval)


def http_json(
    url: str,
    *,
    method: str = "GET",
    body: bytes | None = None,
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """A blocking HTTP call for fixtures: (status, parsed JSON or raw text)."""
    request = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def cli_argv(*args: str) -> list[str]:
    """The ``vllm-disagg`` command line as a child process of this interpreter."""
    return [
        sys.executable,
        "-c",
        "from vllm_disagg.cli.commands import main; raise SystemExit(main())",
        *args,
    ]


def parse_prometheus(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of a Prometheus exposition: {(name, labels): value}."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)", line)
        if not match:
            continue
        name, raw_labels, value = match.groups()
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', raw_labels or ""))
        samples[(name, labels)] = float(value)
    return samples


def metric_sum(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def sse_text(raw: bytes, *, chat: bool) -> str:
    """The generated text of an OpenAI SSE stream; asserts it ends with ``[DONE]``."""
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    parts = []
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            parts.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", ""))
    return "".join(parts)


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """SIGTERM a child that leads its process group; its exit code, or None if it had to be SIGKILLed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None


class TcpProxy:
    """A loopback TCP relay to ``port`` whose open connections a test can cut (``sever``).

    Stands in for a network blip: both ends see their connection reset, and a reconnect goes through.
    """

    def __init__(self, port: int) -> None:
        self._target = port
        self._server: asyncio.Server | None = None
        self._links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.accepted = 0  # connections relayed so far

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self._links.append((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.transport.abort()

    def sever(self) -> None:
        """Reset every connection relayed so far (new ones are still accepted)."""
        for down, up in self._links:
            down.transport.abort()
            up.transport.abort()
        self._links.clear()

    async def close(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
