"""The planner's decision, pure: each pool's figures and what the planner remembers in, at most one
shift out, with its reason, the figures behind it, and the P:D split it would choose for this load.

A pool's **pressure** is its p90 over its target: the prefill pool's TTFT, the decode pool's TPOT
(``signals``). A pool is **short** when its pressure is over ``overload`` and over the other pool's
by more than ``margin``. An instance moves from the other pool to the short one only when the same
pool was short at ``sustain`` looks in a row (a pool whose pressure fell by more than ``margin`` since
the last look is recovering: its streak waits), no shift happened in the last ``cooldown_s``, the
giving pool keeps its minimum, one of its instances may move (ready, single-role, not drained or
pinned by an operator: ``PoolSignals.movable``, least busy first), and the move helps: the split that
evens the pools' work per instance (``suggest_ratio``) has more instances in the short pool than now,
and the giver's KV cache does not fill on one instance fewer (its mean usage, projected, stays within
``kv_usage_ceiling``). Without these a pool just over its target would take instances until the giver
was over its own target, or out of KV blocks and turning requests away (two pools missing instead of
one), and then want one back. Noise around the line therefore moves nothing, and a step change
moves one instance, then waits to see its effect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_disagg.orchestrator.planner.config import PlannerConfig

PoolName = Literal["prefill", "decode"]
Figures = dict[str, float | int | None]


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool over the window."""

    size: int  # ready instances serving the role
    p90_s: float | None  # prefill: TTFT p90; decode: TPOT p90; None: no request measured
    samples: int  # requests behind ``p90_s``
    queue: float = 0.0  # engines' waiting requests per instance
    kv_usage: float = 0.0  # engines' mean KV cache usage
    movable: tuple[str, ...] = ()  # instances that may leave the pool, least busy first
    held: int = 0  # requests the gateway's admission queue holds back for this pool's stage
    # Mean share of their engines' asks the instances' KV pools held (the project's connector), over
    # those that report one; None: none does. Shown, not weighed: a hit shortens TTFT, which is.
    kv_pool_hit_rate: float | None = None


@dataclass(frozen=True, slots=True)
class Memory:
    """What the planner carries from one look to the next."""

    short: PoolName | None = None  # the pool found short at the last look
    streak: int = 0  # looks in a row it was
    last_shift_at: float | None = None  # the planner's or an operator's last role change
    pressures: tuple[float | None, float | None] = (None, None)  # (prefill, decode) at the last look


def memory_record(memory: Memory, monotonic: float, wall: float) -> dict[str, Any]:
    """``memory`` as etcd keeps it: its last shift in wall time (another host's monotonic clock reads
    this one's differently)."""
    last = None if memory.last_shift_at is None else wall - (monotonic - memory.last_shift_at)
    return {
        "short": memory.short,
        "streak": memory.streak,
        "last_shift_wall": last,
        "pressures": list(memory.pressures),
    }


def memory_from_record(data: Any, monotonic: float, wall: float) -> Memory:
    """``memory_record``'s shape back, on this host's clocks; ``ValueError`` naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"a planner memory is a map, got {data!r:.100}")
    short, streak, last = data.get("short"), data.get("streak"), data.get("last_shift_wall")
    pressures = data.get("pressures")
    if short not in (None, "prefill", "decode") or not isinstance(streak, int) or streak < 0:
        raise ValueError(f"short {short!r}, streak {streak!r}")
    if not (isinstance(pressures, list) and len(pressures) == 2):
        raise ValueError(f"pressures {pressures!r}")
    p = tuple(None if x is None else float(x) for x in pressures)
    at = None if last is None else monotonic - (wall - float(last))
    return Memory(short, streak, at, (p[0], p[1]))


@dataclass(frozen=True, slots=True)
class Shift:
    """Move ``agent_id`` from one pool to the other."""

    agent_id: str
    from_role: PoolName
    to_role: PoolName


@dataclass(frozen=True, slots=True)
class Plan:
    """One look's outcome."""

    shift: Shift | None
    reason: str
    figures: Figures
    ratio: tuple[int, int]  # the (prefill, decode) split the planner would choose for this load
    memory: Memory = field(default_factory=Memory)


def remember_change(memory: Memory, last_change_at: float | None) -> Memory:
    """``memory`` with a role change made elsewhere (an operator's) as the last shift, if it is later
    than the last one the planner knows: the cooldown counts from it."""
    if last_change_at is None or (
        memory.last_shift_at is not None and last_change_at <= memory.last_shift_at
    ):
        return memory
    return Memory(memory.short, memory.streak, last_change_at, memory.pressures)


def pressure(pool: PoolSignals, target_s: float, min_samples: int) -> float | None:
    """The pool's p90 over its target; None with fewer than ``min_samples`` requests measured. A pool
    the admission queue holds requests back for is over its target whatever its p90 (admission keeps
    the p90 of what it serves in check): by one, plus the requests held per instance."""
    if pool.p90_s is None or pool.samples < max(1, min_samples):
        return None
    measured = pool.p90_s / target_s
    if pool.held:
        return max(measured, 1.0 + pool.held / max(pool.size, 1))
    return measured


def suggest_ratio(
    sizes: tuple[int, int], pressures: tuple[float | None, float | None], config: PlannerConfig
) -> tuple[int, int]:
    """The split of the same instances that evens the pools' pressures, if pressure goes as load per
    instance: the work of a pool is its pressure times its size; the split that minimises the larger
    work per instance, within the minimums. The current split while a pressure is unknown."""
    p, d = sizes
    pp, pd = pressures
    total = p + d
    if pp is None or pd is None or total < config.min_prefill + config.min_decode:
        return sizes
    work_p, work_d = pp * max(p, 1), pd * max(d, 1)
    best, best_load = sizes, max(work_p / max(p, 1), work_d / max(d, 1))
    for n in range(config.min_prefill, total - config.min_decode + 1):
        if n == 0 or n == total:
            continue
        load = max(work_p / n, work_d / (total - n))
        if load < best_load - 1e-9:
            best, best_load = (n, total - n), load
    return best


def plan(
    prefill: PoolSignals, decode: PoolSignals, memory: Memory, config: PlannerConfig, now: float
) -> Plan:
    """At most one shift, and why (see the module's docstring): the pools' pressures, which pool is
    short, whether it has been for long enough, and whether a move may and would help, in that order."""
    pp = pressure(prefill, config.ttft_target_s, config.min_samples)
    pd = pressure(decode, config.tpot_target_s, config.min_samples)
    figures = _figures(prefill, decode, pp, pd, memory)
    ratio = suggest_ratio((prefill.size, decode.size), (pp, pd), config)
    seen = (pp, pd)

    def hold(reason: str, short: PoolName | None = None, streak: int = 0) -> Plan:
        return Plan(None, reason, figures, ratio, Memory(short, streak, memory.last_shift_at, seen))

    if pp is None or pd is None:
        return hold(_too_few(prefill, decode, pp, pd, config))
    shortage = _shortage(pp, pd, memory, config)
    if shortage is None:
        return hold(f"balanced: prefill at {pp:.2f}x its TTFT target, decode at {pd:.2f}x its TPOT target")
    pool = decode if shortage.giver == "decode" else prefill
    why_not = _why_not(shortage, pool, prefill.size, ratio, memory, config, now)
    if why_not is not None:
        return hold(why_not, shortage.short, shortage.streak)
    shift = Shift(pool.movable[0], shortage.giver, shortage.short)
    reason = (
        f"{shortage.said} at {shortage.streak} looks in a row: {shift.agent_id} moves from "
        f"{shortage.giver} to {shortage.short}"
    )
    return Plan(shift, reason, figures, ratio, Memory(None, 0, now, seen))


def _figures(
    prefill: PoolSignals, decode: PoolSignals, pp: float | None, pd: float | None, memory: Memory
) -> Figures:
    """What the look saw, as the admin API and the ``planner_shift`` event show it."""
    return {
        "prefill_instances": prefill.size,
        "decode_instances": decode.size,
        "ttft_p90_s": prefill.p90_s,
        "tpot_p90_s": decode.p90_s,
        "ttft_samples": prefill.samples,
        "tpot_samples": decode.samples,
        "prefill_pressure": _round(pp),
        "decode_pressure": _round(pd),
        "prefill_pressure_trend": _trend(pp, memory.pressures[0]),
        "decode_pressure_trend": _trend(pd, memory.pressures[1]),
        "prefill_queue": round(prefill.queue, 3),
        "decode_queue": round(decode.queue, 3),
        "prefill_kv_usage": round(prefill.kv_usage, 3),
        "decode_kv_usage": round(decode.kv_usage, 3),
        "prefill_held": prefill.held,
        "decode_held": decode.held,
        "prefill_kv_pool_hit_rate": _round(prefill.kv_pool_hit_rate),
        "decode_kv_pool_hit_rate": _round(decode.kv_pool_hit_rate),
    }


def _too_few(
    prefill: PoolSignals, decode: PoolSignals, pp: float | None, pd: float | None, config: PlannerConfig
) -> str:
    few = [
        f"{name} pool {n} of {config.min_samples}"
        for name, n, v in (("prefill", prefill.samples, pp), ("decode", decode.samples, pd))
        if v is None
    ]
    return "too few requests in the window to judge (" + ", ".join(few) + ")"


@dataclass(frozen=True, slots=True)
class _Shortage:
    """The pool found short at this look, and how long it has been."""

    short: PoolName
    giver: PoolName
    said: str  # the reason's opening: which pool, at what pressure against the other's
    streak: int  # looks in a row it was short, this one counted unless it is recovering
    before: float | None  # its pressure at the last look
    recovering: bool  # its pressure fell by more than ``margin`` since the last look


def _shortage(pp: float, pd: float, memory: Memory, config: PlannerConfig) -> _Shortage | None:
    """The short pool (over ``overload`` and over the other by more than ``margin``), None if neither."""
    short: PoolName
    if pp > config.overload and pp - pd > config.margin:
        short = "prefill"
    elif pd > config.overload and pd - pp > config.margin:
        short = "decode"
    else:
        return None
    giver: PoolName = "decode" if short == "prefill" else "prefill"
    mine, theirs = (pp, pd) if short == "prefill" else (pd, pp)
    what = "TTFT" if short == "prefill" else "TPOT"
    said = (
        f"the {short} pool is short ({what} p90 at {mine:.2f}x its target, the {giver} pool at {theirs:.2f}x)"
    )
    before = memory.pressures[0 if short == "prefill" else 1]
    recovering = before is not None and before - mine > config.margin
    streak = (memory.streak if memory.short == short else 0) + (0 if recovering else 1)
    return _Shortage(short, giver, said, streak, before, recovering)


def _why_not(
    s: _Shortage,
    pool: PoolSignals,
    prefill_size: int,
    ratio: tuple[int, int],
    memory: Memory,
    config: PlannerConfig,
    now: float,
) -> str | None:
    """Why no instance moves from the giving ``pool`` to the short one now; None when one may."""
    said, giver, short = s.said, s.giver, s.short
    if s.recovering:
        return f"{said}, but recovering ({s.before:.2f}x at the last look)"
    if s.streak < config.sustain:
        return f"{said} at {s.streak} of {config.sustain} looks in a row"
    if memory.last_shift_at is not None and now - memory.last_shift_at < config.cooldown_s:
        ago = now - memory.last_shift_at
        return f"{said}, but the last role change was {ago:.0f} s ago (cooldown {config.cooldown_s:g} s)"
    minimum = config.min_decode if giver == "decode" else config.min_prefill
    if pool.size - 1 < minimum:
        return f"{said}, but the {giver} pool is at its minimum of {minimum}"
    if not pool.movable:
        return f"{said}, but no {giver} instance may move (pinned, drained or serving both roles)"
    more_prefill = ratio[0] - prefill_size
    if not (more_prefill > 0 if short == "prefill" else more_prefill < 0):
        # The split that evens the pools' work per instance is this one or on the giver's side: the
        # move would press the giver more than it relieves the short pool (two pools over their
        # targets instead of one), and the next look would want the instance back.
        return (
            f"{said}, but moving one would press the {giver} pool more than it relieves the {short} pool "
            f"(the split that evens their work: {ratio[0]}P{ratio[1]}D)"
        )
    kv_after = _kv_after_giving(pool)
    if kv_after > config.kv_usage_ceiling:
        return (
            f"{said}, but the {giver} pool's KV cache would fill: {pool.kv_usage:.0%} in use now, about "
            f"{kv_after:.0%} on one instance fewer (ceiling {config.kv_usage_ceiling:.0%})"
        )
    return None


def _kv_after_giving(pool: PoolSignals) -> float:
    """The pool's mean KV usage projected onto one instance fewer. Each of the rest takes n / (n - 1)
    times the requests and, at the pressure ``suggest_ratio`` projects (p90 up by the same factor),
    holds each one that much longer: usage grows by the square (2P at 40% -> 1P at 160%, not 80%)."""
    n = pool.size
    return pool.kv_usage * (n / (n - 1)) ** 2 if n > 1 else 0.0


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _trend(now: float | None, before: float | None) -> float | None:
    return None if now is None or before is None else round(now - before, 3)
