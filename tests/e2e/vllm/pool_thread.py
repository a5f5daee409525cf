"""The agent's pool on its own event loop in a thread of the test's process, as it runs on the
agent's loop: an engine's worker can open it while the test waits for the engine, and the test can
look into it (or play a transfer) between requests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from vllm_disagg.agent.kv.agent_pool import KvPool
from vllm_disagg.config import AgentConfig

T = TypeVar("T")


class PoolThread:
    """The agent's pool on its own event loop, in a thread; ``call`` runs a function on that loop."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.pool: KvPool = asyncio.run_coroutine_threadsafe(KvPool.start(cfg), self.loop).result(30)

    def call(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.pool.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()
