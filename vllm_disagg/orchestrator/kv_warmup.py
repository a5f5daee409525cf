"""Ready means its KV link works: a fresh engine's link is proven by a warm-up before it is routed to.

An instance whose connector sets its link up at the first transfer (``state/instance.py``: NIXL) is
``joining`` from the moment its engine is ready until one request has moved KV over its link: this
module sends that request. For a pending instance it picks a partner of the other side (a decode
instance for a prefill one, and the other way round) of the same model whose engine is ready and that
can exchange KV with it (``state/compat.judge``), those already proven first; then a prefill leg of a
fresh random prompt a block and a bit long (so that no prefix cache holds it and at least one whole
block moves) and its decode leg, one token each, exactly as the gateway sends a disaggregated request.
When the decode answers, both ends' links are proven (``Registry.kv_link_proven``): the handshake the
first user request would have paid is done. A failure is logged with the engine's words and tried
again after a backoff, for as long as the instance stays pending; an instance with no partner to warm
with is ready at once (there is no link yet: the partner that comes later proves the pair with it).

One link per instance: a decode instance among several prefill ones is proven with one of them, and a
user request through another pair still pays that pair's handshake (its first transfer).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state.compat import judge
from vllm_disagg.orchestrator.state.registry import (
    DECODE_ROLES,
    PREFILL_ROLES,
    InstanceView,
    Registry,
    RegistrySnapshot,
)
from vllm_disagg.wire.kv_transfer import PREFILL_LEG

log = logging.getLogger(__name__)

SCAN_S = 0.2  # how often the registry is looked at for engines that became ready
WARMUP_TIMEOUT_S = 60.0  # one warm-up, both legs: a fresh engine's first request compiles and allocates
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # between failed warm-ups of one instance; the last one repeats
_EXTRA_TOKENS = 8  # beyond one block: a whole block to move, whatever the engine does with the tail


@dataclass(frozen=True, slots=True)
class Pair:
    """The two ends of the link a warm-up proves."""

    prefill: InstanceView
    decode: InstanceView


class WarmupFailed(Exception):
    """A warm-up leg failed; the message says which and why, in the engine's words where it gave some."""


# States in which a link is proven: a drained or cordoned instance's too, so that it is ready at once
# when it is let go (a role change drains the instance while its new engine starts).
_PROVABLE = frozenset({"joining", "draining", "cordoned"})
# Partners, best first: proven, then routed to, then the others whose engine serves.
_PARTNER_RANK = {"ready": 0, "joining": 1, "cordoned": 2, "draining": 2, "suspect": 3}


def is_pending(view: InstanceView) -> bool:
    """Is its engine ready and its KV link still to prove?"""
    return not view.kv_link_ready and view.engine_state == "ready" and view.state in _PROVABLE


def partner_pair(view: InstanceView, snapshot: RegistrySnapshot) -> Pair | None:
    """The pair a warm-up of ``view`` uses: ``view`` and a partner of the other side whose engine is
    ready and that can exchange KV with it (proven ones first, then routed ones, then by agent id);
    None if none."""
    mates = sorted(
        (
            v
            for v in snapshot.instances
            if v.agent_id != view.agent_id
            and v.info.model == view.info.model
            and v.engine_state == "ready"
            and v.state in _PARTNER_RANK
        ),
        key=lambda v: (not v.kv_link_ready, _PARTNER_RANK[v.state], v.agent_id),
    )
    if view.info.role in PREFILL_ROLES:
        for d in mates:
            if d.info.role in DECODE_ROLES and judge(view.info, d.info) is None:
                return Pair(view, d)
    if view.info.role in DECODE_ROLES:
        for p in mates:
            if p.info.role in PREFILL_ROLES and judge(p.info, view.info) is None:
                return Pair(p, view)
    return None


def warmup_prompt(view: InstanceView, rng: random.Random) -> list[int]:
    """Token ids no cache holds: a block and a few more, within the context. Ids below 256 exist in
    every tokenizer a served model has (byte-level ones hold the 256 bytes)."""
    n = view.info.block_size + _EXTRA_TOKENS
    if view.info.max_model_len:
        n = max(1, min(n, view.info.max_model_len - 2))
    return [rng.randrange(3, 256) for _ in range(n)]


async def warm(http: aiohttp.ClientSession, pair: Pair, prompt: list[int], auth: str) -> None:
    """Send the pair one disaggregated request; ``WarmupFailed`` unless the decode leg answers."""
    p, d = pair.prefill, pair.decode
    headers = {"Content-Type": "application/json", "X-Request-Id": f"kv-warmup-{secrets.token_hex(8)}"}
    if auth:
        headers["Authorization"] = auth
    body: dict[str, Any] = {"model": p.info.model, "prompt": prompt, "max_tokens": 1, "stream": False}
    answer = await _post(http, p, {**body, "kv_transfer_params": dict(PREFILL_LEG)}, headers, "prefill")
    kv = answer.get("kv_transfer_params")
    if not isinstance(kv, dict):
        raise WarmupFailed(f"prefill instance {p.agent_id!r} returned no kv_transfer_params")
    answer = await _post(http, d, {**body, "kv_transfer_params": kv}, headers, "decode")
    if not answer.get("choices"):
        raise WarmupFailed(f"decode instance {d.agent_id!r} answered no choice")


async def _post(
    http: aiohttp.ClientSession, view: InstanceView, body: dict[str, Any], headers: dict[str, str], leg: str
) -> dict[str, Any]:
    url = view.info.url.rstrip("/") + "/v1/completions"
    try:
        async with http.post(url, data=jsonutil.dumps(body), headers=headers) as resp:
            data = await resp.content.read(1 << 20)  # a one-token answer; never more than this is read
            status = resp.status
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise WarmupFailed(f"{leg} instance {view.agent_id!r}: {type(exc).__name__}: {exc}") from None
    if status != 200:
        text = data[:300].decode("utf-8", errors="replace")
        raise WarmupFailed(f"{leg} instance {view.agent_id!r} answered HTTP {status}: {text}")
    try:
        parsed = jsonutil.loads(data)
    except ValueError:
        raise WarmupFailed(f"{leg} instance {view.agent_id!r} answered a body that is not JSON") from None
    if not isinstance(parsed, dict):
        raise WarmupFailed(
            f"{leg} instance {view.agent_id!r} answered {type(parsed).__name__}, not an object"
        )
    return parsed


class KvLinkWarmup:
    """Proves the links of the registry's pending instances, one task per instance (``run``)."""

    def __init__(self, registry: Registry, config: OrchestratorConfig, metrics: OrchestratorMetrics) -> None:
        self._registry = registry
        self._config = config
        self._metrics = metrics
        self._auth = f"Bearer {config.engine_api_key}" if config.engine_api_key else ""
        self._rng = random.Random(secrets.randbits(64))
        self._tasks: dict[str, asyncio.Task[None]] = {}  # agent id -> its warm-up loop
        # Both ends of each warm-up under way: a pair of two pending instances is warmed up once.
        self._busy: set[str] = set()

    async def run(self) -> None:
        """Until cancelled: start a warm-up loop for each instance that becomes pending."""
        timeout = aiohttp.ClientTimeout(total=WARMUP_TIMEOUT_S, connect=self._config.connect_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            try:
                seen = -1
                while True:
                    snapshot = self._registry.snapshot()
                    if snapshot.version != seen:
                        seen = snapshot.version
                        # The registry's list, not every instance: a scan of 10,000 views five times
                        # a second for nothing in a cluster whose links are all proven.
                        for agent_id in self._registry.unproven():
                            view = snapshot.by_id.get(agent_id)
                            if view is not None and is_pending(view) and agent_id not in self._tasks:
                                self._start(http, view)
                    await asyncio.sleep(SCAN_S)
            finally:
                for task in list(self._tasks.values()):
                    task.cancel()
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _start(self, http: aiohttp.ClientSession, view: InstanceView) -> None:
        task = asyncio.create_task(self._prove(http, view), name=f"kv-warmup-{view.agent_id}")
        self._tasks[view.agent_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(view.agent_id, None))

    async def _prove(self, http: aiohttp.ClientSession, view: InstanceView) -> None:
        """Warm ``view``'s link up until it is proven, or it is no longer pending in this session."""
        failures = 0
        while True:
            snapshot = self._registry.snapshot()
            now = snapshot.by_id.get(view.agent_id)
            if now is None or now.session != view.session or not is_pending(now):
                return
            pair = partner_pair(now, snapshot)
            if pair is None:
                log.info("instance %s: no partner to warm its KV link up with: ready", now.agent_id)
                self._registry.kv_link_proven(now.agent_id, now.session)
                return
            ends = {pair.prefill.agent_id, pair.decode.agent_id}
            if ends & self._busy:  # the partner's own warm-up is under way, maybe with this one
                await asyncio.sleep(SCAN_S)
                continue
            started = time.monotonic()
            self._busy |= ends
            try:
                await warm(http, pair, warmup_prompt(pair.prefill, self._rng), self._auth)
            except WarmupFailed as exc:
                failures += 1
                self._metrics.kv_link_warmup("failed")
                delay = BACKOFF_S[min(failures, len(BACKOFF_S)) - 1]
                log.warning(
                    "instance %s: KV link warm-up %s -> %s failed (%d so far; again in %gs): %s",
                    now.agent_id, pair.prefill.agent_id, pair.decode.agent_id, failures, delay, exc,
                )  # fmt: skip
                await asyncio.sleep(delay)
                continue
            finally:
                self._busy -= ends
            self._metrics.kv_link_warmup("ok")
            for end in (pair.prefill, pair.decode):
                self._registry.kv_link_proven(end.agent_id, end.session)
            log.info(
                "instance %s: KV link %s -> %s proven by a warm-up in %.2fs",
                now.agent_id, pair.prefill.agent_id, pair.decode.agent_id, time.monotonic() - started,
            )  # fmt: skip
            return
