"""Predicted TTFT and TPOT of one request on one instance: the ttft- and tpot-scorers' models (their
modules explain them; the scorers inline the same arithmetic for speed), for the per-request SLO
filter, the SLO colocation in ``scheduler.PluginScheduler.decide``, and the gateway's best-effort
count."""

from __future__ import annotations

from vllm_disagg.orchestrator.registry import InstanceView
from vllm_disagg.orchestrator.scheduling.framework import SchedulingRequest
from vllm_disagg.protocol.messages import MetricsSnapshot

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
    backlog = (m.num_waiting + in_flight) * (m.mean_prompt_tokens or prompt_len)
    rate = prefill_rate(m, default_tokens_per_s)
    return (m.queue_s or 0.0) + (backlog + uncached_tokens(view, request)) / rate


def uncached_tokens(view: InstanceView, request: SchedulingRequest) -> int:
    """The prompt's tokens ``view`` would compute: those past the prefix its cache holds."""
    return max(0, request.prompt_len - request.cached_tokens.get(view.agent_id, 0))


def prefill_rate(m: MetricsSnapshot, default_tokens_per_s: float) -> float:
    """Prompt tokens per second the instance prefills: as measured, else the default where the figure
    is missing or zero, or where the engine has been handed more prompt tokens over KV transfer than
    it computed in its life (a decode instance, or one that moved to prefill and has not yet
    computed as much). A decode leg's "prefill time" is the wait for its first step once the KV is
    there, not compute (2,000 tokens in one 15 ms step, a hundred times the real rate): trusted, it
    made a decode instance look free to colocate any prompt, and one just moved to the prefill pool
    draw every request until its metrics window forgot its decode work."""
    rate = m.prefill_tokens_per_s
    if not rate or rate <= 0:
        return default_tokens_per_s
    if (m.prompt_tokens_transferred or 0) > (m.prompt_tokens_computed or 0):
        return default_tokens_per_s
    return rate


def predicted_tpot(view: InstanceView, in_flight: int, default_tpot_s: float = DEFAULT_TPOT_S) -> float:
    """Seconds per output token on ``view`` once the requests sent to it and this one join its batch."""
    m = view.metrics
    running = m.num_running
    return (m.tpot_s or default_tpot_s) * (running + in_flight + 1) / (running if running > 1 else 1)
