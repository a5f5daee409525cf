"""The vLLM general plugin of this package: vLLM loads it in each of its processes (the entry point
``vllm.general_plugins`` in pyproject.toml), before any KV connector starts.

It acts only where the agent asked for it, by a variable in the engine's environment, so a vLLM that
merely shares a virtualenv with this package is left as it is:

- ``VLLM_DISAGG_NIXL_PROGRESS_NICE``: the niceness of the threads a NIXL agent starts. NIXL's UCX
  progress thread polls its workers with a zero timeout (NIXL's Python agent fixes the delay at 0),
  so each engine with the NIXL connector keeps a core busy for as long as it lives, idle or not:
  measured on CPU, an idle 1P1D pair held both cores of a 2-core machine. Niced, the thread still
  polls as NIXL means it to (a non-zero delay instead stalled pulls after a role swap until P's KV
  lease expired), but only with what the engines and every other process leave. And on any core:
  vLLM on CPU binds its worker to the engine's core and new threads inherit that, so the progress
  thread ran only when its own worker's spin-wait let it, and after a role swap a decode's NIXL
  handshake with the new prefill waited minutes for it. The agent sets it for NIXL engines on CPU
  (docs/engine.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

NIXL_PROGRESS_NICE_ENV = "VLLM_DISAGG_NIXL_PROGRESS_NICE"
_PATCHED = "_vllm_disagg_progress_nice"

log = logging.getLogger(__name__)


def register() -> None:
    """vLLM's hook: called on each plugin load in each vLLM process."""
    raw = os.environ.get(NIXL_PROGRESS_NICE_ENV, "")
    if raw:
        nice_nixl_threads(int(raw))


def nice_nixl_threads(niceness: int) -> bool:
    """Every NIXL agent created from now on in this process runs the threads it starts (the UCX
    progress thread among them) at ``niceness``. False where NIXL is not installed."""
    # vLLM sets this before its own first import of NIXL, which may now come after ours.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl._api import nixl_agent
    except ImportError:
        return False
    if getattr(nixl_agent, _PATCHED, None) is not None:  # vLLM loads plugins more than once per process
        return True
    init: Callable[..., None] = nixl_agent.__init__

    def niced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        before = _threads()
        init(self, *args, **kwargs)  # creates the backends, and with them their threads
        for tid in _threads() - before:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
                # vLLM on CPU binds its worker to the engine's core, and threads inherit it: there
                # the progress thread only runs when the worker's own spin-wait lets it, so the
                # transfers it serves stall; any core may run it.
                os.sched_setaffinity(tid, _all_cpus())
            except OSError as exc:  # gone already, or not ours to change
                log.warning("cannot lower NIXL thread %d: %s", tid, exc)

    nixl_agent.__init__ = niced_init
    setattr(nixl_agent, _PATCHED, niceness)
    return True


def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}
