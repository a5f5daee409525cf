"""The SLO colocation: a request with a TTFT target goes straight to its decode instance where only
that instance is predicted to meet the target (``PluginScheduler.decide``, after the pair is chosen).

Pure: it reads the snapshot and the request, nothing else.
"""

from __future__ import annotations

from vllm_disagg.orchestrator.scheduling.framework import ModeChoice, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins.pairing import transfer_time
from vllm_disagg.orchestrator.scheduling.predict import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    predicted_ttft,
    prefill_rate,
    uncached_tokens,
)
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot


def colocate_for_ttft(
    request: SchedulingRequest, snapshot: RegistrySnapshot, p: InstanceView, d: InstanceView
) -> ModeChoice | None:
    """Colocated, when the decode instance is predicted to meet the request's TTFT target by itself and
    the prefill pick is not (a short prompt, or one whose prefix D caches, behind a busy prefill
    pool); else None.

    With a TPOT target too, D must also compute the prompt's uncached tokens within that target: they
    run in one of D's steps, so every request D is decoding waits that long for its next token. A
    shared document D caches with a new question fits; a whole uncached document would stall D's
    batch for as long as its prefill takes (the cost the prefill pool exists to keep off D).
    """
    slo = request.slo_ttft_s
    assert slo is not None
    # Through P, the KV must also reach D: the pair's predicted transfer, where the links are known.
    transfer = transfer_time(snapshot, request, p, d) or 0.0
    via_p = predicted_ttft(p, request, snapshot.in_flight_of(p.agent_id)) + transfer
    if via_p <= slo:
        return None
    # D's in-flight requests are being decoded, their prefill done by the prefill pool: they are no
    # prefill backlog there (its engine's own queue is). Counting them kept a busy D from ever taking one.
    alone = predicted_ttft(d, request, 0)
    if alone > slo:
        return None
    uncached = uncached_tokens(d, request)
    stall = uncached / prefill_rate(d.metrics, DEFAULT_PREFILL_TOKENS_PER_S)
    if request.slo_tpot_s is not None and stall > request.slo_tpot_s:
        return None
    moving = f" ({transfer:.3f} s of it moving KV)" if transfer else ""
    return ModeChoice(
        "colocated",
        f"to meet its TTFT target of {slo:g} s: {alone:.3f} s predicted on {d.agent_id}, "
        f"{via_p:.3f} s through {p.agent_id}{moving}; {uncached} uncached tokens add {stall:.3f} s to one "
        f"of {d.agent_id}'s steps",
    )
