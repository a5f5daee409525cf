"""What the planner judges the pools by: the gateway's measurements over a window, and the registry.

The gateway records, per finished request (``SloWindow``): the **TTFT** of a disaggregated request,
attributed to the prefill pool (a stream's first token; a whole answer's end of its prefill leg, the
part of its TTFT the prefill pool decides), and the **TPOT** of a stream, attributed to the decode
pool. With gateway workers the orchestrator's process sees its own share of the requests, a sample
the kernel spreads evenly. Engines' queues and KV usage come from the registry's latest heartbeats.

Admission (docs/admission.md) holds requests in the gateway for the stage that binds: the window keeps
how many wait for each stage (``held``), so that a pool admission waits on is short even while the
requests it does serve meet their targets; and a request held back for its decode stage gives the
prefill pool its TTFT less that wait (the gateway subtracts it: the prefill pool did not cause it).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from vllm_disagg.orchestrator.planner.decide import PoolName, PoolSignals
from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot

_MAX_SAMPLES = 50_000  # per kind: a window of a busy minute; older ones go first


class SloWindow:
    """Timed samples of TTFT and TPOT over the last ``window_s`` (clock injected)."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: dict[PoolName, deque[tuple[float, float]]] = {
            "prefill": deque(maxlen=_MAX_SAMPLES),
            "decode": deque(maxlen=_MAX_SAMPLES),
        }
        self.held: dict[PoolName, int] = {"prefill": 0, "decode": 0}

    def admission_held(self, prefill: int, decode: int) -> None:
        """Requests the admission queue holds back now, by the stage that binds (set at each drain)."""
        self.held = {"prefill": prefill, "decode": decode}

    def ttft(self, seconds: float) -> None:
        """A disaggregated request's TTFT (the prefill pool's figure)."""
        self._add("prefill", seconds)

    def tpot(self, seconds: float) -> None:
        """A stream's time per output token (the decode pool's figure)."""
        self._add("decode", seconds)

    def _add(self, pool: PoolName, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._samples[pool].append((self._clock(), seconds))

    def p90(self, pool: PoolName) -> tuple[float | None, int]:
        """The pool's p90 over the window and how many requests it is of (None, 0 without any)."""
        samples = self._samples[pool]
        cutoff = self._clock() - self.window_s
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        if not samples:
            return None, 0
        values = sorted(v for _, v in samples)
        return values[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)], len(values)


def movable(view: InstanceView) -> bool:
    """May the planner move this instance? Ready, one role, not drained, cordoned or pinned."""
    return (
        view.state == "ready"
        and view.info.role in ("prefill", "decode")
        and not view.role_pinned
        and not view.admin_cordoned
    )


def pool_signals(snapshot: RegistrySnapshot, window: SloWindow) -> tuple[PoolSignals, PoolSignals]:
    """Both pools' signals: ready single-role instances by role ("both" serves either and stays put)."""
    pools: dict[PoolName, list[InstanceView]] = {"prefill": [], "decode": []}
    for view in snapshot.instances:
        if view.state == "ready" and view.info.role in pools:
            pools[view.info.role].append(view)
    out = []
    for name in ("prefill", "decode"):
        views = pools[name]
        n = len(views)
        p90, samples = window.p90(name)
        busy = sorted(
            (v for v in views if movable(v)),
            key=lambda v: (
                snapshot.in_flight_of(v.agent_id) + v.metrics.num_running + v.metrics.num_waiting,
                v.agent_id,
            ),
        )
        out.append(
            PoolSignals(
                size=n,
                p90_s=p90,
                samples=samples,
                queue=sum(v.metrics.num_waiting for v in views) / n if n else 0.0,
                kv_usage=sum(v.metrics.kv_cache_usage for v in views) / n if n else 0.0,
                movable=tuple(v.agent_id for v in busy),
                held=window.held[name],
                kv_pool_hit_rate=_mean([v.metrics.kv_pool_hit_rate for v in views]),
            )
        )
    return out[0], out[1]


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values given (None: none is)."""
    given = [v for v in values if v is not None]
    return sum(given) / len(given) if given else None
