"""Learning what each P→D link delivers from decode engines' KV counters (``link_rates``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_disagg.orchestrator.state.health import CLOSED
from vllm_disagg.orchestrator.state.link_rates import (
    FORGET_S,
    FRESH_S,
    PENDING_S,
    LinkRates,
    gbps,
    link_tier,
    links_json,
    tier_of_labels,
)
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.protocol.messages import InstanceInfo, KvLinkCount, MetricsSnapshot, Role

GB = 1e9


def view(
    agent_id: str, role: Role = "prefill", pool: str = "", labels: dict[str, str] | None = None
) -> InstanceView:
    info = InstanceInfo(
        url="http://127.0.0.1:9", role=role, model="m", kv_pool_endpoint=pool, labels=labels or {}
    )
    return InstanceView(
        agent_id, info, "ready", 1, "ready", False, False, 0.0, 0.0, 1, MetricsSnapshot(), "", breaker=CLOSED
    )


VIEWS = {
    "p0": view("p0", pool="tcp://p0:1", labels={"node": "n1", "zone": "z"}),
    "p1": view("p1", pool="tcp://p1:1", labels={"node": "n2", "zone": "z"}),
    "d0": view("d0", "decode", labels={"node": "n1", "zone": "z"}),
}


def nixl(nbytes: float, seconds: float) -> MetricsSnapshot:
    return MetricsSnapshot(kv_in_bytes=nbytes, kv_in_seconds=seconds)


def pooled(*links: tuple[str, float, float]) -> MetricsSnapshot:
    return MetricsSnapshot(kv_in_links=[KvLinkCount(s, int(b), t, 1) for s, b, t in links])


def rates(**kw: float) -> LinkRates:
    r = LinkRates(lambda: VIEWS, **kw)
    r.metrics("d0", nixl(0.0, 0.0), 0.0)  # the baseline
    return r


class Nixl:
    """D's lifetime NIXL counters, grown one transfer at a time."""

    def __init__(self, r: LinkRates) -> None:
        self.r, self.nbytes, self.seconds = r, 0.0, 0.0

    def pull(self, sends: list[tuple[str, int]], nbytes: float, seconds: float, now: float) -> None:
        for p, tokens in sends:
            self.r.kv_sent(p, "d0", "m", tokens, now)
        self.nbytes += nbytes
        self.seconds += seconds
        self.r.metrics("d0", nixl(self.nbytes, self.seconds), now)


def s_per_byte(r: LinkRates, p: str = "p0") -> float:
    return r.table().links[(p, "d0")].s_per_byte


@pytest.mark.parametrize(
    ("p", "d", "tier"),
    [
        ({"domain": "nv1", "node": "a"}, {"domain": "nv1", "node": "b"}, "domain"),
        ({"domain": "", "node": "a"}, {"domain": "", "node": "a"}, "node"),
        ({"node": "a", "zone": "z"}, {"node": "b", "zone": "z"}, "zone"),
        ({"node": "a", "zone": "z1"}, {"node": "b", "zone": "z2"}, "other"),
        ({}, {}, "other"),
    ],
    ids=["same-domain", "empty-domain-same-node", "same-zone", "nothing-shared", "no-labels-is-not-close"],
)
def test_a_links_tier_is_the_closest_label_both_share(
    p: dict[str, str], d: dict[str, str], tier: str
) -> None:
    assert tier_of_labels(p, d) == tier
    assert link_tier(view("p", labels=p), view("d", "decode", labels=d)) == tier


def test_one_pending_send_gets_the_whole_increase_and_gives_bytes_per_token() -> None:
    r = rates()
    Nixl(r).pull([("p0", 1000)], 2 * GB, 0.2, 1.0)
    t = r.table()
    assert s_per_byte(r) == pytest.approx(1e-10)
    assert t.links[("p0", "d0")].samples == 1
    assert t.bytes_per_token == {"m": pytest.approx(2e6)}
    assert t.typical["node"] == pytest.approx(1e-10) and t.typical["any"] == pytest.approx(1e-10)
    assert t.transfer_s("p0", "d0", "node", "m", 500) == pytest.approx(0.1)


def test_an_increase_is_for_as_many_of_the_oldest_sends_as_transfers_finished() -> None:
    """Two pulls sent, one finished by the heartbeat: its bytes are that one send's, not the two's (the
    byte count per token would read half, and the link twice as fast); the other waits for its own."""
    r = rates()
    r.metrics("d0", MetricsSnapshot(kv_in_bytes=0.0, kv_in_seconds=0.0, kv_in_transfers=0), 0.5)
    r.kv_sent("p0", "d0", "m", 1000, 1.0)
    r.kv_sent("p1", "d0", "m", 1000, 1.1)
    r.metrics("d0", MetricsSnapshot(kv_in_bytes=2 * GB, kv_in_seconds=0.2, kv_in_transfers=1), 1.5)
    t = r.table()
    assert t.bytes_per_token == {"m": pytest.approx(2e6)}
    assert set(t.links) == {("p0", "d0")} and s_per_byte(r) == pytest.approx(1e-10)
    r.metrics("d0", MetricsSnapshot(kv_in_bytes=4 * GB, kv_in_seconds=1.2, kv_in_transfers=2), 2.0)
    assert s_per_byte(r, "p1") == pytest.approx(5e-10), "the second pull, once finished, is p1's own"
    assert r.table().bytes_per_token == {"m": pytest.approx(2e6)}


def test_several_pending_links_share_the_bytes_by_tokens_and_converge_on_their_own_rates() -> None:
    r = rates()
    counters = Nixl(r)
    for n in range(1, 40):  # p0 moves at 1e-10 s/B, p1 at 1e-9; each heartbeat carries one of each
        counters.pull([("p0", 100), ("p1", 300)], 4 * GB, 0.1 + 3 * 1.0, float(n))
        counters.pull([("p0", 300), ("p1", 100)], 4 * GB, 0.3 + 1.0, n + 0.5)
    assert s_per_byte(r, "p0") == pytest.approx(1e-10, rel=0.1)
    assert s_per_byte(r, "p1") == pytest.approx(1e-9, rel=0.1)


def test_a_slowed_link_reads_slow_within_two_samples() -> None:
    r = rates()
    counters = Nixl(r)
    for n in range(5):
        counters.pull([("p0", 1000)], GB, 0.1, 1.0 + n)
    fast = s_per_byte(r)
    counters.pull([("p0", 1000)], GB, 1.0, 6.0)  # ten times slower
    assert s_per_byte(r) >= 5 * fast, "one sample: over half way"
    counters.pull([("p0", 1000)], GB, 1.0, 7.0)
    assert s_per_byte(r) >= 7 * fast, "two samples: most of the way"


def test_a_stale_estimate_is_replaced_by_the_next_sample_not_blended() -> None:
    r = rates(forget_s=10 * FRESH_S)
    counters = Nixl(r)
    counters.pull([("p0", 1000)], GB, 1.0, 1.0)
    counters.pull([("p0", 1000)], GB, 0.1, 2.0 + FRESH_S)  # the link recovered while routed around
    assert s_per_byte(r) == pytest.approx(1e-10)
    assert r.table().links[("p0", "d0")].samples == 1


def test_a_fresh_estimate_is_blended() -> None:
    r = rates()
    counters = Nixl(r)
    counters.pull([("p0", 1000)], GB, 1.0, 1.0)
    counters.pull([("p0", 1000)], GB, 0.1, 2.0)
    assert 1e-10 < s_per_byte(r) < 1e-9
    assert r.table().links[("p0", "d0")].samples == 2


def test_a_link_unmeasured_for_forget_s_is_dropped_and_priced_at_its_tier_again() -> None:
    r = rates()
    Nixl(r).pull([("p0", 1000)], GB, 1.0, 1.0)
    assert ("p0", "d0") in r.expire(1.0 + FORGET_S).links
    t = r.expire(1.0 + FORGET_S + 0.1)
    assert ("p0", "d0") not in t.links
    assert t.transfer_s("p0", "d0", "node", "m", 1000) == pytest.approx(1.0), "the tier's typical rate"


def test_a_counter_going_back_resets_the_baseline_without_a_sample() -> None:
    r = rates()
    r.kv_sent("p0", "d0", "m", 1000, 1.0)
    r.metrics("d0", nixl(5 * GB, 50.0), 1.0)
    learned = s_per_byte(r)
    r.kv_sent("p0", "d0", "m", 1000, 2.0)
    t = r.metrics("d0", nixl(GB, 0.1), 2.0)  # the engine restarted
    assert t.links[("p0", "d0")].s_per_byte == learned and t.links[("p0", "d0")].samples == 1
    r.kv_sent("p0", "d0", "m", 1000, 3.0)
    r.metrics("d0", nixl(2 * GB, 0.2), 3.0)  # from the new baseline
    assert s_per_byte(r) < learned


def test_bytes_with_no_pending_send_teach_nothing_and_old_sends_are_dropped() -> None:
    r = rates()
    r.metrics("d0", nixl(GB, 0.1), 1.0)
    assert not r.table().links
    r.kv_sent("p0", "d0", "m", 1000, 2.0)
    r.metrics("d0", nixl(GB, 0.1), 2.0 + PENDING_S + 1)  # nothing moved; the send is too old after
    r.metrics("d0", nixl(2 * GB, 0.2), 2.0 + PENDING_S + 2)
    assert not r.table().links


def test_a_pool_links_counters_name_their_source() -> None:
    r = LinkRates(lambda: VIEWS)
    r.metrics("d0", pooled(("tcp://p0:1", 0, 0.0), ("tcp://p1:1", 0, 0.0)), 0.0)
    r.kv_sent("p1", "d0", "m", 100, 1.0)
    t = r.metrics(
        "d0", pooled(("tcp://p0:1", GB, 0.1), ("tcp://p1:1", GB, 1.0), ("tcp://nobody:1", GB, 9.0)), 1.0
    )
    assert set(t.links) == {("p0", "d0"), ("p1", "d0")}
    assert t.links[("p0", "d0")].s_per_byte == pytest.approx(1e-10)
    assert t.links[("p1", "d0")].s_per_byte == pytest.approx(1e-9)
    assert t.bytes_per_token == {"m": pytest.approx(1e7)}, "from p1's pending send only"


def test_forgetting_an_instance_drops_its_links_and_the_table_is_rebuilt_only_on_change() -> None:
    r = rates()
    Nixl(r).pull([("p0", 1000)], GB, 0.1, 1.0)
    t = r.table()
    assert r.table() is t and r.expire(2.0) is t
    assert r.forget("p1") is t
    assert not r.forget("p0").links


def test_links_json_lists_rates_tiers_and_ages() -> None:
    r = rates()
    Nixl(r).pull([("p0", 1000)], GB, 0.1, 1.0)
    body = links_json(r.table(), VIEWS, 3.0)
    assert body["links"] == [
        {
            "prefill": "p0",
            "decode": "d0",
            "gbps": pytest.approx(80.0),
            "s_per_byte": pytest.approx(1e-10),
            "samples": 1,
            "age_s": 2.0,
            "tier": "node",
        }
    ]
    assert body["typical"]["node"]["gbps"] == pytest.approx(80.0)
    assert body["bytes_per_token"] == {"m": pytest.approx(1e6)}


@given(
    rate=st.floats(1e-12, 1e-8),
    sizes=st.lists(st.floats(1e6, 1e11), min_size=1, max_size=8),
)
def test_a_link_moving_at_a_steady_rate_is_learned_exactly(rate: float, sizes: list[float]) -> None:
    r = rates()
    counters = Nixl(r)
    for n, size in enumerate(sizes):
        counters.pull([("p0", 100)], size, size * rate, 1.0 + n)
    assert s_per_byte(r) == pytest.approx(rate, rel=1e-6)
    assert gbps(s_per_byte(r)) == pytest.approx(8 / rate / 1e9, rel=1e-6)


@given(
    before=st.floats(1e-11, 1e-8),
    after=st.floats(1e-11, 1e-8),
)
def test_after_two_samples_an_estimate_is_at_least_three_quarters_of_the_way(
    before: float, after: float
) -> None:
    r = rates()
    counters = Nixl(r)
    counters.pull([("p0", 100)], GB, GB * before, 1.0)
    counters.pull([("p0", 100)], GB, GB * after, 2.0)
    counters.pull([("p0", 100)], GB, GB * after, 3.0)
    assert abs(s_per_byte(r) - after) <= 0.25 * abs(before - after) + 1e-9 * after
