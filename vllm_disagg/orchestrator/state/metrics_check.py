"""What an agent reports is checked before anything reads it.

A heartbeat's figures come from an engine's counters (which reset when it restarts) or from a peer that
may be broken or hostile; the codec only checks their types. The scorers divide by them and compare
them: one ``tpot_s = -0.05`` divided by zero in every decision for its model, and a slightly negative
one drew three quarters of the traffic (issue 31). So every figure the registry keeps is a finite
number in its range: a timing or rate that is not (NaN, infinite, negative) is unknown (None), as an
engine with no samples reports it; a required one is 0; KV use lies in [0, 1] (NaN: 1, full, so that a
broken report draws no traffic), the hit rate too (NaN: unknown); counts lie in [0, a bound].
``checked`` says which fields it changed, for the log.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from vllm_disagg.protocol.messages import KvLinkCount, MetricsSnapshot

log = logging.getLogger(__name__)

MAX_QUEUE = 1_000_000  # requests running or waiting on one engine: far past any batch
MAX_COUNTER = 2**62  # lifetime counters (tokens, requests, bytes)

# Timings and rates: None when not a finite number >= 0 (unknown, as without samples).
_OPTIONAL = (
    "ttft_s",
    "tpot_s",
    "queue_s",
    "prefill_tokens_per_s",
    "mean_prompt_tokens",
    "kv_in_bytes",
    "kv_in_seconds",
)
_REQUIRED = ("scraped_at", "window_s", "age_s", "sent_at")  # 0.0 when not a finite number >= 0
_QUEUES = ("num_running", "num_waiting")
_COUNTERS = ("requests_finished", "prompt_tokens", "generation_tokens")
_OPTIONAL_COUNTERS = (
    "prompt_tokens_computed",
    "prompt_tokens_cached",
    "prompt_tokens_transferred",
    "kv_in_transfers",
)


def _good(x: float) -> bool:
    return math.isfinite(x) and x >= 0


def checked(m: MetricsSnapshot) -> tuple[MetricsSnapshot, tuple[str, ...]]:
    """``m`` with every figure in its range, and the names of the fields that were not (none: ``m``
    itself, unchanged). The codec has checked the types: ints are ints, floats floats."""
    fixes: dict[str, Any] = {}
    for name in _OPTIONAL:
        value = getattr(m, name)
        if value is not None and not _good(value):
            fixes[name] = None
    for name in _REQUIRED:
        if not _good(getattr(m, name)):
            fixes[name] = 0.0
    usage = m.kv_cache_usage
    if not 0.0 <= usage <= 1.0:  # NaN included
        fixes["kv_cache_usage"] = 0.0 if usage < 0.0 else 1.0
    for name in ("prefix_cache_hit_rate", "kv_pool_hit_rate"):
        rate = getattr(m, name)
        if rate is not None and not 0.0 <= rate <= 1.0:
            fixes[name] = 1.0 if rate > 1.0 else 0.0 if rate < 0.0 else None
    for names, top in ((_QUEUES, MAX_QUEUE), (_COUNTERS, MAX_COUNTER)):
        for name in names:
            value = getattr(m, name)
            if not 0 <= value <= top:
                fixes[name] = min(max(value, 0), top)
    for name in _OPTIONAL_COUNTERS:
        value = getattr(m, name)
        if value is not None and not 0 <= value <= MAX_COUNTER:
            fixes[name] = min(max(value, 0), MAX_COUNTER)
    links = [_link(link) for link in m.kv_in_links]
    if any(a is not b for a, b in zip(links, m.kv_in_links, strict=True)):
        fixes["kv_in_links"] = links
    if not fixes:
        return m, ()
    return dataclasses.replace(m, **fixes), tuple(sorted(fixes))


def _link(link: KvLinkCount) -> KvLinkCount:
    nbytes, seconds, transfers = link.nbytes, link.seconds, link.transfers
    if 0 <= nbytes <= MAX_COUNTER and _good(seconds) and 0 <= transfers <= MAX_COUNTER:
        return link
    return dataclasses.replace(
        link,
        nbytes=min(max(nbytes, 0), MAX_COUNTER),
        seconds=seconds if _good(seconds) else 0.0,
        transfers=min(max(transfers, 0), MAX_COUNTER),
    )


class MetricsCheck:
    """``checked`` for the registry, telling the log once per agent and field (a broken engine repeats
    the same figure every heartbeat), again after the agent reported it in range."""

    def __init__(self) -> None:
        self._told: dict[str, frozenset[str]] = {}

    def __call__(self, agent_id: str, m: MetricsSnapshot) -> MetricsSnapshot:
        sane, fixed = checked(m)
        told = self._told.get(agent_id, frozenset())
        if fixed and not told.issuperset(fixed):
            log.warning(
                "%s reported %s out of range (not finite, negative or too large): unknown or bounded",
                agent_id,
                ", ".join(f for f in fixed if f not in told),
            )
        if fixed:
            self._told[agent_id] = frozenset(fixed)
        elif told:
            del self._told[agent_id]
        return sane
