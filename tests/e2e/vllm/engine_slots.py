"""At most two real vLLM engines at once on this machine, whichever test process starts them.

The suite runs in parallel (pytest-xdist), and real vLLM tests sit in several modules: two workers
each starting a 1P1D cluster would run four engines on two cores, and every engine would start and
answer at half speed or worse. Each engine start first takes a slot: one of ``SLOTS`` lock files in
the machine's temporary directory, held with ``flock`` for as long as the engine may run. The
kernel drops a lock when its holder dies, so a killed run leaves nothing to clean up. The slots are
machine-wide on purpose: two suites run side by side (two clones) share the machine's two cores too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

SLOTS = 2
WAIT_S = 3600.0  # a whole other suite's real-vLLM tests may run first
_POLL_S = 0.5

_held_here = 0  # slots this process holds: asking for more than SLOTS would wait on itself


def _slot_dir() -> Path:
    path = Path(tempfile.gettempdir()) / "vllm-disagg-engine-slots"
    path.mkdir(exist_ok=True)
    return path


def _try_lock(path: Path, owner: str) -> IO[str] | None:
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.truncate(0)
    handle.write(owner)
    handle.flush()
    return handle


def _owners(directory: Path) -> str:
    return "; ".join(f"{p.name}: {p.read_text() or '?'}" for p in sorted(directory.glob("slot-*")))


@contextlib.contextmanager
def engine_slots(n: int, what: str) -> Iterator[None]:
    """Hold ``n`` engine slots while the body runs (``what`` names the holder in the slot files).

    Taken all at once under a queue lock, so a test that needs two never waits holding one while
    another that needs two waits holding the other."""
    global _held_here
    if not 0 < n <= SLOTS - _held_here:
        raise ValueError(f"{what} asks for {n} engine slots; this process holds {_held_here} of {SLOTS}")
    directory = _slot_dir()
    owner = f"pid {os.getpid()} {os.environ.get('PYTEST_XDIST_WORKER', '')} {what}"
    held: list[IO[str]] = []
    deadline = time.monotonic() + WAIT_S
    with (directory / "queue").open("a+") as queue:
        fcntl.flock(queue, fcntl.LOCK_EX)  # first come, first served: one taker at a time
        try:
            while len(held) < n:
                for k in range(SLOTS):
                    if len(held) < n and (handle := _try_lock(directory / f"slot-{k}", owner)):
                        held.append(handle)
                if len(held) < n:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{what}: no {n} engine slots in {WAIT_S} s ({_owners(directory)})"
                        )
                    time.sleep(_POLL_S)  # waiting on another process's engines: polled, with a deadline
        except BaseException:
            for handle in held:
                handle.close()
            raise
    _held_here += n
    try:
        yield
    finally:
        _held_here -= n
        for handle in held:
            handle.truncate(0)
            handle.close()  # closing the file drops its lock
