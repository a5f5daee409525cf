"""transfer-pairing: P and D chosen together, for the least predicted TTFT counting the KV transfer.

The decode profile ranks the D's and the prefill profile the P's for its pick D0; each pick alone
ignores the link between them. Once both ran, this weighs the pairs of the decode profile's best
``width`` D's (D0 first, then those whose total is within ``slack`` of the best total: the decode
constraints hold, as only D's its filters kept are there) and the prefill profile's best ``width``
P's. A P ranked for D0 is paired with another D only where the prefill profile's kv-compat and
topology filters pass it with that D as partner and the link is not blocked. A pair's predicted TTFT
is P's (``predict.predicted_ttft``: queue, backlog, prefill) plus the KV transfer of the prompt
tokens D does not cache (``LinkTable.transfer_s`` for the pair's tier, ``link_rates.link_tier``).

The least TTFT wins, but only by ``minGainS`` or more over the profiles' own pair: a near tie keeps
their pick and the load balance their scorers stand for. Where nothing is known of the links (no
KV size for the model, no rate at all, or none for the profiles' own pair), it answers None and the
decision is what it was before links were learned. At most ``width`` x ``width`` pairs and
``width - 1`` filter runs on ``width`` P's: a few microseconds, only for requests with link knowledge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import (
    Filter,
    PairChoice,
    PairRow,
    PluginSpec,
    ProfileContext,
    Ranked,
    SchedulingRequest,
)
from vllm_disagg.orchestrator.scheduling.plugins import check_int, check_real
from vllm_disagg.orchestrator.scheduling.predict import predicted_ttft, uncached_tokens
from vllm_disagg.orchestrator.state.link_rates import link_tier
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

TYPE = "transfer-pairing"


@dataclass(frozen=True, slots=True)
class Params:
    """How many D's and P's to pair (``width`` each), how far below the best decode total a D may be
    (``slack``), and the TTFT gain in seconds that overrides the profiles' own pair (``min_gain_s``)."""

    width: int = 4
    slack: float = 0.25
    min_gain_s: float = 0.01

    def __post_init__(self) -> None:
        check_int(TYPE, "width", self.width, ge=1)
        check_real(TYPE, "slack", self.slack, ge=0.0)
        check_real(TYPE, "minGainS", self.min_gain_s, ge=0.0)


def transfer_time(
    snapshot: RegistrySnapshot, request: SchedulingRequest, p: InstanceView, d: InstanceView
) -> float | None:
    """Predicted seconds to move the KV of the prompt tokens ``d`` does not cache from ``p``; None
    where nothing is known."""
    links = snapshot.links
    if request.model not in links.bytes_per_token:  # the common case until a transfer is measured
        return None
    return links.transfer_s(
        p.agent_id, d.agent_id, link_tier(p, d), request.model, uncached_tokens(d, request)
    )


def best(ranked: Ranked, width: int, slack: float | None = None) -> list[int]:
    """The pick's index, then the others' by total (best first; ties in candidate order), at most
    ``width`` in all; with ``slack``, only those within it of the best total."""
    totals, pick = ranked.totals, ranked.picked
    # Descending and stable (``reverse`` keeps equals in candidate order), with no Python-level key call.
    order = sorted(range(len(totals)), key=totals.__getitem__, reverse=True)
    order.remove(pick)
    if slack is not None and totals:
        floor = max(totals) - slack
        order = [i for i in order if totals[i] >= floor]
    return [pick, *order[: width - 1]]


class TransferPairing:
    """The pair of the least predicted TTFT, transfer included, among the profiles' best few."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params

    def pair(
        self, ctx: ProfileContext, decode: Ranked, prefill: Ranked, filters: Sequence[Filter]
    ) -> PairChoice | None:
        """The pair to use, or None without link knowledge of the profiles' own pair."""
        request, snapshot = ctx.request, ctx.snapshot
        d0, p0 = decode.candidates[decode.picked], prefill.candidates[prefill.picked]
        known = snapshot.links.links or snapshot.links.typical  # no rate: a KV size alone says nothing
        if not known or transfer_time(snapshot, request, p0, d0) is None:
            return None
        width = self.params.width
        ps = [prefill.candidates[i] for i in best(prefill, width)]
        own = {p.agent_id: predicted_ttft(p, request, snapshot.in_flight_of(p.agent_id)) for p in ps}
        rows: list[PairRow] = []
        links, model = snapshot.links, request.model
        for j in best(decode, width, self.params.slack):
            d = decode.candidates[j]
            pool = ps if j == decode.picked else _compatible(ctx, d, ps, filters)
            tokens, did = uncached_tokens(d, request), d.agent_id  # ``transfer_time``, per D once
            for p in pool:
                t = links.transfer_s(p.agent_id, did, link_tier(p, d), model, tokens)
                if t is not None:
                    rows.append((p.agent_id, did, own[p.agent_id] + t, t))
        # rows[0] is the profiles' own pair (D0 and the P ranked first for it); ``min`` keeps the
        # first of equals, so ties go the profiles' way.
        least = min(range(len(rows)), key=lambda i: rows[i][2])
        base = rows[0][2]
        picked = least if base - rows[least][2] >= self.params.min_gain_s and rows[least][2] < base else 0
        p_id, d_id, _, t = rows[picked]
        by_id = snapshot.by_id
        return PairChoice(by_id[p_id], by_id[d_id], t, rows, picked)


def _compatible(
    ctx: ProfileContext, d: InstanceView, ps: Sequence[InstanceView], filters: Sequence[Filter]
) -> Sequence[InstanceView]:
    """The P's of ``ps`` the prefill profile would let pair with ``d``: its KV and topology filters
    pass them with ``d`` as partner, and no breaker blocks the link."""
    blocked = ctx.snapshot.blocked_links
    kept: Sequence[InstanceView] = [p for p in ps if (p.agent_id, d.agent_id) not in blocked]
    partnered = ProfileContext(ctx.request, ctx.snapshot, ctx.now, "prefill", d)
    for f in filters:
        if kept:
            kept = f.filter(partnered, kept)
    return kept


PLUGIN = PluginSpec(TYPE, Params, TransferPairing, "pairing")
