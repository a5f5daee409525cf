"""Requests spread over orchestrator replicas as a load balancer spreads them, and who is to blame.

``Targets`` holds the replicas' base URLs: each request goes to the next one in rotation (round robin).
A replica that refuses the connection (nothing listens: it died, or it is stopping) has not seen the
request, so the request goes to the next replica, as a load balancer retries a connect that failed;
only a request a replica accepted can fail. Whoever kills a replica takes it out of the rotation first
(``take_out``: the load balancer's health check noticed), records the kill (``killed``), and puts it
back once it is serving again (``put_back``); a request whose replica was killed while it was in
flight failed *on a killed replica's connection*, every other failure is a live replica's.
``health_check`` is the load balancer's own check: a replica whose health path fails (an error status,
no answer) is out of the rotation until it passes again; a replica that stops gracefully fails it
first (``--shutdown-delay-s``), so no request reaches it as it stops listening.

With one URL (a single orchestrator) this is just that URL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

NO_REPLICA = -1  # Answer.replica when every replica refused the connection


class Targets:
    """The replicas' base URLs, the rotation, and when each was killed."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("at least one target URL")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._out: set[int] = set()
        self._unhealthy: set[int] = set()  # the health check's verdict, apart from take_out's
        self._next = 0
        self._kills: dict[int, list[float]] = {i: [] for i in range(len(self.urls))}

    @property
    def in_rotation(self) -> list[int]:
        """The replicas requests go to now."""
        return [i for i in range(len(self.urls)) if i not in self._out and i not in self._unhealthy]

    def take_out(self, index: int) -> None:
        """No new request goes to ``index`` (it is about to die, or is not serving yet)."""
        self._out.add(index)

    def put_back(self, index: int) -> None:
        """Requests go to ``index`` again."""
        self._out.discard(index)

    def checked(self, index: int, healthy: bool) -> None:
        """The health check's latest verdict on ``index``."""
        if healthy:
            self._unhealthy.discard(index)
        else:
            self._unhealthy.add(index)

    def killed(self, index: int, at: float) -> None:
        """``index`` was killed at monotonic time ``at``."""
        self._kills[index].append(at)

    def killed_between(self, index: int, start: float, end: float) -> bool:
        """Whether ``index`` was killed while a request on it ran from ``start`` to ``end``."""
        return any(start <= at <= end for at in self._kills.get(index, ()))

    def pick(self, tried: set[int]) -> int | None:
        """The next replica in rotation not in ``tried``; None when none is left. Where the health check
        failed every replica not taken out (checks that timed out on a stalled host, say), it fails
        open, as load balancers do (Envoy's panic threshold, a cloud balancer with no healthy target):
        the requests go to those replicas rather than nowhere."""
        n = len(self.urls)
        passes: tuple[Collection[int], ...] = (self._unhealthy, ())
        for skip in passes:
            for step in range(n):
                i = (self._next + step) % n
                if i not in self._out and i not in skip and i not in tried:
                    self._next = (i + 1) % n
                    return i
            if any(i not in self._out and i not in self._unhealthy for i in range(n)):
                return None  # a healthy replica was there, and refused: not a failed health check
        return None


async def health_check(targets: Targets, path: str, interval_s: float, timeout_s: float = 1.0) -> None:
    """Check every replica's ``path`` each ``interval_s``, as a load balancer does, until cancelled:
    a 2xx passes, anything else (a 503, a refused connection, no answer in ``timeout_s``) fails."""

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        try:
            async with session.get(targets.urls[index] + path) as resp:
                targets.checked(index, 200 <= resp.status < 300)
        except (aiohttp.ClientError, TimeoutError):
            targets.checked(index, False)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        while True:
            await asyncio.gather(*(one(session, i) for i in range(len(targets.urls))))
            await asyncio.sleep(interval_s)


@dataclass(frozen=True, slots=True)
class Answer:
    """What came back for one request, and from which replica."""

    replica: int  # the replica that took the request (NO_REPLICA: none did)
    status: int | None  # None when no status line came
    body: bytes  # every byte received (a broken stream's too)
    error: str  # a transport error or timeout; "" when the response ended cleanly
    refused: int  # replicas that refused the connection before one took the request


async def post_spread(
    session: aiohttp.ClientSession,
    targets: Targets,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout_s: float,
) -> Answer:
    """POST ``body`` to ``path`` on the next replica in rotation, going on to the next while the
    connection is refused; the whole answer, however it ended. Cancellation propagates."""
    tried: set[int] = set()
    while (i := targets.pick(tried)) is not None:
        status: int | None = None
        chunks: list[bytes] = []
        error = ""
        try:
            async with session.post(targets.urls[i] + path, data=body, headers=headers) as resp:
                status = resp.status
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, ConnectionRefusedError) and status is None:
                tried.add(i)  # the request never left: a load balancer tries the next one
                continue
            error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            error = f"no complete answer within {timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        return Answer(i, status, b"".join(chunks), error, len(tried))
    return Answer(NO_REPLICA, None, b"", "every replica refused the connection", len(tried))
