"""Predicted TTFT and TPOT of one request on one instance: the ttft- and tpot-scorers' models (their
modules explain them; the scorers inline the same arithmetic for speed), for the per-request SLO
filter, the SLO colocation in ``scheduler.PluginScheduler.decide``, and the gateway's best-effort
count."""

from __future__ import annotations

from vllm_disagg.orchestrator.registry import InstanceView
from vllm_disagg.orchestrator.scheduling.framework import SchedulingRequest

DEFAULT_PREFILL_TOKENS_PER_S = 4096.0  # the ttft-scorer's default
DEFAULT_TPOT_S = 0.02  # the tpot-scorer's default


def predicted_ttft(
    view: InstanceView,
    request: SchedulingRequest,
    in_flight: int,
    default_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
) -> float:
    """Seconds until ``view`` would have prefilled ``request``: its queue, the backlog before it, and
    the prompt's uncached tokens, at the instance's measured prefill rate."""
    m = view.metrics
    prompt_len = max(0, request.prompt_len)
    uncached = max(0, prompt_len - request.cached_tokens.get(view.agent_id, 0))
    backlog = (m.num_waiting + in_flight) * (m.mean_prompt_tokens or prompt_len)
    rate = (
        m.prefill_tokens_per_s
        if m.prefill_tokens_per_s and m.prefill_tokens_per_s > 0
        else default_tokens_per_s
    )
    return (m.queue_s or 0.0) + (backlog + uncached) / rate


def predicted_tpot(view: InstanceView, in_flight: int, default_tpot_s: float = DEFAULT_TPOT_S) -> float:
    """Seconds per output token on ``view`` once the requests sent to it and this one join its batch."""
    m = view.metrics
    running = m.num_running
    return (m.tpot_s or default_tpot_s) * (running + in_flight + 1) / (running if running > 1 else 1)
