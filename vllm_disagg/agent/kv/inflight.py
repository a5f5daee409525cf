"""What the connector's worker side has in flight: blocks still landing that vLLM waits for without
stopping its scheduler, and saves whose copies are not done yet. Pure bookkeeping (no torch, no I/O,
an injected clock), so that what vLLM is told, and when, is tested apart from an engine.

**Receives.** A request whose pool hit includes blocks a transfer is still bringing is loaded
asynchronously (vLLM parks it in ``WAITING_FOR_REMOTE_KVS`` and schedules others). Each step the
worker asks ``Receiving.decide`` which such requests are settled: every slot complete, or the first
one that is not has failed (``FAILED``) or is late. Of a settled request the leading complete slots
are loaded; the rest are load errors (vLLM recomputes from the first one). vLLM must hear of every
receive it started, failed or not, or it holds the request's blocks for good.

**Saves.** A step's save copies run while the next steps run; its blocks are committed to the pool
once the copies are done (``Saving.done``), in step order. A request that had blocks in a save keeps
its KV blocks after it finishes (the connector's ``request_finished`` says so, and the next step's
metadata names it) until no save in flight reads them; ``Saving.finished`` says when. vLLM must
hear only of requests it was told to wait for: the worker reports none it was not named.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from vllm_disagg.agent.kv.arena import FAILED


class Done(Protocol):
    """A copy queued on a device: ``query`` is True once it is complete (a CUDA event is one)."""

    def query(self) -> bool: ...


class _Finished:
    def query(self) -> bool:
        return True


FINISHED: Done = _Finished()  # a copy the host already did


@dataclass(frozen=True, slots=True)
class Receive:
    """An asynchronous load: the request's pinned slots, the engine blocks they go to, and when the
    blocks not landed by then are given up on."""

    req_id: str
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    deadline: float


@dataclass(frozen=True, slots=True)
class Settled:
    """A receive decided: load ``slots[:loaded]`` into ``block_ids[:loaded]``; the rest failed."""

    receive: Receive
    loaded: int
    late: bool  # the first block not loaded had not landed by the deadline (else it failed)

    @property
    def failed_blocks(self) -> tuple[int, ...]:
        return self.receive.block_ids[self.loaded :]


class Receiving:
    """Asynchronous loads the worker was given and has not reported yet."""

    def __init__(self) -> None:
        self._waiting: dict[str, Receive] = {}
        self._copying: list[tuple[str, Done]] = []  # settled, their copies queued

    def __len__(self) -> int:
        return len(self._waiting) + len(self._copying)

    def add(self, receive: Receive) -> None:
        self._waiting[receive.req_id] = receive

    def decide(self, layers_ready: Callable[[int], int], num_layers: int, now: float) -> list[Settled]:
        """The waiting receives that are settled now (see the module's docstring); they stop waiting."""
        settled = []
        for req_id, receive in list(self._waiting.items()):
            loaded, state = 0, num_layers
            for slot in receive.slots:
                state = layers_ready(slot)
                if state < num_layers:
                    break
                loaded += 1
            if loaded == len(receive.slots) or state == FAILED or now >= receive.deadline:
                del self._waiting[req_id]
                settled.append(Settled(receive, loaded, late=state != FAILED and loaded < len(receive.slots)))
        return settled

    def abandon(self) -> list[Receive]:
        """Every receive still waiting, which stops waiting (the pool it waited on is gone)."""
        out, self._waiting = list(self._waiting.values()), {}
        return out

    def copying(self, req_id: str, done: Done) -> None:
        """A settled receive's copies are queued: it is reported once ``done``."""
        self._copying.append((req_id, done))

    def finished(self) -> set[str]:
        """Receives whose copies are complete: what vLLM is told this step (once each)."""
        out = {req_id for req_id, done in self._copying if done.query()}
        if out:
            self._copying = [(r, d) for r, d in self._copying if r not in out]
        return out


@dataclass(frozen=True, slots=True)
class InFlightSave:
    """One step's save: the pool slots written, their keys, the requests whose blocks they copy."""

    owner: str
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]
    reqs: frozenset[str]
    done: Done


@dataclass
class Saving:
    """Saves in flight, oldest first, and the finished requests whose KV blocks vLLM keeps for them."""

    _saves: deque[InFlightSave] = field(default_factory=deque)
    _finishing: set[str] = field(default_factory=set)

    def add(self, save: InFlightSave) -> None:
        self._saves.append(save)

    def done(self) -> list[InFlightSave]:
        """The oldest saves whose copies are complete, in order (they stop being in flight)."""
        out = []
        while self._saves and self._saves[0].done.query():
            out.append(self._saves.popleft())
        return out

    def pending(self) -> list[InFlightSave]:
        return list(self._saves)

    def finishing(self, req_ids: Iterable[str]) -> None:
        """Finished requests whose KV blocks vLLM keeps until we report them (the scheduler side's
        ``request_finished`` said so)."""
        self._finishing.update(req_ids)

    def finished(self) -> set[str]:
        """Of those, the ones no save in flight reads any more: their blocks may go (once each)."""
        if not self._finishing:
            return set()
        busy: set[str] = set()
        for save in self._saves:
            busy |= save.reqs
        out = self._finishing - busy
        self._finishing -= out
        return out
