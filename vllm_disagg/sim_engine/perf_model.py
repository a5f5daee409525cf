"""The simulated engine's timing and batching model: pure functions of the timing config and counts.

The step loop in ``sim_engine/core.py`` does the waiting; everything it decides comes from here, so the
model can be checked with a table instead of a stopwatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_disagg.config import SimTiming


def full_blocks(num_tokens: int, block_size: int) -> int:
    """How many whole blocks ``num_tokens`` fill; only whole blocks enter the prefix cache (a KV
    transfer moves the partial last block too: ``kv.TransferHolds``)."""
    return num_tokens // block_size


def blocks_needed(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request reserves when admitted: room for its prompt and every output token."""
    return -(-(prompt_len + max_tokens) // block_size)


def cacheable_blocks(prompt_len: int, block_size: int) -> int:
    """Leading blocks a prefix-cache hit may cover; like vLLM, the last prompt token is always computed."""
    return max(0, (prompt_len - 1) // block_size)


def step_duration(timing: SimTiming, prefill_tokens: int, batch_size: int) -> float:
    """Seconds one engine step takes: prefill of the newly admitted tokens plus one decode step."""
    if batch_size <= 0:
        return 0.0
    return (
        timing.prefill_s_per_token * prefill_tokens
        + timing.decode_step_s
        + timing.decode_step_s_per_seq * batch_size
    )


def kv_transfer_duration(timing: SimTiming, tokens: int) -> float:
    """Seconds a decoder spends pulling ``tokens`` prompt tokens of KV from a prefill engine."""
    return timing.kv_transfer_s_per_token * tokens


def admit(waiting_blocks: Sequence[int], running: int, free_blocks: int, max_num_seqs: int) -> int:
    """How many requests from the head of the queue join the batch now.

    First come, first served: the queue's head blocks the rest when its blocks do not fit, as in
    vLLM's FCFS scheduler, so a large request is never starved by small ones behind it.
    """
    admitted = 0
    for need in waiting_blocks:
        if running + admitted >= max_num_seqs or need > free_blocks:
            break
        free_blocks -= need
        admitted += 1
    return admitted


@dataclass(frozen=True, slots=True)
class PromptSources:
    """Where a request's prompt tokens came from (``vllm:prompt_tokens_by_source_total``)."""

    local_compute: int
    local_cache_hit: int
    external_kv_transfer: int


def prompt_sources(prompt_len: int, cached_tokens: int, external_tokens: int) -> PromptSources:
    """Split a prompt into computed, prefix-cached and transferred tokens."""
    if cached_tokens < 0 or external_tokens < 0 or cached_tokens + external_tokens > prompt_len:
        raise ValueError(
            f"cannot split {prompt_len} prompt tokens into "
            f"{cached_tokens} cached + {external_tokens} external"
        )
    return PromptSources(
        local_compute=prompt_len - cached_tokens - external_tokens,
        local_cache_hit=cached_tokens,
        external_kv_transfer=external_tokens,
    )
