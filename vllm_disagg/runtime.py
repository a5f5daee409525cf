"""Process plumbing shared by every long-running subcommand: the event loop and stop signals."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# This interpreter running ``vllm-disagg``: how the cluster's children (agents, engines) are started.
SELF_ARGV = (sys.executable, "-c", "from vllm_disagg.cli.commands import main; raise SystemExit(main())")

# The orchestrator's secrets: a child other than the orchestrator (agents, engines, connect) never
# needs them, and an engine would log them among its unknown variables (vLLM does) or pass them on.
SECRET_ENV = ("VLLM_DISAGG_ADMIN_TOKEN", "VLLM_DISAGG_ENGINE_API_KEY")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without ``SECRET_ENV``, plus ``extra``: what children get."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env.update(extra or {})
    return env


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# Loaded once, in the parent: ``_prctl`` runs in forked children (``preexec_fn``), where looking the
# library up (``ctypes.util.find_library`` runs ``ldconfig``) would start a process per spawn.
# dlopen(NULL) reaches libc's symbols already loaded into this interpreter.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def run_service(main: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """Run ``main(stop)`` on uvloop (when installed); SIGINT/SIGTERM set ``stop`` instead of killing.

    ``main`` should return soon after ``stop`` is set, having cleaned up what it started.
    """

    async def wrapper() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            return await main(stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    return asyncio_run(wrapper())


def asyncio_run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def signal_group(pgid: int, sig: int) -> None:
    """Signal a process group that may already be gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """``preexec_fn`` for children: the kernel sends ``sig`` when the parent dies, even by SIGKILL.

    This is what guarantees that no engine outlives its agent, and no agent outlives ``up``.
    """
    _prctl(_PR_SET_PDEATHSIG, sig)


def _prctl(option: int, value: int) -> None:
    if _LIBC is None:
        return
    with contextlib.suppress(Exception):
        _LIBC.prctl(option, value, 0, 0, 0)


def become_subreaper() -> None:
    """Adopt this process's orphaned descendants (a dead engine's workers) instead of init.

    In a container whose init never reaps, orphans would stay zombies forever; call
    ``reap_children`` before exiting. Only for a process whose children are all its own engine's.
    """
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def reap_children() -> int:
    """Collect every child that has exited (adopted orphans included); the number reaped."""
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped += 1


def engine_preexec(niceness: int) -> Callable[[], None]:
    """``preexec_fn`` for an engine: die with the parent, and yield the CPU to the control plane.

    On a host the engines saturate, a positive ``niceness`` keeps the agents' heartbeats and the
    gateway responsive; they use little CPU, so the engines lose almost nothing.
    """

    def preexec() -> None:
        die_with_parent()
        if niceness:
            os.nice(niceness)

    return preexec
