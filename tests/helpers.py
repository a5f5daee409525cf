"""Shared test helpers: free ports, polling a condition with a deadline, HTTP JSON calls."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
                return result  # type: ignore[return-value]
        except Exception as exc:  # noqa: BLE001 - a probe of a starting server may fail any way
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_error!r}")
        await asyncio.sleep(interval)
