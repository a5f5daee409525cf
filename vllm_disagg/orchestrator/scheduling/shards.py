"""Hierarchical choice: a shard first, then the instances within it.

A profile with more eligible instances than ``above`` does not score a window of them at random: it
splits them into shards (instances with the ``key`` label, an NVLink island or a rack, by its value;
the others in groups of ``size``, or all in one shard with ``size`` 0, the default), then

1. **a shard**: the partner's shard when the partner carries the label and the shard exists (the
   prefill profile looks in the chosen D's domain first); else ``fanout`` shards drawn by the
   request's seed, of which the one whose drawn window has the least mean load (running + waiting
   engine requests + the gateway's own in flight) wins: power-of-d choices over shards;
2. **instances**: the winning window (at most ``maxCandidates`` of the shard's instances, from a
   seeded offset), with the prefix holders, go to the filters and scorers as before.

So a decision reads ``fanout`` windows' loads and scores one window, whatever the cluster's size.
The shards hold agent ids and are rebuilt only when membership changes (the profile's memo); the
loads are read from the decision's snapshot, so a decision stays a pure function of its inputs.
What this costs in pick quality beside scoring every instance is measured by ``bench scheduler
--compare`` (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from vllm_disagg.orchestrator.state.views import InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import LABEL_KEY


@dataclass(frozen=True, slots=True)
class ShardConfig:
    """The ``shards:`` section of a scheduler config."""

    key: str = "domain"  # the label that names an instance's shard
    # Unlabeled instances per shard; 0: one shard of them all, and a cluster with no label is not
    # sharded (groups of unlabeled instances measured no better picks than a seeded window, at 10 to
    # 16 µs more per decision: docs/benchmarks.md).
    size: int = 0
    fanout: int = 2  # shards drawn per decision (at most 4)
    above: int = 256  # a profile with at most this many eligible instances is not sharded

    def __post_init__(self) -> None:
        if not LABEL_KEY.fullmatch(self.key):
            raise ValueError(f"key must be a label key such as 'domain', got {self.key!r}")
        if self.size == 1 or self.size < 0:
            raise ValueError(f"size must be 0 or >= 2, got {self.size}")
        if not 1 <= self.fanout <= 4:  # the draws share one random number's 53 bits
            raise ValueError(f"fanout must be 1 to 4, got {self.fanout}")
        if self.above < 0:
            raise ValueError(f"above must be >= 0, got {self.above}")


@dataclass(frozen=True, slots=True)
class Shards:
    """A profile's eligible instances of one model, split: valid while membership holds."""

    groups: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]  # "domain=nvl-3" for a labeled shard, "#12" for a group
    by_label: Mapping[str, int]  # label value -> index into ``groups``


def split(eligible: Sequence[str], by_id: Mapping[str, InstanceView], config: ShardConfig) -> Shards | None:
    """The shards of ``eligible`` (None at or below ``config.above`` instances, or with none labeled
    and ``size`` 0: flat)."""
    if len(eligible) <= config.above:
        return None
    labeled: dict[str, list[str]] = {}
    rest: list[str] = []
    key = config.key
    for agent_id in eligible:
        value = by_id[agent_id].info.labels.get(key)
        if value:
            labeled.setdefault(value, []).append(agent_id)
        else:
            rest.append(agent_id)
    if not labeled and not config.size:
        return None
    groups = [tuple(ids) for ids in labeled.values()]
    names = [f"{key}={value}" for value in labeled]
    size = config.size or max(1, len(rest))
    for start in range(0, len(rest), size):
        names.append(f"#{len(groups)}")
        groups.append(tuple(rest[start : start + size]))
    by_label = MappingProxyType({value: i for i, value in enumerate(labeled)})
    return Shards(tuple(groups), tuple(names), by_label)


def window(group: tuple[str, ...], width: int, draw: float) -> Sequence[str]:
    """At most ``width`` of ``group``'s instances, contiguous (wrapping) from a drawn offset."""
    n = len(group)
    if n <= width:
        return group
    start = int(draw * n)  # draw < 1, so start < n
    picked = group[start : start + width]
    return picked if len(picked) == width else picked + group[: width - len(picked)]


class Loads:
    """Mean loads of shard windows: the engines' part (running + waiting, read from each instance's
    view) kept per snapshot version, so that decisions between two heartbeats do not read the same
    views again; the gateway's in-flight part, which moves with every decision, read each time."""

    __slots__ = ("_engine", "_of")

    def __init__(self) -> None:
        self._of: tuple[int, int] = (0, -1)  # (registry id, snapshot version)
        self._engine: dict[tuple[int, str], int] = {}  # (shard, its window's first id) -> engine load

    def mean(self, shard: int, ids: Sequence[str], snapshot: RegistrySnapshot) -> float:
        """Engine requests running and waiting plus the gateway's in flight, per instance of ``ids``."""
        of = (snapshot.registry_id, snapshot.version)
        if of != self._of:
            self._engine = {}
            self._of = of
        key = (shard, ids[0])
        engine = self._engine.get(key)
        if engine is None:
            by_id = snapshot.by_id
            engine = 0
            for agent_id in ids:
                m = by_id[agent_id].metrics
                engine += m.num_running + m.num_waiting
            self._engine[key] = engine
        flying = snapshot.in_flight.get
        return (engine + sum([flying(agent_id, 0) for agent_id in ids])) / len(ids)


def choose(
    shards: Shards,
    snapshot: RegistrySnapshot,
    partner: InstanceView | None,
    config: ShardConfig,
    width: int,
    random: Callable[[int], float],
    loads: Loads,
) -> tuple[int, Sequence[str]]:
    """The shard to search and the window of it to score (see the module's docstring)."""
    groups = shards.groups
    # One draw per decision, its digits read off in turn (a draw costs a hash: a microsecond).
    draw = random(31)
    if partner is not None:
        value = partner.info.labels.get(config.key)
        home = shards.by_label.get(value) if value else None
        if home is not None:
            return home, window(groups[home], width, draw)
    best, best_load = -1, 0.0
    best_ids: Sequence[str] = ()
    count = len(groups)
    for _ in range(min(config.fanout, count)):
        draw *= count
        i = int(draw)
        draw -= i
        ids = window(groups[i], width, draw)
        draw = draw * len(groups[i]) % 1.0
        load = loads.mean(i, ids, snapshot)
        if best < 0 or load < best_load:
            best, best_ids, best_load = i, ids, load
    return best, best_ids
