"""The scheduling contract: requests, decisions, and the plugin protocols profiles are made of.

A scheduler is pure: ``decide(request, snapshot, now)`` reads an immutable registry snapshot (and the
prefix matches the gateway looked up for this request) and returns a ``Decision``; the gateway does
the I/O. The plugin scheduler (``scheduler.py``) runs two profiles, ``decode`` then ``prefill``, each
made of filters -> weighted scorers -> one picker, and a decider between them that chooses
disaggregated or colocated. Plugins are registered by ``TYPE`` name (``registry.py``) and built from
the YAML config (``config.py``).

Randomness is a pure function of the request id (``ProfileContext.random``), so a decision can be
replayed and explained; there is no shared random state.
"""

from __future__ import annotations

import builtins
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Protocol

from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import MetricsSnapshot

Mode = Literal["disaggregated", "colocated"]
MODES: tuple[Mode, ...] = ("disaggregated", "colocated")
ProfileName = Literal["decode", "prefill"]
PROFILE_NAMES: tuple[ProfileName, ...] = ("decode", "prefill")

NO_CACHE: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """What the scheduler may know about a request, worked out once by the gateway."""

    request_id: str
    model: str
    prompt_len: int  # tokens: exact when ``tokenized``, else an estimate (characters / 4)
    is_chat: bool
    stream: bool
    # instance id -> how many leading prompt tokens its prefix cache holds (from the prefix index);
    # instances holding nothing are absent.
    cached_tokens: Mapping[str, int] = field(default_factory=lambda: NO_CACHE)
    tokenized: bool = False
    pinned_prefill: str | None = None  # the client's pick: an agent id or an engine URL
    max_tokens: int | None = None
    # Instances this request must not use: they already failed it (the gateway's retries).
    exclude: frozenset[str] = frozenset()
    # The client's own targets (``x-slo-ttft-ms``, ``x-slo-tpot-ms``, or the orchestrator's defaults).
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # instance id -> how many leading prompt tokens its agent's KV pool holds (protocol 1.3 pools, kept
    # apart from ``cached_tokens``); empty where no agent runs a pool.
    pooled_tokens: Mapping[str, int] = field(default_factory=lambda: NO_CACHE)
    # The client's decode instance (as ``pinned_prefill``): never retried nor resumed elsewhere.
    pinned_decode: str | None = None


class Explanation(Protocol):
    """Why a decision was made; rendered only when someone asks (the admin API), not per request."""

    def to_json(self) -> dict[str, object]:
        """A JSON-ready description."""
        ...

    def summary(self) -> dict[str, str | int | float]:
        """A few flat fields of it (the picks and their scores), cheap enough for every traced request."""
        ...


# Not frozen: one is built per decision (a frozen one costs five times as much). Nothing mutates one.
@dataclass(slots=True)
class Decision:
    """Where a request goes: a prefill instance (None when colocated) and a decode instance."""

    mode: Mode
    prefill: str | None
    decode: str
    explanation: Explanation | None = None
    # Colocated on a decode instance that loads the prompt's KV from an agent's pool: this instance's
    # (the decode instance's own: nothing moves; another's: the gateway has it fetched first).
    kv_source: str | None = None


class Scheduler(Protocol):
    """Picks instances for a request.

    Raises ``vllm_disagg.errors.ModelNotFound`` when no instance in any state serves the model,
    ``vllm_disagg.errors.NoCapacity`` when none that could decode it is ready, and
    ``vllm_disagg.errors.BadRequest`` when the client pinned a prefill or decode instance (or a pair)
    that cannot be used.
    """

    def decide(self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float) -> Decision:
        """The decision for one request; pure in (request, snapshot, now)."""
        ...

    def pick_prefill(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, decode: str
    ) -> str | None:
        """A prefill instance for a request whose decode instance is chosen (a retry), never one in
        ``request.exclude``; None when there is none."""
        ...

    def pick_decode(
        self, request: SchedulingRequest, snapshot: RegistrySnapshot, now: float, prefill: str | None
    ) -> str | None:
        """A decode instance (a retry) able to take KV from ``prefill`` when given, never one in
        ``request.exclude``; None when there is none."""
        ...


# Not frozen: two are built per decision, and a frozen dataclass costs five times as much to build
# (each field set through ``object.__setattr__``). Nothing mutates one.
@dataclass(slots=True)
class ProfileContext:
    """What a plugin sees besides the candidates: the request, the snapshot, and the profile's place."""

    request: SchedulingRequest
    snapshot: RegistrySnapshot
    now: float
    profile: ProfileName
    # The instance the candidate must exchange KV with: the chosen decode instance while the prefill
    # profile runs; the client's pinned prefill instance while the decode profile runs; else None.
    partner: InstanceView | None = None

    def random(self, salt: int) -> float:
        """A uniform number in [0, 1) that depends only on the request id, the profile and ``salt``."""
        # blake2b, not crc32: crc32 of keys that differ only in the salt are linearly related, which
        # made the two draws of power-of-two choices nearly fixed pairs.
        key = f"{self.request.request_id}/{self.profile}/{salt}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 18446744073709551616.0


class Plugin(Protocol):
    """Every plugin: its registered type name and the name the config gave this instance of it."""

    TYPE: ClassVar[str]
    name: str


class Filter(Plugin, Protocol):
    """Keeps the candidates that may serve the request in this profile (order preserved).

    Filters are predicates, so their order never changes the result. ``PER_REQUEST`` False says the
    result depends only on the profile and the instances' membership fields (model, role, revision,
    block size, connector, state, drain flags) — not on metrics or the request: the scheduler then runs
    it once per registry membership version (``RegistrySnapshot.membership``), not once per request.
    A per-request filter may also have ``applies(request) -> bool``: when False it is not run for that
    request and leaves no stage in its explanation (the slo-filter, for requests without targets).
    ``PER_CANDIDATE = True`` (optional) says it keeps or drops each candidate whatever the others are
    (no "all of them when none passes"): the ranked path may then run it on one candidate at a time.
    """

    PER_REQUEST: ClassVar[bool]

    def filter(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """The subset of ``candidates`` that passes."""
        ...


class Scorer(Plugin, Protocol):
    """Rates each candidate in [0, 1]; higher is better. The profile weights and sums the scores."""

    def score(self, ctx: ProfileContext, candidates: Sequence[InstanceView]) -> Sequence[float]:
        """One score per candidate, in the candidates' order, each in [0, 1]."""
        ...


# A scorer's score of one candidate from what a profile's pass reads of the candidate once: its
# metrics, the gateway's in-flight count on it, the prompt tokens its cache holds (0 when none), the
# request's prompt length (0 when not positive) and that length's inverse (0.0 for 0).
Term = Callable[[MetricsSnapshot, int, int, int, float], float]


class TermScorer(Scorer, Protocol):
    """A scorer whose score of a candidate depends only on what a ``Term`` reads.

    ``term()`` is the one definition of its score: its ``score`` is the term of each candidate
    (``fused.column``), and a profile whose weighted scorers all have one adds their terms up in one
    pass over the candidates (``fused.fused_totals``), computing the columns only when an explanation
    is rendered (from the request and the in-flight counts alone).
    """

    def term(self) -> Term:
        """The score of one candidate, for this scorer's parameters."""
        ...


class Picker(Plugin, Protocol):
    """Chooses one candidate from the weighted totals."""

    def pick(self, ctx: ProfileContext, totals: Sequence[float]) -> int:
        """The index of the chosen candidate; ``totals`` is non-empty."""
        ...


@dataclass(frozen=True, slots=True)
class ModeChoice:
    """The decider's answer and why."""

    mode: Mode
    reason: str
    kv_source: str | None = None  # see ``Decision.kv_source``


class Decider(Plugin, Protocol):
    """Chooses disaggregated or colocated once the decode instance is known.

    A decider may also have ``shortcut(ctx, decode) -> ModeChoice | None``, asked before the prefill
    profile runs for a request some agent's KV pool holds (``request.pooled_tokens``): a choice there
    is final and the prefill profile is not run (the kv-pool-decider: straight to decode).
    """

    def choose(self, ctx: ProfileContext, decode: InstanceView, prefill_ready: bool) -> ModeChoice:
        """``prefill_ready``: at least one compatible prefill instance passed the prefill filters."""
        ...


class Ranked(Protocol):
    """A profile's ranking: its candidates, their weighted totals, and the picker's pick (-1: none)."""

    @property
    def candidates(self) -> Sequence[InstanceView]: ...
    @property
    def totals(self) -> Sequence[float]: ...
    @property
    def picked(self) -> int: ...


# One (P, D) pair a pairing weighed: prefill id, decode id, predicted TTFT, and the KV transfer's
# part of it. A plain tuple: up to 16 are built per decision, and rendered only when asked.
PairRow = tuple[str, str, float, float]


@dataclass(frozen=True, slots=True)
class PairChoice:
    """A pairing's answer: the pair, its predicted KV transfer time, and every pair it weighed."""

    prefill: InstanceView
    decode: InstanceView
    transfer_s: float
    pairs: Sequence[PairRow]
    picked: int  # index into ``pairs``

    def to_json(self) -> list[dict[str, object]]:
        """The pairs as an explanation lists them."""
        return [
            {
                "prefill": p,
                "decode": d,
                "ttft_s": round(ttft, 6),
                "transfer_s": round(t, 6),
                "picked": i == self.picked,
            }
            for i, (p, d, ttft, t) in enumerate(self.pairs)
        ]


class Pairing(Plugin, Protocol):
    """Chooses P and D together once both profiles ran (disaggregated requests only).

    ``decode`` and ``prefill`` are the profiles' rankings, the prefill one made for ``ctx.partner``
    (the decode profile's pick); ``filters`` are what a P must pass to be paired with another D. None
    when it has nothing to go by: the profiles' picks stand, and the explanation shows no pairs.
    """

    def pair(
        self, ctx: ProfileContext, decode: Ranked, prefill: Ranked, filters: Sequence[Filter]
    ) -> PairChoice | None:
        """The pair to use (the profiles' own when no other is better enough), or None."""
        ...


AnyPlugin = Filter | Scorer | Picker | Decider | Pairing


@dataclass(frozen=True, slots=True)
class PluginSpec:
    """How the config builds a plugin of one type: its parameters class and a factory.

    ``params`` is a frozen dataclass whose ``__post_init__`` raises ``ValueError`` with a reason on a
    bad value; every field has a default. The YAML config names parameters in camelCase
    (``ceiling``, ``maxQueue``), mapped to the snake_case fields.
    """

    type: str
    params: builtins.type[Any]
    factory: Callable[[str, Any], AnyPlugin]  # (instance name, params) -> plugin
    kind: Literal["filter", "scorer", "picker", "decider", "pairing"]
