"""Does a request's pair have room now? The admission queue's one question to the scheduler's world.

The pair is the one the scheduler picked for the request (``Decision``); the predictions are the
scheduler's own (``scheduling.predict``), so admission and routing never disagree about an instance.

- **prefill stage** (the instance that computes the prompt: the prefill instance, or the decode
  instance when colocated): with a TTFT target, it fits while the time already spent waiting plus the
  predicted TTFT on it stays within the target; without one, while the predicted TTFT stays within
  ``admission.ttft_s`` (the point past which an engine's queue only makes everyone later).
- **decode stage**: it fits while the decode instance's KV usage is below ``admission.kv_usage_high``,
  its engine queues nothing (a full batch: ``max_num_seqs`` running, the rest waiting, while KV and
  TPOT still look fine) and, with a TPOT target, its predicted TPOT with this request in its batch
  meets the target.
- **room**: an instance the gateway has nothing in flight on is never saturated for it: waiting
  could not help, and the predictions, fed by scraped metrics, may lag an engine that has emptied.
- **unreachable**: the time waited plus the prompt's own prefill (no backlog at all) already exceeds
  the TTFT target: it cannot be met whatever is admitted.

The two stages saturate separately (a prompt-heavy burst fills prefill while decode idles): ``stage``
names the one that binds, prefill first where both do.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_disagg.config import AdmissionConfig
from vllm_disagg.orchestrator.admission.policy import FITS, Fit
from vllm_disagg.orchestrator.scheduling.framework import Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.predict import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    predicted_tpot,
    predicted_ttft,
    prefill_rate,
    uncached_tokens,
)
from vllm_disagg.orchestrator.state.views import RegistrySnapshot


def fit(
    request: SchedulingRequest,
    decision: Decision,
    snapshot: RegistrySnapshot,
    waited_s: float,
    config: AdmissionConfig,
    admitted: Mapping[str, int] | None = None,
) -> Fit:
    """Whether ``decision``'s pair has room for ``request`` after it waited ``waited_s``; ``admitted``:
    requests admitted to each instance that the snapshot does not count yet (admitted in this drain,
    their legs not started)."""
    first = snapshot.by_id.get(decision.prefill or decision.decode)
    decode = snapshot.by_id.get(decision.decode)
    if first is None or decode is None:  # gone since the decision: the flow's recovery handles it
        return FITS
    target = request.slo_ttft_s
    extra = admitted or {}
    busy = snapshot.in_flight_of(first.agent_id) + extra.get(first.agent_id, 0)
    unreachable = False
    if target is not None:
        own = uncached_tokens(first, request) / prefill_rate(first.metrics, DEFAULT_PREFILL_TOKENS_PER_S)
        unreachable = waited_s + own > target
    if busy:
        predicted = predicted_ttft(first, request, busy)
        budget = config.ttft_s if target is None else target - waited_s
        if predicted > budget:
            return Fit(False, "prefill", unreachable)
    d_busy = snapshot.in_flight_of(decode.agent_id) + extra.get(decode.agent_id, 0)
    if d_busy:
        if decode.metrics.kv_cache_usage >= config.kv_usage_high or decode.metrics.num_waiting > 0:
            return Fit(False, "decode", unreachable)
        tpot = request.slo_tpot_s
        if tpot is not None and predicted_tpot(decode, d_busy) > tpot:
            return Fit(False, "decode", unreachable)
    return Fit(True, "", unreachable)
