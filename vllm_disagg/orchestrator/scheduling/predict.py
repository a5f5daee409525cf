"""The scheduler's predictions of one request on one instance, each formula written once here.

``ttft_s`` and ``tpot_s`` are the formulas; everything that predicts reads them: the ttft- and
tpot-scorers (their ``term`` is ``slo / (slo + predicted)``, which is also what the profile's fused
pass adds up), the slo-filter, the SLO colocation in ``colocate.colocate_for_ttft``, and so the
gateway's best-effort count. docs/scheduler.md explains the models;
tests/unit/orchestrator/scheduling/test_predict.py checks that every user gives what the formulas give.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_disagg.orchestrator.scheduling.framework import SchedulingRequest
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import MetricsSnapshot

# (metrics, in-flight count, cached prompt tokens, prompt length >= 0, default) -> seconds
Prediction = Callable[[MetricsSnapshot, int, int, int, float], float]

DEFAULT_PREFILL_TOKENS_PER_S = 4096.0  # the ttft-scorer's and slo-filter's default
DEFAULT_TPOT_S = 0.02  # the tpot-scorer's and slo-filter's default


def prompt_tokens(request: SchedulingRequest) -> int:
    """The request's prompt length as the predictions read it: 0 where the estimate is not positive."""
    n = request.prompt_len
    return n if n > 0 else 0


def uncached(prompt_len: int, cached: int) -> int:
    """The prompt's tokens past the prefix a cache holds; none when it holds the whole prompt (the
    length may be an estimate, so a cache can hold "more" than the prompt)."""
    return prompt_len - cached if prompt_len > cached else 0


def prefill_rate(m: MetricsSnapshot, default_tokens_per_s: float) -> float:
    """Prompt tokens per second the instance prefills: as measured, else the default where the figure
    is missing, zero or not a number, or where the engine has been handed more prompt tokens over KV
    transfer than it computed in its life (a decode instance, or one that moved to prefill and has
    not yet computed as much). A decode leg's "prefill time" is the wait for its first step once the
    KV is there, not compute (2,000 tokens in one 15 ms step, a hundred times the real rate): trusted,
    it made a decode instance look free to colocate any prompt, and one just moved to the prefill
    pool draw every request until its metrics window forgot its decode work."""
    rate = m.prefill_tokens_per_s
    # ``rate > 0.0`` is False for NaN too: a broken scrape falls back rather than predicting NaN.
    if rate and rate > 0.0 and (m.prompt_tokens_transferred or 0) <= (m.prompt_tokens_computed or 0):
        return rate
    return default_tokens_per_s


# What ``ttft_s`` reads of one instance and its in-flight count: (the engine queue's wait, the backlog
# in requests, their mean prompt length where measured, the prefill rate).
TtftParts = tuple[float, int, float | None, float]


def ttft_parts(m: MetricsSnapshot, in_flight: int, default_tokens_per_s: float) -> TtftParts:
    """What ``ttft_s`` reads of the instance, apart from the prompt (a pass over candidates keeps it
    while the metrics and the count last)."""
    rate = prefill_rate(m, default_tokens_per_s)
    return (m.queue_s or 0.0), m.num_waiting + in_flight, m.mean_prompt_tokens, rate


def ttft_of(parts: TtftParts, cached: int, prompt_len: int) -> float:
    """``ttft_s`` from ``ttft_parts``: the formula itself."""
    queue, backlog, mean_prompt, rate = parts
    # ``uncached``, written out: this runs per candidate of every prefill decision.
    work = backlog * (mean_prompt or prompt_len) + (prompt_len - cached if prompt_len > cached else 0)
    return queue + work / rate


def ttft_s(
    m: MetricsSnapshot, in_flight: int, cached: int, prompt_len: int, default_tokens_per_s: float
) -> float:
    """Seconds until an instance with metrics ``m`` would have prefilled a prompt of ``prompt_len``
    tokens (>= 0) of which its cache holds ``cached``, with ``in_flight`` requests the gateway sent it.

    Its engine queue's wait (``queue_s``), then the backlog (waiting plus in-flight requests, each of
    its mean prompt length, else this prompt's) and the uncached tokens (``uncached``), at
    ``prefill_rate``. Running requests add nothing: they are past prefill, and chunked prefill
    interleaves with decode. An unmeasured (None) and a zero reading alike fall back: neither means
    anything.
    """
    return ttft_of(ttft_parts(m, in_flight, default_tokens_per_s), cached, prompt_len)


def prefill_ttft_s(
    m: MetricsSnapshot, in_flight: int, cached: int, prompt_len: int, default_tokens_per_s: float
) -> float:
    """``ttft_s`` as admission reads it on a prefill instance, as an absolute figure rather than a rank:
    the backlog is the gateway's legs in flight on it, or the engine's waiting requests where more
    (another gateway's), never both, and no measured queue time on top. The gateway's legs on a prefill
    instance are the engine's waiting and running requests, and ``queue_s`` is what those same requests
    waited: added together they counted the backlog twice or three times, a bias common to every
    instance when ranking them, but one that held requests back from a pair with room when compared
    with a target."""
    backlog = max(m.num_waiting, in_flight) * (m.mean_prompt_tokens or prompt_len)
    return (backlog + uncached(prompt_len, cached)) / prefill_rate(m, default_tokens_per_s)


def tpot_s(m: MetricsSnapshot, in_flight: int, cached: int, prompt_len: int, default_tpot_s: float) -> float:
    """Seconds per output token on an instance with metrics ``m`` once the ``in_flight`` requests the
    gateway sent it and this one join its batch: the measured TPOT (else the default, where it is
    unmeasured or zero) scaled by how much bigger the batch gets. The prompt does not change it; it
    takes ``ttft_s``'s arguments so that a pass over the candidates calls either alike."""
    running = m.num_running
    return (m.tpot_s or default_tpot_s) * (running + in_flight + 1) / (running if running > 1 else 1)


def predicted_by(
    formula: Prediction,
    view: InstanceView,
    request: SchedulingRequest,
    in_flight: int,
    default_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
) -> float:
    """``formula`` (``ttft_s``, ``prefill_ttft_s``) of ``request`` on ``view``."""
    cached = request.cached_tokens.get(view.agent_id, 0)
    return formula(view.metrics, in_flight, cached, prompt_tokens(request), default_tokens_per_s)


def predicted_ttft(
    view: InstanceView,
    request: SchedulingRequest,
    in_flight: int,
    default_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
) -> float:
    """``ttft_s`` of ``request`` on ``view``."""
    return predicted_by(ttft_s, view, request, in_flight, default_tokens_per_s)


def predicted_tpot(view: InstanceView, in_flight: int, default_tpot_s: float = DEFAULT_TPOT_S) -> float:
    """``tpot_s`` on ``view``."""
    return tpot_s(view.metrics, in_flight, 0, 0, default_tpot_s)


def uncached_tokens(view: InstanceView, request: SchedulingRequest) -> int:
    """The prompt's tokens ``view`` would compute: those past the prefix its cache holds."""
    return uncached(prompt_tokens(request), request.cached_tokens.get(view.agent_id, 0))


def queued_now(view: InstanceView, snapshot: RegistrySnapshot) -> int:
    """The engine's queue as its newest scrape saw it, less the gateway's requests on it that have
    ended since (``ended_since_scrape``): each one that left took one from the queue into the batch.
    A scrape taken during the last burst thus no longer shows a queue the engine has drained."""
    ended = snapshot.ended_since_scrape.get(view.agent_id, 0)
    return max(0, view.metrics.num_waiting - ended)
