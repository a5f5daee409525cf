"""Bounded claims: what one agent's KV events may make the index hold (``state/kv_limits.py``).

Beyond its cap of blocks per medium, or its bucket of stored blocks per second, an agent's further
``stored`` blocks are dropped (the leading ones of an event kept), counted by reason and logged once;
``removed`` and ``cleared`` always apply; other agents' routing is untouched.
"""

from __future__ import annotations

import logging
import pickle

import pytest

from vllm_disagg.clock import FakeClock
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.gateway.workers.hub import JournaledKvIndex
from vllm_disagg.orchestrator.state.kv_index import KvIndex
from vllm_disagg.orchestrator.state.kv_limits import Admitted, Bucket, KvGate, KvLimits, admit, refill
from vllm_disagg.protocol.messages import KvEvent

SIZE = 4


def chain(first: int, blocks: int, medium: str = "gpu", parent: int | None = None) -> KvEvent:
    """``blocks`` stored blocks of distinct tokens, hashes ``first``, ``first + 1``, ..."""
    hashes = list(range(first, first + blocks))
    tokens = [t for h in hashes for t in (h,) * SIZE]
    return KvEvent("stored", hashes, parent, tokens, SIZE, medium=medium)


def prompt_of(event: KvEvent) -> list[int]:
    return list(event.token_ids)


class Drops:
    """A metrics sink: blocks dropped by (agent, medium, reason)."""

    def __init__(self) -> None:
        self.counted: dict[tuple[str, str, str], int] = {}

    def __call__(self, agent_id: str, medium: str, reason: str, blocks: int) -> None:
        key = (agent_id, medium, reason)
        self.counted[key] = self.counted.get(key, 0) + blocks


def gated(limits: KvLimits, clock: FakeClock) -> tuple[KvIndex, Drops]:
    drops = Drops()
    return KvIndex(KvGate(limits, clock.monotonic, drops)), drops


@pytest.mark.parametrize(
    ("medium", "reason_blocks"),
    [("gpu", 10 * 50 - 100), ("pool", 10 * 50 - 100)],
    ids=["engine-prefix-cache", "agent-pool"],
)
def test_a_forged_flood_beyond_the_cap_leaves_the_index_within_bounds_and_is_counted(
    medium: str, reason_blocks: int, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    index, drops = gated(KvLimits(max_blocks=100, rate=1e9, burst=1e9), clock)
    honest = chain(1_000_000, 8, medium)
    assert index.apply("honest", [honest]) == 1
    with caplog.at_level(logging.WARNING):
        for batch in range(10):
            index.apply("forger", [chain(batch * 1000 + k * 100, 10, medium) for k in range(5)])
    blocks_of = index.blocks_of if medium == "gpu" else index.pool_blocks_of
    assert blocks_of("forger") == 100
    assert blocks_of("honest") == 8
    assert drops.counted == {("forger", medium, "over_cap"): reason_blocks}
    assert len([r for r in caplog.records if "forger" in r.getMessage()]) == 1  # once, not per event
    matched = index.cached_tokens if medium == "gpu" else index.pooled_tokens
    assert matched(prompt_of(honest)) == {"honest": 8 * SIZE}  # routing for others unaffected


def test_a_flood_faster_than_the_rate_is_dropped_until_the_bucket_refills() -> None:
    clock = FakeClock()
    index, drops = gated(KvLimits(max_blocks=10_000, rate=10.0, burst=20.0), clock)
    index.apply("a", [chain(0, 15), chain(100, 15)])  # 30 blocks at once: 20 pass
    assert index.blocks_of("a") == 20
    assert drops.counted == {("a", "gpu", "over_rate"): 10}
    index.apply("a", [chain(200, 5)])  # the bucket is empty
    assert index.blocks_of("a") == 20
    clock.advance(0.5)  # 5 blocks' worth
    index.apply("a", [chain(300, 8)])
    assert index.blocks_of("a") == 25
    assert drops.counted == {("a", "gpu", "over_rate"): 10 + 5 + 3}


def test_a_cut_event_keeps_its_leading_blocks_so_the_index_stays_consistent() -> None:
    clock = FakeClock()
    index, _ = gated(KvLimits(max_blocks=3, rate=1e9, burst=1e9), clock)
    event = chain(10, 5)
    index.apply("a", [event])
    assert sorted(index.engine_blocks("a")) == [10, 11, 12]  # the prefix, never a hole in it
    assert index.cached_tokens(prompt_of(event)) == {"a": 3 * SIZE}
    # A block chained to a dropped one is not indexed (its parent is unknown), and a removal of a
    # dropped block changes nothing: no entry is left behind, none is invented.
    index.apply("a", [KvEvent("removed", [14, 13]), chain(20, 2, parent=14)])
    assert sorted(index.engine_blocks("a")) == [10, 11, 12]
    # Removals always apply, so the agent can make room and store again.
    index.apply("a", [KvEvent("removed", [12]), chain(13, 1, parent=11)])
    assert sorted(index.engine_blocks("a")) == [10, 11, 13]
    index.apply("a", [KvEvent("cleared")])
    assert index.blocks_of("a") == 0


@pytest.mark.parametrize(
    ("event", "indexed", "level", "want"),
    [
        (KvEvent("removed", list(range(1000))), 100, 0.0, Admitted(KvEvent("removed", list(range(1000))))),
        (KvEvent("cleared"), 100, 0.0, Admitted(KvEvent("cleared"))),
        (chain(0, 4), 0, 4.0, Admitted(chain(0, 4), 4)),
        (chain(0, 4), 98, 10.0, Admitted(chain(0, 2), 2, 2, "over_cap")),
        (chain(0, 4), 0, 3.5, Admitted(chain(0, 3), 3, 1, "over_rate")),
        (chain(0, 4), 100, 10.0, Admitted(None, 0, 4, "over_cap")),
        (chain(0, 4), 0, 0.9, Admitted(None, 0, 4, "over_rate")),
    ],
    ids=["removals-always", "clears-always", "within", "cut-at-cap", "cut-at-rate", "at-cap", "empty-bucket"],
)
def test_admit_cuts_a_stored_event_to_its_leading_blocks_and_never_drops_a_removal(
    event: KvEvent, indexed: int, level: float, want: Admitted
) -> None:
    assert admit(event, indexed, level, KvLimits(max_blocks=100)) == want


@pytest.mark.parametrize(
    ("bucket", "now", "level"),
    [
        (Bucket(0.0, 10.0), 11.0, 5.0),
        (Bucket(0.0, 10.0), 1000.0, 8.0),  # never above the burst
        (Bucket(3.0, 10.0), 9.0, 3.0),  # a clock that went back refills nothing
    ],
    ids=["refills-at-the-rate", "up-to-the-burst", "not-backwards"],
)
def test_the_bucket_refills_at_the_rate_up_to_the_burst(bucket: Bucket, now: float, level: float) -> None:
    assert refill(bucket, KvLimits(rate=5.0, burst=8.0), now).level == level


def test_a_new_session_logs_again_but_does_not_refill_the_bucket(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    index, drops = gated(KvLimits(max_blocks=1000, rate=1.0, burst=10.0), clock)
    with caplog.at_level(logging.WARNING):
        index.apply("a", [chain(0, 12)])
        index.drop("a")  # it said Hello again
        index.apply("a", [chain(100, 12)])
    assert index.blocks_of("a") == 0
    assert drops.counted == {("a", "gpu", "over_rate"): 2 + 12}
    assert len([r for r in caplog.records if "instance a" in r.getMessage()]) == 2


def test_the_workers_replay_what_was_admitted_not_what_was_sent() -> None:
    clock = FakeClock()
    journaled = JournaledKvIndex(KvGate(KvLimits(max_blocks=3, rate=1e9, burst=1e9), clock.monotonic))
    journaled.apply("a", [chain(10, 5)])
    worker = pickle.loads(pickle.dumps(journaled.plain()))  # what a joining worker gets: no gate
    replica = KvIndex()
    for _, agent_id, events in journaled.journal:
        replica.apply(agent_id, events)
    assert replica.engine_blocks("a") == worker.engine_blocks("a") == journaled.engine_blocks("a")
    assert replica.blocks_of("a") == 3


@pytest.mark.parametrize(
    "limits",
    [{"max_blocks": 0}, {"rate": 0.0}, {"burst": float("inf")}, {"rate": float("nan")}],
    ids=["no-blocks", "no-rate", "infinite-burst", "nan-rate"],
)
def test_limits_validate_themselves(limits: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        KvLimits(**limits)  # type: ignore[arg-type]
