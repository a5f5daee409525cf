"""What each P→D link delivers, learned from the decode engines' KV counters (``LinkTable``'s writer).

The gateway says when a decode leg on D will pull KV from P (``kv_sent``); D's heartbeats bring its
lifetime counters of KV pulled in (``MetricsSnapshot.kv_in_bytes``/``kv_in_seconds``: vLLM's NIXL
transfers, no source; ``kv_in_links``: the project's pool connector, per source pool). Each heartbeat's
increase is a sample:

- a pool link's increase names its source: a sample of that link, and of bytes per token when the
  gateway's sends from that P are pending;
- a NIXL increase is shared among the oldest of D's pending sends, as many as transfers finished
  (``kv_in_transfers``; all of them where the engine does not count), in proportion to their tokens
  (the tokens each P's KV carries): one P among them gives that link the exact sample; several give
  each its share of the bytes, and the seconds are split by the links' current rates (a normalized
  LMS step, below), so a mix of a fast and a slow link converges over a few heartbeats rather than at
  once. Its bytes per token is the increase over those sends' tokens.

A link's seconds per byte follows its samples by NLMS (a step of ``STEP``; with one link pending it
is an EWMA of weight ``STEP``), so a link that slows tenfold reads over five times slower after one
sample and about eight after two: the scheduler routes around it within a heartbeat or two. An
estimate older than ``FRESH_S`` is replaced by the next sample, not blended (a link that recovered
while routed around is re-learned at once); one unmeasured for ``forget_s`` is dropped, so the
scheduler prices the link at its tier's typical rate again and picks it: the probe. A counter that
goes back (the engine restarted) starts a new baseline and gives no sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vllm_disagg.orchestrator.state.link_table import EMPTY_LINKS, Link, LinkEstimate, LinkTable
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import LABEL_DOMAIN, LABEL_NODE, LABEL_ZONE, MetricsSnapshot

PENDING_S = 30.0  # a send D's counters have not shown by then is dropped
FRESH_S = 30.0  # an estimate older than this is replaced by the next sample
FORGET_S = 30.0  # default: a link unmeasured this long is dropped (priced at its tier, then probed)
STEP = 0.5  # NLMS step: the weight of a new sample in a link's estimate
TYPICAL_STEP = 0.05  # the per-tier typical rates move slowly: one link's trouble is not its tier's
MIN_S_PER_BYTE = 1e-14  # 100 TB/s: a floor, so an estimate never reaches zero or below


def tier_of_labels(p: Mapping[str, str], d: Mapping[str, str]) -> str:
    """How close two instances are, from their topology labels (the closest shared one)."""
    if not p or not d:  # an unlabeled instance shares nothing (the common case: no lookups)
        return "other"
    for key, tier in ((LABEL_DOMAIN, "domain"), (LABEL_NODE, "node"), (LABEL_ZONE, "zone")):
        value = p.get(key, "")
        if value and value == d.get(key, ""):
            return tier
    return "other"


def link_tier(p_view: InstanceView, d_view: InstanceView) -> str:
    """The tier of the P→D link ("domain", "node", "zone" or "other"): ``LinkTable.typical``'s key."""
    return tier_of_labels(p_view.info.labels, d_view.info.labels)


@dataclass(slots=True)
class _Pending:
    prefill: str
    model: str
    tokens: int
    at: float


@dataclass(slots=True)
class _Counters:
    """A decode instance's last counters: the baseline of the next increase."""

    nixl: tuple[float, float] | None  # (bytes, seconds)
    transfers: int | None = None  # NIXL transfers done, where the engine says
    pools: dict[str, tuple[float, float]] = field(default_factory=dict)  # by source endpoint


class LinkRates:
    """Per-link rates, per-tier typical rates and KV bytes per token, learned (pure; times are given)."""

    def __init__(self, views: Callable[[], Mapping[str, InstanceView]], forget_s: float = FORGET_S) -> None:
        # The registry's instances now: each one's model, labels (the tier) and pool endpoint.
        self._views = views
        self.forget_s = forget_s
        self._pending: dict[str, list[_Pending]] = {}  # by decode id
        self._last: dict[str, _Counters] = {}  # by decode id
        # The estimates themselves (frozen, replaced on a sample), so a table is one dict copy.
        self._links: dict[Link, LinkEstimate] = {}
        self._oldest = math.inf  # at most the oldest estimate's time: no expiry scan before it is due
        self._typical: dict[str, float] = {}
        self._per_token: dict[str, float] = {}
        self._table: LinkTable | None = EMPTY_LINKS

    def kv_sent(self, p: str, d: str, model: str, tokens: int, now: float) -> None:
        """A decode leg on ``d`` will pull ``tokens`` tokens' KV from ``p``."""
        if tokens > 0 and p != d:
            self._pending.setdefault(d, []).append(_Pending(p, model, tokens, now))

    def metrics(self, d: str, m: MetricsSnapshot, now: float) -> LinkTable:
        """``d``'s heartbeat brought ``m``: learn from its counters' increase; the table after."""
        pending = [s for s in self._pending.pop(d, ()) if now - s.at <= PENDING_S]
        last = self._last.get(d)
        nixl = None if m.kv_in_bytes is None or m.kv_in_seconds is None else (m.kv_in_bytes, m.kv_in_seconds)
        pools = {c.source: (float(c.nbytes), c.seconds) for c in m.kv_in_links}
        self._last[d] = _Counters(nixl, m.kv_in_transfers, pools)
        if last is not None:
            pending = self._pooled(d, last.pools, pools, pending, now)
            grown = _increase(last.nixl, nixl)
            if grown is not None and pending:
                done = _finished(last.transfers, m.kv_in_transfers, len(pending))
                self._shared(d, grown, pending[:done], now)  # the oldest sends finished first
                pending = pending[done:]
        if pending:
            self._pending[d] = pending
        return self.expire(now)

    def _pooled(
        self,
        d: str,
        before: Mapping[str, tuple[float, float]],
        after: Mapping[str, tuple[float, float]],
        pending: list[_Pending],
        now: float,
    ) -> list[_Pending]:
        """Samples from the pool connector's per-source counters; the sends they did not account for."""
        if not after:
            return pending  # no pool connector: skip the scan of every instance
        by_endpoint = {
            v.info.kv_pool_endpoint: a for a, v in self._views().items() if v.info.kv_pool_endpoint
        }
        for source, counts in after.items():
            grown = _increase(before.get(source), counts)
            p = by_endpoint.get(source)
            if grown is None or p is None or p == d:
                continue
            nbytes, seconds = grown
            self._learn(d, {p: nbytes}, seconds, now)
            mine = [s for s in pending if s.prefill == p]
            if mine:
                self._bytes_per_token(mine, nbytes)
                pending = [s for s in pending if s.prefill != p]
        return pending

    def _shared(self, d: str, grown: tuple[float, float], pending: list[_Pending], now: float) -> None:
        """A NIXL increase shared among the pending sends, by their tokens."""
        nbytes, seconds = grown
        total = sum(s.tokens for s in pending)
        shares: dict[str, float] = {}
        for s in pending:
            shares[s.prefill] = shares.get(s.prefill, 0.0) + nbytes * s.tokens / total
        self._learn(d, shares, seconds, now)
        self._bytes_per_token(pending, nbytes)

    def _bytes_per_token(self, sends: Iterable[_Pending], nbytes: float) -> None:
        by_model: dict[str, int] = {}
        for s in sends:
            by_model[s.model] = by_model.get(s.model, 0) + s.tokens
        if len(by_model) == 1:  # sends of several models in one increase: bytes per token unknowable
            ((model, tokens),) = by_model.items()
            old = self._per_token.get(model)
            sample = nbytes / tokens
            self._per_token[model] = sample if old is None else old + STEP * (sample - old)
            self._table = None

    def _learn(self, d: str, nbytes: Mapping[str, float], seconds: float, now: float) -> None:
        """One NLMS step: ``seconds`` spent moving ``nbytes[p]`` bytes from each ``p`` to ``d``."""
        aggregate = seconds / sum(nbytes.values())
        rates: dict[str, float] = {}
        fresh: dict[str, LinkEstimate] = {}
        for p in nbytes:
            link = self._links.get((p, d))
            if link is not None and now - link.learned_at <= FRESH_S:
                fresh[p] = link
            # A link unknown (or stale) starts at what this increase says on average: alone, exactly.
            rates[p] = fresh[p].s_per_byte if p in fresh else aggregate
        error = seconds - sum(rates[p] * b for p, b in nbytes.items())
        norm = sum(b * b for b in nbytes.values())
        views = self._views()
        for p, b in nbytes.items():
            rate = max(MIN_S_PER_BYTE, rates[p] + STEP * error * b / norm)
            pv, dv = views.get(p), views.get(d)
            tier = link_tier(pv, dv) if pv is not None and dv is not None else "other"
            old = fresh.get(p)
            self._links[(p, d)] = LinkEstimate(rate, 1 if old is None else old.samples + 1, now)
            self._oldest = min(self._oldest, now)
            for key in (tier, "any"):
                typical = self._typical.get(key)
                self._typical[key] = rate if typical is None else typical + TYPICAL_STEP * (rate - typical)
        self._table = None

    def expire(self, now: float) -> LinkTable:
        """Drop links unmeasured for ``forget_s``; the table after."""
        if now - self._oldest <= self.forget_s:
            return self.table()  # nothing can be due yet: a scan of every link per heartbeat is not
        old = [k for k, link in self._links.items() if now - link.learned_at > self.forget_s]
        for key in old:
            del self._links[key]
        self._oldest = min((link.learned_at for link in self._links.values()), default=math.inf)
        if old:
            self._table = None
        return self.table()

    def forget(self, agent_id: str) -> LinkTable:
        """``agent_id`` left (or started a new session): drop its links, sends and counters."""
        self._pending.pop(agent_id, None)
        self._last.pop(agent_id, None)
        gone = [k for k in self._links if agent_id in k]
        for key in gone:
            del self._links[key]
        if gone:
            self._table = None
        return self.table()

    def table(self) -> LinkTable:
        """What the scheduler reads; rebuilt only after something changed."""
        if self._table is None:
            links = dict(self._links)
            self._table = LinkTable(
                links=MappingProxyType(links),
                typical=MappingProxyType(dict(self._typical)),
                bytes_per_token=MappingProxyType(dict(self._per_token)),
            )
        return self._table


def _finished(before: int | None, after: int | None, pending: int) -> int:
    """How many of ``pending`` sends (oldest first) the NIXL increase is for: as many as transfers
    finished, where the engine counts them; every one where it does not."""
    if before is None or after is None or after - before <= 0:
        return pending
    return min(pending, after - before)


def _increase(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> tuple[float, float] | None:
    """(bytes, seconds) the counters grew by; None where there is no sample (no baseline, a counter
    went back, nothing moved)."""
    if before is None or after is None:
        return None
    nbytes, seconds = after[0] - before[0], after[1] - before[1]
    if nbytes <= 0 or seconds <= 0 or not math.isfinite(nbytes + seconds):
        return None
    return nbytes, seconds


def links_json(table: LinkTable, views: Mapping[str, InstanceView], now: float) -> dict[str, Any]:
    """``GET /admin/v1/links``: learned links (fastest first), typical rates, bytes per token."""
    items: list[dict[str, Any]] = []
    for (p, d), est in table.links.items():
        pv, dv = views.get(p), views.get(d)
        items.append(
            {
                "prefill": p,
                "decode": d,
                "gbps": gbps(est.s_per_byte),
                "s_per_byte": est.s_per_byte,
                "samples": est.samples,
                "age_s": round(max(0.0, now - est.learned_at), 3),
                "tier": link_tier(pv, dv) if pv is not None and dv is not None else "other",
            }
        )
    items.sort(key=lambda i: (-i["gbps"], i["prefill"], i["decode"]))
    typical = {tier: {"gbps": gbps(s), "s_per_byte": s} for tier, s in sorted(table.typical.items())}
    return {
        "links": items,
        "typical": typical,
        "bytes_per_token": dict(sorted(table.bytes_per_token.items())),
    }


def gbps(s_per_byte: float) -> float:
    """A rate in seconds per byte as gigabits per second."""
    return 8.0 / s_per_byte / 1e9
