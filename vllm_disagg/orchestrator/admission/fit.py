"""Does a request's pair have room now? The admission queue's one question to the scheduler's world.

The pair is the one the scheduler picked for the request (``Decision``); the formulas are the
scheduler's (``scheduling.predict``), so admission and routing read an instance alike.

- **prefill stage** (the instance that computes the prompt: the prefill instance, or the decode
  instance when colocated): it is saturated while the predicted TTFT on it exceeds
  ``admission.engine_share`` of the request's TTFT target, or of ``admission.ttft_s`` without one.
  The engine's queue only needs to be deep enough to keep it busy; the rest of the budget is for
  waiting in the gateway, where order and refusals are kept. Filled to the whole target, it would
  give every request admitted a TTFT at the target, and about half of them would miss it. On a
  prefill instance the prediction is ``prefill_ttft_s`` (its backlog counted once); on a colocated
  decode instance the scheduler's ``ttft_s``, whose in-flight count includes the requests decoding
  there. A tenant offering more than its share of the load fills only part of that (``fill``: the
  policy's standing, at least ``admission.over_share_fill``).
- **late**: a request that waited, on a pair with room for one that just came but not for it (the
  time waited plus the predicted TTFT, plus the margin by which predictions have recently fallen
  short, exceeds its target), is out of reach: waiting longer cannot help, since the backlog ahead
  of it drains no faster than its clock runs, and while it waited at the head of the queue it would
  hold back the requests behind it that can still make their targets.
- **decode stage**: it fits while the decode instance's KV usage is below ``admission.kv_usage_high``,
  its engine queues nothing (a full batch: ``max_num_seqs`` running, the rest waiting, while KV and
  TPOT still look fine; the scraped queue less the gateway's requests there that ended since the
  scrape, ``predict.queued_now``: a scrape from the last burst must not hold back the next) and,
  with a TPOT target, its predicted TPOT with this request in its batch meets the target.
- **room**: an instance the gateway has nothing in flight on is never saturated for it: waiting
  could not help, and the predictions, fed by scraped metrics, may lag an engine that has emptied.
- **unreachable**: the time waited plus the prompt's own prefill (no backlog at all) already exceeds
  the TTFT target: it cannot be met whatever is admitted; or the request is late (above).

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
    predicted_by,
    predicted_tpot,
    prefill_rate,
    prefill_ttft_s,
    queued_now,
    ttft_s,
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
    slack_s: float = 0.0,
    fill: float = 1.0,
) -> Fit:
    """Whether ``decision``'s pair has room for ``request`` after it waited ``waited_s``; ``admitted``:
    requests admitted to each instance that the snapshot does not count yet (admitted in this drain,
    their legs not started); ``slack_s``: how much later than predicted first tokens have recently
    come (``slack.Slack``), added to the prediction before it is held against the request's target;
    ``fill``: the fraction of ``engine_share`` the request's tenant may fill (``Ticket.fill``)."""
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
    predicted = predicted_by(prefill_ttft_s if decision.prefill else ttft_s, first, request, busy)
    if busy:
        if predicted > (config.ttft_s if target is None else target) * config.engine_share * fill:
            return Fit(False, "prefill", unreachable, predicted)
        # The margin never takes the gateway's share of the target: a request that has just come to a
        # pair with room is never late, so admissions go on, and with them the measurements.
        margin = min(slack_s, target * (1.0 - config.engine_share)) if target is not None else 0.0
        if target is not None and waited_s + predicted + margin > target:
            return Fit(False, "prefill", True, predicted)  # late: room for a newcomer, not for it
    d_busy = snapshot.in_flight_of(decode.agent_id) + extra.get(decode.agent_id, 0)
    if d_busy:
        if decode.metrics.kv_cache_usage >= config.kv_usage_high or queued_now(decode, snapshot) > 0:
            return Fit(False, "decode", unreachable, predicted)
        tpot = request.slo_tpot_s
        if tpot is not None and predicted_tpot(decode, d_busy) > tpot:
            return Fit(False, "decode", unreachable, predicted)
    return Fit(True, "", unreachable, predicted)
