"""A decision's explanation: both profiles' traces (candidates, filters, scores, pick) and the decider's
choice, built for every decision and rendered to JSON only when the admin API asks (``to_json``), or
summed up in a few fields for a trace span (``summary``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from vllm_disagg.orchestrator.scheduling.framework import (
    ModeChoice,
    PairChoice,
    ProfileContext,
    ProfileName,
    SchedulingRequest,
    Scorer,
)
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

NAME = "plugins"
_MAX_FILTERED_SHOWN = 64  # filtered-out instances listed per profile in an explanation


@dataclass(slots=True)  # not frozen (built per decision; a frozen one costs twice as much): never mutated
class Stage:
    """One filter's input and output: agent ids for the memoized filters, views for the others."""

    filter: str
    kept_in: Sequence[InstanceView] | Sequence[str]
    kept_out: Sequence[InstanceView] | Sequence[str]
    reasons: Mapping[str, str] | None = None  # filtered id -> why, from a filter's ``reasons``


def _id(item: InstanceView | str) -> str:
    return item if isinstance(item, str) else item.agent_id


# Traces are built for every decision and read only when the admin API asks: plain (not frozen)
# dataclasses, as a frozen one costs four times as much to build; nothing mutates them.
@dataclass(slots=True)
class ProfileTrace:
    """How one profile reached its pick; rendered to JSON only when asked."""

    profile: ProfileName
    population: int  # instances of the model, any state
    stages: tuple[Stage, ...]
    eligible: int  # after the snapshot-only filters
    sampled: bool
    candidates: Sequence[InstanceView]
    scorers: tuple[tuple[str, float], ...]
    totals: Sequence[float]
    picker: str
    picked: int  # index into candidates; -1 when none
    # Each scorer's column; None after a fused pass, which gives only the totals: ``scores`` then
    # computes them as the generic pass would have, from what a term may read (the request and the
    # in-flight counts: ``framework.TermScorer``). Not the whole context: records keep their
    # explanation, and a snapshot per record would hold every instance's view alive.
    columns: tuple[Sequence[float], ...] | None = ()
    basis: tuple[SchedulingRequest, float, Any, Mapping[str, int]] | None = None  # request, now, profile
    plugins: tuple[Scorer, ...] = ()
    shard: str | None = None  # the shard searched, where the profile is sharded (``shards.py``)
    ranked: bool = False  # the candidates are the holders and a walk of the ranking (``ranked.py``)

    @property
    def scores(self) -> tuple[Sequence[float], ...]:
        """Each scorer's scores of the candidates, in the scorers' order."""
        if self.columns is None:
            assert self.basis is not None
            request, now, profile, in_flight = self.basis
            ctx = ProfileContext(request, _in_flight_only(in_flight), now, profile)
            self.columns = tuple([s.score(ctx, self.candidates) for s in self.plugins])
            self.basis = None
        return self.columns

    def to_json(self) -> dict[str, object]:
        """Candidates with each scorer's score and the total (best first), the filtered, the pick."""
        rows = []
        for i, view in enumerate(self.candidates):
            rows.append(
                {
                    "id": view.agent_id,
                    "scores": {
                        name: round(s[i], 6) for (name, _), s in zip(self.scorers, self.scores, strict=True)
                    },
                    "total": round(self.totals[i], 6),
                }
            )
        rows.sort(key=lambda r: -float(r["total"]))  # type: ignore[arg-type]
        filtered: list[dict[str, str]] = []
        for stage in self.stages:
            kept = {_id(v) for v in stage.kept_out}
            why = stage.reasons or {}
            filtered.extend(
                {"id": _id(v), "filter": stage.filter} | ({"reason": why[_id(v)]} if _id(v) in why else {})
                for v in stage.kept_in
                if _id(v) not in kept
            )
        return {
            "population": self.population,
            "eligible": self.eligible,
            "sampled": self.sampled,
            **({"ranked": True} if self.ranked else {}),
            **({"shard": self.shard} if self.shard is not None else {}),
            "filtered": filtered[:_MAX_FILTERED_SHOWN],
            "filtered_count": len(filtered),
            "weights": dict(self.scorers),
            "candidates": rows,
            "picker": self.picker,
            "pick": self.candidates[self.picked].agent_id if self.picked >= 0 else None,
        }


@dataclass(slots=True)
class PluginExplanation:
    """A whole decision: the request as the scheduler saw it, both profiles, and the decider."""

    config: str
    request: SchedulingRequest
    decode: ProfileTrace
    choice: ModeChoice
    decider: str
    prefill: ProfileTrace | None
    pinned: str | None
    pinned_decode: str | None = None  # the client's decode instance: then ``decode`` holds it alone
    pairs: PairChoice | None = None  # the pairs the pairing weighed, where it knew the links

    def summary(self) -> dict[str, str | int | float]:
        """Each profile's pick, its total and how many candidates were scored, and the decider's
        reason: what a trace's ``schedule`` span carries (the whole of it: ``to_json``)."""
        out: dict[str, str | int | float] = {"decider": self.decider, "reason": self.choice.reason}
        for trace in (self.decode, self.prefill):
            if trace is not None and trace.picked >= 0:
                name = trace.profile
                out[f"{name}.pick"] = trace.candidates[trace.picked].agent_id
                out[f"{name}.total"] = round(trace.totals[trace.picked], 6)
                out[f"{name}.candidates"] = len(trace.candidates)
        return out

    def to_json(self) -> dict[str, object]:
        """The explanation the admin API returns."""
        req = self.request
        top = sorted(req.cached_tokens.items(), key=lambda kv: -kv[1])[:16]
        pooled = sorted(req.pooled_tokens.items(), key=lambda kv: -kv[1])[:16]
        decider: dict[str, object] = {
            "plugin": self.decider,
            "mode": self.choice.mode,
            "reason": self.choice.reason,
        }
        if self.choice.kv_source is not None:
            decider["kv_source"] = self.choice.kv_source
        doc: dict[str, object] = {
            "scheduler": NAME,
            "config": self.config,
            "request": {
                "prompt_tokens": req.prompt_len,
                "tokenized": req.tokenized,
                "cached_tokens": dict(top),
                "pooled_tokens": dict(pooled),
                "pinned_prefill": req.pinned_prefill,
                "pinned_decode": req.pinned_decode,
                "slo_ttft_s": req.slo_ttft_s,
                "slo_tpot_s": req.slo_tpot_s,
            },
            "decode": self.decode.to_json(),
            "decider": decider,
            "prefill": self.prefill.to_json() if self.prefill is not None else None,
            "pinned_prefill": self.pinned,
            "pinned_decode": self.pinned_decode,
        }
        if self.pairs is not None:
            doc["pairs"] = self.pairs.to_json()
        return doc


def _in_flight_only(in_flight: Mapping[str, int]) -> RegistrySnapshot:
    """A snapshot holding only in-flight counts: what a term scorer's ``score`` may read of one."""
    return RegistrySnapshot(0, 0, 0, MappingProxyType({}), in_flight, frozenset(), _NONE, _NONE, _NONE)


_NONE: Mapping[str, tuple[str, ...]] = MappingProxyType({})
