"""Block copies between an engine's KV cache and the pool's host slots, on the cache's own device.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``), in its backend's
layout, on the engine's device; the pool's slots are host shared memory (``arena.py``). A save copies
a layer's blocks out once the layer ran; a load copies them in before it runs.

- **CPU cache** (the CPU build this project is tested on): ``Tensor.copy_`` where it is asked.
- **CUDA cache**: the arena's mapping is registered with CUDA as page-locked memory
  (``cudaHostRegister``) once, so that each copy is one DMA and not a copy through a staging buffer;
  where CUDA refuses, copies still work, slower. Copies run on one side stream:

  * a **save** first makes the side stream wait for the compute stream's work so far (the layer's
    KV is written: a stream dependency, not a host wait), copies the layer's blocks out, and records
    an event per layer; ``saves_done`` hands the last one to the connector, which commits the slots
    once it has happened (``inflight.py``): the host never waits for a save. A preemption may give
    a saved block to another request before its copy ran: ``order_after`` makes the compute stream
    wait for the saves first;
  * a **load** makes the side stream wait for the compute stream too (a block just given to this
    request may still be read by the kernels of the step before), copies the blocks in, records an
    event, and makes the compute stream wait on that event: the layer's attention starts after its
    copy, and the host never waits. The pins of the slots are released two steps later by the
    scheduler side, after the step's output (so its compute stream, so the copies) is done;
  * an **asynchronous load** (blocks that landed while vLLM scheduled other requests) copies the
    same way outside a forward pass, and hands its event back (``load_async``): the request is
    reported loaded once it has happened.

``scripts/gpu_check.sh`` measures this path against a plain pinned-memory copy of the same bytes
with torch alone (``gpu_check.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm_disagg.agent.kv.inflight import FINISHED, Done

# (source block, destination block): views of one layer's block, the same shape and dtype.
Pairs = Iterable[tuple[torch.Tensor, torch.Tensor]]


class BlockCopier:
    """Copies between a KV cache on ``device`` and host slots (see the module's docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._saved: torch.cuda.Event | None = None  # the last save's event, until waited on
        self._pinned: list[int] = []  # host addresses registered with CUDA

    @classmethod
    def for_caches(cls, caches: Iterable[torch.Tensor]) -> BlockCopier:
        """A copier for the device the (first) KV cache tensor lives on; CPU if there is none."""
        first = next(iter(caches), None)
        return cls(first.device if first is not None else torch.device("cpu"))

    def pin(self, host: memoryview) -> bool:
        """Register ``host`` (the arena's whole mapping) as page-locked memory, until ``close``. False
        where the cache is not on CUDA, or CUDA refused (copies then stage through its own buffer)."""
        if not self.cuda or not host.nbytes:
            return False
        address = torch.frombuffer(host, dtype=torch.uint8).data_ptr()  # the view goes; the map stays
        if int(torch.cuda.cudart().cudaHostRegister(address, host.nbytes, 0)) != 0:
            return False
        self._pinned.append(address)
        return True

    def save(self, pairs: Pairs) -> None:
        """Copy each (cache block, slot block) pair out of the cache."""
        event = self._copy(pairs)
        if event is not None:  # the last one: the side stream runs them in order
            self._saved = event

    def saves_done(self) -> Done:
        """What tells when every save so far is in its slots (on CPU they already are)."""
        saved, self._saved = self._saved, None
        return FINISHED if saved is None else saved

    def order_after(self, done: Done) -> None:
        """Make the compute stream's next work wait for ``done`` (a save's copy): no host wait."""
        if self.cuda and isinstance(done, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(done)

    def wait_saves(self) -> None:
        """Return once every save so far is in its slots (the host waits for the last one's event)."""
        saved, self._saved = self._saved, None
        if saved is not None:
            saved.synchronize()

    def load(self, pairs: Pairs) -> None:
        """Copy each (slot block, cache block) pair into the cache, before the compute stream's next
        kernel reads it."""
        event = self._copy(pairs)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def load_async(self, pairs: Pairs) -> Done:
        """Copy each (slot block, cache block) pair into the cache outside a forward pass; what tells
        when they are there."""
        event = self._copy(pairs)
        done: Done = FINISHED if event is None else event
        return done

    def _copy(self, pairs: Pairs) -> torch.cuda.Event | None:
        """Each (source, destination) pair: at once on CPU (None); on CUDA, on the side stream after
        the compute stream's work so far, and the event that says when the copies are done."""
        stream = self._stream
        if stream is None:
            for src, dst in pairs:
                dst.copy_(src)
            return None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def unpin(self) -> None:
        """Wait for every copy, and unregister the host memory (before its mapping goes)."""
        self.wait_saves()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
            assert self._stream is not None
            self._stream.synchronize()
            cudart = torch.cuda.cudart()
            for address in self._pinned:
                cudart.cudaHostUnregister(address)
        self._pinned.clear()

    def close(self) -> None:
        """Wait for the copies, and unregister the host memory (before its mapping goes)."""
        self.unpin()
