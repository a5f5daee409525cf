"""The plugin scheduler: the decode profile picks D, the decider picks the mode, the prefill profile P.

A profile turns the model's instances into one pick:

1. filters that read only membership fields (``PER_REQUEST = False``: role, state) run once per
   registry membership version, and their result is kept as agent ids;
2. when more than ``max_candidates`` survive, the instances holding the longest cached prefix of the
   prompt come first and a window fills the rest: at a request-seeded offset (power-of-d sampling),
   or, past ``shards.above`` eligible instances, in a shard chosen first (``shards.py``), so the
   decision stays O(max_candidates) at 10,000 instances;
3. the per-request filters run on those candidates (on all survivors if none pass in the sample);
4. each scorer rates the candidates in [0, 1]; the weighted sum goes to the picker.

A client may pin the prefill instance; then the decode profile's partner is that instance, so only a
D that can exchange KV with it is picked, and the mode is disaggregated. A client may pin the decode
instance too (or instead): it is D, and the decode profile does not run (``pins.py`` checks the pins,
and that a pinned pair can exchange KV). Nothing here does I/O or
keeps state beyond a memo of step 1 keyed by membership version, so ``decide`` is pure.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from vllm_disagg.errors import BadRequest, ModelNotFound, NoCapacity
from vllm_disagg.orchestrator.scheduling import explain, pins, ranked, shards
from vllm_disagg.orchestrator.scheduling.colocate import colocate_for_ttft
from vllm_disagg.orchestrator.scheduling.config import (
    REQUIRED_FILTER,
    SchedulerConfig,
    build_plugins,
    default_config,
)
from vllm_disagg.orchestrator.scheduling.explain import PluginExplanation, ProfileTrace, Stage
from vllm_disagg.orchestrator.scheduling.framework import (
    Decider,
    Decision,
    Filter,
    ModeChoice,
    PairChoice,
    Pairing,
    Picker,
    ProfileContext,
    ProfileName,
    SchedulingRequest,
    Scorer,
)
from vllm_disagg.orchestrator.scheduling.fused import fused_pass, weighted_sum
from vllm_disagg.orchestrator.scheduling.plugins.filters.topology import TYPE as TOPOLOGY_FILTER
from vllm_disagg.orchestrator.scheduling.plugins.pickers.max_score import TYPE as MAX_SCORE_PICKER
from vllm_disagg.orchestrator.scheduling.shards import ShardConfig, Shards
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

NAME = explain.NAME
log = logging.getLogger(__name__)

# A profile's eligible agent ids, their filter stages, the ids as a set, and their shards (None: flat).
_Eligible = tuple[tuple[str, ...], tuple[Stage, ...], frozenset[str], Shards | None]


class _Profile:
    """One configured profile, built."""

    def __init__(
        self,
        name: ProfileName,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        max_candidates: int,
        shard_config: ShardConfig | None = None,
        ranked_width: int = 0,
    ) -> None:
        self.name = name
        self.static = tuple(f for f in filters if not f.PER_REQUEST)
        # (filter, its ``applies`` or None): a filter that does not apply to a request is skipped.
        self.dynamic = tuple((f, getattr(f, "applies", None)) for f in filters if f.PER_REQUEST)
        # (filter, its ``applies``, whether it judges each candidate alone): while one that judges the
        # candidates together applies, the ranked path cannot walk.
        self._walkable = tuple((f, a, getattr(f, "PER_CANDIDATE", False)) for f, a in self.dynamic)
        # How many best totals the ranked path finds (0: it is off): only the best-total picker's pick
        # is the flat one's from them.
        self.ranked_width = ranked_width if picker.TYPE == MAX_SCORE_PICKER else 0
        self.set_weights(scorers)
        self.picker = picker
        self.max_candidates = max_candidates
        self.shard_config = shard_config
        self._loads = shards.Loads()  # shard windows' engine loads, per snapshot version
        # model -> (eligible agent ids, the stages, the id set, their shards) for one registry
        # membership: the static filters read only membership fields, so this holds until it changes.
        self._memo: dict[str, _Eligible] = {}
        self._memo_of: tuple[int, int] = (0, -1)  # (registry id, membership version)

    def set_weights(self, scorers: Sequence[tuple[Scorer, float]]) -> None:
        """Replace the scorers' weights (one assignment: a decision sees all old or all new ones)."""
        live = [(s, w) for s, w in scorers if w]  # a scorer of weight 0 is neither run nor shown
        fused, bound = fused_pass(live)
        self.scorers, self.weights, self._shown, self._scoring, self._rankings = (
            tuple(scorers),
            tuple((s.name, w) for s, w in scorers),
            tuple((s.name, w) for s, w in live),
            (tuple(s for s, _ in live), weighted_sum([float(w) for _, w in live]), fused),
            ranked.Rankings(bound) if bound is not None and self.ranked_width else None,
        )

    def _eligible(self, ctx: ProfileContext, population: tuple[str, ...]) -> _Eligible:
        snapshot = ctx.snapshot
        key = (snapshot.registry_id, snapshot.membership)
        if key != self._memo_of:
            self._memo.clear()
            self._memo_of = key
        model = ctx.request.model
        hit = self._memo.get(model)
        if hit is not None:
            return hit
        stages = []
        by_id = snapshot.by_id
        current: Sequence[InstanceView] = [by_id[i] for i in population]
        for f in self.static:
            kept = f.filter(ctx, current)
            stages.append(Stage(f.name, tuple(v.agent_id for v in current), tuple(v.agent_id for v in kept)))
            current = kept
        ids = tuple(v.agent_id for v in current)
        cfg = self.shard_config
        sharded = shards.split(ids, by_id, cfg) if cfg is not None else None
        result = (ids, tuple(stages), frozenset(ids), sharded)
        self._memo[model] = result
        return result

    def state(self, ctx: ProfileContext, population: tuple[str, ...]) -> dict[str, Any]:
        """The debug dump of this profile for ``ctx``'s model now: its plugins, the instances its
        static filters leave (and whom each filter took out, why where it says), and their shards."""
        eligible, stages, _, sharded = self._eligible(ctx, population)
        filtered = []
        for stage in stages:
            kept = set(stage.kept_out)
            out = [i for i in stage.kept_in if i not in kept]
            filtered.append({"filter": stage.filter, "out": out, "reasons": dict(stage.reasons or {})})
        return {
            "filters": [f.name for f in self.static] + [f.name for f, _ in self.dynamic],
            "weights": dict(self.weights),
            "picker": self.picker.name,
            "max_candidates": self.max_candidates,
            "eligible": list(eligible),
            "filtered": filtered,
            "shards": None
            if sharded is None
            else [
                {"shard": n, "instances": list(g)} for n, g in zip(sharded.names, sharded.groups, strict=True)
            ],
        }

    def _sample(
        self, ctx: ProfileContext, eligible: tuple[str, ...], ids: frozenset[str], sharded: Shards | None
    ) -> tuple[Sequence[str], str | None]:
        """The candidates to score: the prefix holders first, then a window of the eligible (a seeded
        one, or the chosen shard's), and the shard's name."""
        k = self.max_candidates
        if sharded is None or len(sharded.groups) == 1:  # one shard: the flat window, the same pick
            window, shard = shards.window(eligible, k, ctx.random(7)), None
        else:
            assert self.shard_config is not None
            i, window = shards.choose(
                sharded, ctx.snapshot, ctx.partner, self.shard_config, k, ctx.random, self._loads
            )
            shard = sharded.names[i]
        cached = ctx.request.cached_tokens
        if not cached:
            return window, shard
        holders = [i for i in cached if i in ids]
        if not holders:
            return window, shard
        if len(holders) > 1:  # the longest prefixes first (a stable sort: ties keep the index's order)
            holders.sort(key=cached.__getitem__, reverse=True)
            del holders[k // 2 :]
        # The window's first places after the holders, unless a holder is among them (rare): then the
        # window less the holders. (Filtering every time compared each window id with each holder.)
        rest = window[: k - len(holders)]
        held = set(holders)
        if not held.isdisjoint(rest):
            rest = [i for i in window if i not in held][: k - len(holders)]
        holders.extend(rest)
        return holders, shard

    def run(
        self, ctx: ProfileContext, population: tuple[str, ...], exclude: frozenset[str] = frozenset()
    ) -> ProfileTrace:
        """Filter, sample, score and pick; ``picked`` is -1 when no candidate is left.

        ``exclude``: instances that may not serve this request (they failed it, or cannot reach the
        partner); shown in the explanation as filtered by ``excluded``.
        """
        eligible, stages, ids, sharded = self._eligible(ctx, population)
        everyone = eligible, ids  # the ranking ranks them all; ``ids`` says whom this request may use
        if exclude and not exclude.isdisjoint(ids):
            kept = tuple(i for i in eligible if i not in exclude)
            stages = (*stages, Stage("excluded", eligible, kept))
            eligible, ids = kept, ids - exclude
        by_id = ctx.snapshot.by_id
        sampled = len(eligible) > self.max_candidates
        if sampled and self._rankings is not None:
            found = self._ranked(ctx, *everyone, ids)
            if found is not None:
                found_in, found_stages, found_totals = found
                return self._trace(
                    ctx, population, stages + found_stages, len(eligible), found_in, found_totals, ranked=True
                )
        chosen, shard = self._sample(ctx, eligible, ids, sharded) if sampled else (eligible, None)
        pool = [by_id[i] for i in chosen]  # this snapshot's views: current metrics
        candidates, dyn = self._dynamic(ctx, pool)
        if not candidates and sampled:
            sampled, shard = False, None
            candidates, dyn = self._dynamic(ctx, [by_id[i] for i in eligible])
        if not candidates:
            return self._trace(ctx, population, stages + dyn, len(eligible), (), (), None, sampled)
        try:
            scores, totals = self._score(ctx, candidates)
        except Exception:  # a plugin's bug, or figures it cannot take: never a failed request
            candidates, dropped = self._scorable(ctx, candidates)
            dyn = (*dyn, dropped)
            if not candidates:
                raise NoCapacity(f"no {self.name} candidate could be scored (see the log)") from None
            scores, totals = self._score(ctx, candidates)
        return self._trace(
            ctx, population, stages + dyn, len(eligible), candidates, totals, scores, sampled, shard=shard
        )

    def _ranked(
        self, ctx: ProfileContext, eligible: tuple[str, ...], members: frozenset[str], ids: frozenset[str]
    ) -> tuple[list[InstanceView], tuple[Stage, ...], list[float]] | None:
        """The ranked path's candidates, filter stages and totals; None where it cannot serve.
        ``eligible`` (``members`` as a set): whom it ranks; ``ids``: whom this request may use."""
        assert self._rankings is not None
        fused = self._scoring[2]
        applying = ranked.applying(ctx.request, self._walkable)
        if fused is None or applying is None:
            return None
        ranking = self._rankings.follow(ctx.snapshot, ctx.request.model, eligible, members)
        if ranking is None:
            return None
        # The pairing pairs among the best ``ranked_width`` only where links are known (``pairing.py``).
        links = ctx.snapshot.links
        width = self.ranked_width if links.links or links.typical else 1
        try:
            return ranked.candidates(ctx, ranking, ids, applying, fused, width, self._filtered)
        except Exception:  # a plugin's bug: the sampled path scores candidate by candidate, and says so
            log.exception("%s profile: the ranked path failed; sampling instead", self.name)
            return None

    def _trace(
        self,
        ctx: ProfileContext,
        population: tuple[str, ...],
        stages: tuple[Stage, ...],
        eligible: int,
        candidates: Sequence[InstanceView],
        totals: Sequence[float],
        scores: tuple[Sequence[float], ...] | None = None,
        sampled: bool = False,
        *,
        shard: str | None = None,
        ranked: bool = False,
    ) -> ProfileTrace:
        """The trace of the candidates scored (none: ``picked`` -1), with the picker's pick by their
        totals. Where the fused pass gave only the totals (``scores`` None), each scorer's column is
        computed only if an explanation is rendered, from the decision's ``basis``."""
        picked = -1 if not candidates else self.picker.pick(ctx, totals) if len(candidates) > 1 else 0
        basis = None if scores is not None else (ctx.request, ctx.now, ctx.profile, ctx.snapshot.in_flight)
        return ProfileTrace(
            self.name,
            len(population),
            stages,
            eligible,
            sampled,
            candidates,
            self._shown,
            totals,
            self.picker.name,
            picked,
            scores,
            basis,
            self._scoring[0],
            shard,
            ranked,
        )

    def _score(
        self, ctx: ProfileContext, candidates: Sequence[InstanceView]
    ) -> tuple[tuple[Sequence[float], ...] | None, Sequence[float]]:
        """Each scorer's scores (None where the fused pass computed only the totals), and the totals."""
        plugins, combine, fused = self._scoring
        if fused is not None:
            return None, fused(ctx, candidates)
        scores = tuple([s.score(ctx, candidates) for s in plugins])
        return scores, combine(scores, len(candidates))

    def _scorable(
        self, ctx: ProfileContext, candidates: Sequence[InstanceView]
    ) -> tuple[list[InstanceView], Stage]:
        """Scoring raised: the candidates that score alone, and the others as a filter stage, each one's
        error logged and given as its reason."""
        kept, why = [], {}
        for c in candidates:
            try:
                self._score(ctx, [c])
            except Exception as exc:
                log.exception("%s profile: %s dropped: scoring it raised", self.name, c.agent_id)
                why[c.agent_id] = f"scoring raised {type(exc).__name__}: {exc}"
            else:
                kept.append(c)
        return kept, Stage("scoring-failed", candidates, kept, why)

    def _dynamic(
        self, ctx: ProfileContext, pool: Sequence[InstanceView]
    ) -> tuple[Sequence[InstanceView], tuple[Stage, ...]]:
        return self._filtered(ctx, pool, self.dynamic)

    @staticmethod
    def _filtered(
        ctx: ProfileContext, pool: Sequence[InstanceView], filters: ranked.Applying
    ) -> tuple[Sequence[InstanceView], tuple[Stage, ...]]:
        """What ``filters`` that apply to the request keep of ``pool``, in turn, and a stage each (with
        reasons for those left out)."""
        stages = []
        current = pool
        request = ctx.request
        for f, applies in filters:
            if applies is not None and not applies(request):
                continue
            kept = f.filter(ctx, current)
            why = getattr(f, "reasons", None) if len(kept) < len(current) else None
            if why is not None:
                out = {v.agent_id for v in kept}
                why = why(ctx, [v for v in current if v.agent_id not in out])
            stages.append(Stage(f.name, current, kept, why))
            current = kept
        return current, tuple(stages)


class PluginScheduler:
    """The configured profiles and decider, run for each request."""

    name = NAME

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        config = config or default_config()
        self.config = config
        plugins: Mapping[str, Any] = build_plugins(config)
        # The ranked path finds the best total, or the pairing's best ``width`` (it pairs among them).
        pairing_width = (
            getattr(getattr(plugins[config.pairing], "params", None), "width", 1) if config.pairing else 1
        )
        self._profiles = {
            name: _Profile(
                name,
                [plugins[f] for f in p.filters],
                [(plugins[s], w) for s, w in p.scorers],
                plugins[p.picker],
                p.max_candidates,
                config.shards,
                pairing_width if config.ranked else 0,
            )
            for name, p in config.profiles.items()
        }
        self._decider: Decider = plugins[config.decider]
        decode = self._profiles["decode"]
        # What a pinned pair must pass (``pins.check_pair``): the decode profile's KV and topology filters.
        self._kv_filters = tuple(
            f
            for f in (*decode.static, *(f for f, _ in decode.dynamic))
            if f.TYPE in (REQUIRED_FILTER, TOPOLOGY_FILTER)
        )
        # What a P ranked for one D must pass to be paired with another: the prefill profile's.
        self._pair_filters = tuple(
            f for f, _ in self._profiles["prefill"].dynamic if f.TYPE in (REQUIRED_FILTER, TOPOLOGY_FILTER)
        )
        self._pairing: Pairing | None = plugins[config.pairing] if config.pairing else None
        # (ctx, decode) -> a final choice before the prefill profile, or None: see ``Decider``.
        self._shortcut: Callable[[ProfileContext, InstanceView], ModeChoice | None] | None = getattr(
            self._decider, "shortcut", None
        )

    def decide(self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float) -> Decision:
        """Pick D, then the mode, then P; raises ``ModelNotFound``, ``NoCapacity`` or ``BadRequest``."""
        model = request.model
        population = snapshot.model_ids.get(model)
        if not population:
            raise ModelNotFound(f"the model '{model}' does not exist", param="model")
        pin_p, pin_d = request.pinned_prefill, request.pinned_decode
        pinned = pins.resolve(pin_p, snapshot, model, "prefill") if pin_p else None
        pinned_d = pins.resolve(pin_d, snapshot, model, "decode") if pin_d else None
        dctx = ProfileContext(_own_pools(request, snapshot), snapshot, now, "decode", pinned)
        if pinned_d is None:
            dtrace = self._profiles["decode"].run(dctx, population, request.exclude)
            if dtrace.picked < 0:
                raise pins.no_decode(model, dtrace, pinned)
        else:
            if pinned is not None:
                pins.check_pair(dctx, pinned, pinned_d, self._kv_filters)
            dtrace = pins.pinned_trace(len(population), pinned_d)
        d = dtrace.candidates[dtrace.picked]
        d_pin = pinned_d.agent_id if pinned_d is not None else None
        if pinned is not None:
            also = f" and decode instance {d_pin!r}" if d_pin is not None else ""
            choice = ModeChoice(
                "disaggregated", f"the client pinned prefill instance {pinned.agent_id!r}{also}"
            )
            explanation = PluginExplanation(
                self.config.source, request, dtrace, choice, "client", None, pinned.agent_id, d_pin
            )
            return Decision("disaggregated", pinned.agent_id, d.agent_id, explanation)
        if request.pooled_tokens and self._shortcut is not None:
            early = self._shortcut(dctx, d)
            if early is not None:  # straight to decode: D loads the prompt from a KV pool
                explanation = PluginExplanation(
                    self.config.source, request, dtrace, early, self._decider.name, None, None, d_pin
                )
                return Decision("colocated", None, d.agent_id, explanation, early.kv_source)
        pctx = ProfileContext(request, snapshot, now, "prefill", d)
        ptrace = self._profiles["prefill"].run(pctx, population, _prefill_exclude(request, snapshot, d))
        choice = self._decider.choose(pctx, d, ptrace.picked >= 0)
        paired: PairChoice | None = None
        if choice.mode == "disaggregated" and ptrace.picked >= 0:
            if self._pairing is not None and pinned_d is None:  # P and D together: least TTFT, transfer in
                paired = self._pairing.pair(pctx, dtrace, ptrace, self._pair_filters)
            p = ptrace.candidates[ptrace.picked] if paired is None else paired.prefill
            d = d if paired is None else paired.decode
            if request.slo_ttft_s is not None:
                choice = colocate_for_ttft(request, snapshot, p, d) or choice
        explanation = PluginExplanation(
            self.config.source, request, dtrace, choice, self._decider.name, ptrace, None, d_pin, paired
        )
        if choice.mode == "colocated" or ptrace.picked < 0:
            return Decision("colocated", None, d.agent_id, explanation)
        return Decision("disaggregated", p.agent_id, d.agent_id, explanation)

    def state(self, snapshot: RegistrySnapshot, now: float) -> dict[str, Any]:
        """What the scheduler would work from now, per model and profile (``GET /admin/v1/debug/state``):
        the eligible instances and their shards as a request would find them, the plugins and weights."""
        models: dict[str, dict[str, Any]] = {}
        for model, population in sorted(snapshot.model_ids.items()):
            request = SchedulingRequest(
                request_id="debug", model=model, prompt_len=0, is_chat=False, stream=False
            )
            models[model] = {
                name: profile.state(ProfileContext(request, snapshot, now, name), population)
                for name, profile in self._profiles.items()
            }
        shard = self.config.shards
        return {
            "config": self.config.source,
            "decider": self._decider.name,
            "pairing": self._pairing.name if self._pairing is not None else None,
            "shards": None
            if shard is None
            else {"key": shard.key, "size": shard.size, "fanout": shard.fanout, "above": shard.above},
            "models": models,
        }

    def weights(self) -> dict[str, dict[str, float]]:
        """Each profile's scorer weights."""
        return {name: dict(profile.weights) for name, profile in self._profiles.items()}

    def update_weights(self, changes: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
        """Set some scorers' weights, all or none: ``BadRequest`` for an unknown profile or scorer, or a
        weight that is not a finite number >= 0. Returns every weight after the change."""
        if not isinstance(changes, Mapping) or not changes:
            raise BadRequest("give {profile: {scorer: weight}} with at least one weight")
        staged: dict[str, list[tuple[Scorer, float]]] = {}
        for name, weights in changes.items():
            profile = self._profiles.get(name)  # type: ignore[call-overload]
            if profile is None:
                raise BadRequest(f"no profile {name!r} (profiles: {sorted(self._profiles)})")
            if not isinstance(weights, Mapping):
                raise BadRequest(f"profile {name!r}: give {{scorer: weight}}")
            scorers = list(profile.scorers)
            known = {s.name: i for i, (s, _) in enumerate(scorers)}
            for scorer, weight in weights.items():
                if scorer not in known:
                    raise BadRequest(f"profile {name!r} has no scorer {scorer!r} (scorers: {sorted(known)})")
                if (
                    isinstance(weight, bool)
                    or not isinstance(weight, int | float)
                    or not 0 <= weight < math.inf
                ):
                    raise BadRequest(
                        f"profile {name!r}, scorer {scorer!r}: a weight is a number >= 0, got {weight!r}"
                    )
                i = known[scorer]
                scorers[i] = (scorers[i][0], float(weight))
            staged[name] = scorers
        for name, scorers in staged.items():  # every check passed: apply them all
            self._profiles[name].set_weights(scorers)  # type: ignore[index]
        return self.weights()

    def pick_prefill(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, decode: str
    ) -> str | None:
        """Another prefill instance for a request whose decode instance is chosen (a retry); None if none.

        Instances in ``request.exclude`` (those that failed it) are never picked.
        """
        d = snapshot.by_id[decode]
        population = snapshot.model_ids.get(request.model, ())
        ctx = ProfileContext(request, snapshot, now, "prefill", d)
        trace = self._profiles["prefill"].run(ctx, population, _prefill_exclude(request, snapshot, d))
        return trace.candidates[trace.picked].agent_id if trace.picked >= 0 else None

    def pick_decode(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, prefill: str | None
    ) -> str | None:
        """Another decode instance (a retry), able to take KV from ``prefill`` when given; None if none."""
        partner = snapshot.by_id.get(prefill) if prefill is not None else None
        population = snapshot.model_ids.get(request.model, ())
        ctx = ProfileContext(_own_pools(request, snapshot), snapshot, now, "decode", partner)
        exclude = request.exclude
        if partner is not None and snapshot.blocked_links:
            exclude = exclude | {d for p, d in snapshot.blocked_links if p == partner.agent_id}
        trace = self._profiles["decode"].run(ctx, population, exclude)
        return trace.candidates[trace.picked].agent_id if trace.picked >= 0 else None


def _own_pools(request: SchedulingRequest, snapshot: RegistrySnapshot) -> SchedulingRequest:
    """The request as the decode profile reads it where agents' KV pools hold some of the prompt: what
    an instance's own pool holds (memory or disk; its host's, where engines share one) counts as its
    cache, since its engine loads that instead of computing it (the straight-to-decode shortcut, a
    colocated request). So the prefix holders sampled first and the prefix term include the pools'
    holders, and a D whose own pool holds the prompt is preferred over one that would fetch it from
    another agent's. Another pool counts for nothing here: reaching it takes a transfer (the decider
    weighs that)."""
    pooled = request.pooled_tokens
    if not pooled:
        return request
    cached = dict(request.cached_tokens)
    members = snapshot.pool_members
    for agent_id, tokens in pooled.items():
        for holder in (agent_id, *members.get(agent_id, ())):
            if tokens > cached.get(holder, 0):
                cached[holder] = tokens
    return dataclasses.replace(request, cached_tokens=MappingProxyType(cached))


def _prefill_exclude(
    request: SchedulingRequest, snapshot: RegistrySnapshot, d: InstanceView
) -> frozenset[str]:
    """What the prefill profile may not pick: the request's failed instances and P's whose link to D is
    blocked by its breaker."""
    if not snapshot.blocked_links:
        return request.exclude
    return request.exclude | {p for p, dd in snapshot.blocked_links if dd == d.agent_id}
