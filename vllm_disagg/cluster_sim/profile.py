"""What an engine costs in time and memory: the cluster simulator's engine profiles.

One engine step (vLLM's continuous batching) computes the prefill tokens admitted to it and one output
token for every request in the batch::

    step = prefill_s_per_token * prefill_tokens
         + prefill_s_per_token_sq * prefill_tokens * context_of_those_tokens / 1000
         + decode_step_s + decode_step_s_per_seq * batch + decode_s_per_context_token * context_tokens

A KV transfer from a prefill engine to a decode engine takes ``link_latency_s + tokens *
kv_transfer_s_per_token + tokens * kv_bytes_per_token / link bandwidth``.

Profiles (``PROFILES``): ``sim`` is the real-time simulated engine's own model (``SimTiming``, for
the fidelity check), ``cpu-tiny`` was fitted to real vLLM on this machine (``bench calibrate``),
``h100-llama3-8b`` is derived from published figures (docs/sim.md cites them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_disagg.config import SimTiming


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """One engine's costs and capacity."""

    name: str
    block_size: int = 16
    num_blocks: int = 4096  # KV cache capacity in blocks
    max_num_seqs: int = 8  # the batch
    # Prefill tokens one step may compute (vLLM's max_num_batched_tokens, chunked prefill); 0: a whole
    # prompt in the step that admits it, as the simulated engine does.
    max_batched_tokens: int = 0
    prefill_s_per_token: float = 0.0
    prefill_s_per_token_sq: float = 0.0  # attention: per new token per 1,000 tokens of its context
    decode_step_s: float = 0.0
    decode_step_s_per_seq: float = 0.0
    decode_s_per_context_token: float = 0.0  # reading the batch's KV, per context token
    kv_transfer_s_per_token: float = 0.0
    kv_bytes_per_token: int = 0
    link_gbps: float = 0.0  # 0: bytes cost nothing (only the per-token term and the latency)
    link_latency_s: float = 0.0
    max_model_len: int = 1 << 20

    def step_s(self, prefill_tokens: int, prefill_context: int, batch: int, context_tokens: int) -> float:
        """Seconds one step takes: ``prefill_context`` is the sum over the prefilled tokens of the
        context each attends to (their prompt so far)."""
        if batch <= 0:
            return 0.0
        return (
            self.prefill_s_per_token * prefill_tokens
            + self.prefill_s_per_token_sq * prefill_context / 1000.0
            + self.decode_step_s
            + self.decode_step_s_per_seq * batch
            + self.decode_s_per_context_token * context_tokens
        )

    def transfer_s(self, tokens: int, slowdown: float = 1.0) -> float:
        """Seconds to move ``tokens`` tokens of KV to a decode engine, on a link ``slowdown`` times slower."""
        seconds = self.link_latency_s + tokens * self.kv_transfer_s_per_token
        if self.link_gbps > 0 and self.kv_bytes_per_token:
            seconds += tokens * self.kv_bytes_per_token * 8 / (self.link_gbps * 1e9)
        return seconds * slowdown

    def replace(self, **changes: object) -> EngineProfile:
        """This profile with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def from_sim_timing(timing: SimTiming, name: str = "sim") -> EngineProfile:
    """The real-time simulated engine's timing model, as a profile (no chunking, no context cost)."""
    return EngineProfile(
        name=name,
        block_size=timing.block_size,
        num_blocks=timing.num_blocks,
        max_num_seqs=timing.max_num_seqs,
        prefill_s_per_token=timing.prefill_s_per_token,
        decode_step_s=timing.decode_step_s,
        decode_step_s_per_seq=timing.decode_step_s_per_seq,
        kv_transfer_s_per_token=timing.kv_transfer_s_per_token,
    )


# Llama-3-8B (32 layers, 8 KV heads of 128, bf16) on one H100 SXM 80 GB; see docs/sim.md for sources.
# KV: 2 (K and V) x 32 layers x 8 heads x 128 x 2 bytes = 131,072 bytes per token.
_KV_BYTES_LLAMA3_8B = 2 * 32 * 8 * 128 * 2
H100_LLAMA3_8B = EngineProfile(
    name="h100-llama3-8b",
    block_size=16,
    # (80 GB x 0.9 - 16 GB of weights) / 128 KiB per token / 16 tokens per block
    num_blocks=int((80e9 * 0.9 - 16e9) / _KV_BYTES_LLAMA3_8B / 16),
    max_num_seqs=256,
    max_batched_tokens=8192,
    # 2 x 8e9 FLOPs per token at 40% of 989 TFLOPS (dense bf16): ~40 us a token.
    prefill_s_per_token=2 * 8e9 / (0.4 * 989e12),
    # Attention: 4 x 32 layers x 4096 x context FLOPs per token at the same rate, per 1,000 of context.
    prefill_s_per_token_sq=4 * 32 * 4096 * 1000 / (0.4 * 989e12),
    # Every step reads the 16 GB of weights at 3.35 TB/s x 0.7, plus each context token's KV.
    decode_step_s=16e9 / (0.7 * 3.35e12),
    decode_step_s_per_seq=0.0,
    decode_s_per_context_token=_KV_BYTES_LLAMA3_8B / (0.7 * 3.35e12),
    kv_bytes_per_token=_KV_BYTES_LLAMA3_8B,
    link_gbps=400.0,  # one ConnectX-7 InfiniBand port (NIXL over UCX RDMA)
    link_latency_s=0.0005,
    max_model_len=131_072,
)

# The tiny offline model on vLLM 0.32's CPU build on this 2-core machine, as the agent launches it (one
# core, 1 GiB of KV: 1,048,576 tokens in 128-token blocks, 8 sequences, eager mode), fitted by
# ``vllm-disagg bench calibrate`` on 2026-11-26 (docs/sim.md, "Profiles"): prompts of 32-384 tokens
# took 6.1-11.0 ms with max_tokens 1, streams 2.7-4.1 ms a token at batches 1-8.
CPU_TINY = EngineProfile(
    name="cpu-tiny",
    block_size=128,
    num_blocks=8192,
    max_num_seqs=8,
    prefill_s_per_token=2.8e-5,
    decode_step_s=2.37e-3,
    decode_step_s_per_seq=2.0e-4,
    max_model_len=512,
)

PROFILES: dict[str, EngineProfile] = {
    CPU_TINY.name: CPU_TINY,
    "sim": from_sim_timing(
        SimTiming(prefill_s_per_token=0.0002, decode_step_s=0.01, decode_step_s_per_seq=0.001)
    ),
    H100_LLAMA3_8B.name: H100_LLAMA3_8B,
}
