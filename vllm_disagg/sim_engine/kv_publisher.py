"""The simulated engine's KV-cache events: a ZeroMQ PUB socket speaking vLLM's wire format.

Sends never block the engine: a batch a slow or absent subscriber cannot take now is dropped, as a
PUB socket drops beyond its high-water mark anyway (subscribers resynchronise on ``AllBlocksCleared``
or by dropping the instance).
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from vllm_disagg.clock import Clock
from vllm_disagg.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, encode_batch

_SEND_HWM = 10_000  # batches queued for a subscriber before new ones are dropped


def publisher_endpoint(port: int) -> str:
    """Where the sim publishes: loopback only, as the events carry prompts and only its agent reads them."""
    return f"tcp://127.0.0.1:{port}"


class KvEventPublisher:
    """Publishes one batch per prefix-cache change on ``tcp://127.0.0.1:<port>`` (a ``CacheListener``)."""

    def __init__(self, port: int, block_size: int, clock: Clock) -> None:
        self._block_size = block_size
        self._clock = clock
        self._seq = 0
        self.dropped = 0  # batches not sent because the socket could not take them now
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        try:
            self._sock.bind(publisher_endpoint(port))
        except zmq.ZMQError:
            self.close()
            raise

    def _publish(self, event: KvEvent) -> None:
        frames = encode_batch(self._seq, self._clock.wall(), (event,))
        self._seq += 1
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int]) -> None:
        """Blocks entered the prefix cache."""
        self._publish(BlockStored(tuple(hashes), parent, tuple(token_ids), self._block_size))

    def removed(self, hashes: Sequence[int]) -> None:
        """Blocks were evicted."""
        self._publish(BlockRemoved(tuple(hashes)))

    def cleared(self) -> None:
        """The prefix cache was emptied."""
        self._publish(AllBlocksCleared())

    def close(self) -> None:
        """Close the socket and its context (pending batches are dropped)."""
        self._sock.close(linger=0)
        self._ctx.term()
