"""The KV audit: a decode engine's prompt-token counters tell whether it loaded the KV it was handed."""

from __future__ import annotations

import dataclasses

from vllm_disagg.orchestrator.state.health import BreakerPolicy
from vllm_disagg.orchestrator.state.kv_audit import SETTLE_S, DecodeAudit, Outcome, Recomputed
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot

BLOCK = 16
LATER = SETTLE_S + 0.1  # a scrape this long after a leg answered surely includes it


def counters(transferred: int, cached: int = 0, computed: int = 0, age_s: float = 0.0) -> MetricsSnapshot:
    return MetricsSnapshot(
        prompt_tokens_transferred=transferred,
        prompt_tokens_cached=cached,
        prompt_tokens_computed=computed,
        age_s=age_s,
    )


def started(at: float = 0.0, loaded: int = 0) -> DecodeAudit:
    audit = DecodeAudit("d0", BLOCK)
    assert audit.observe(counters(loaded), at) == Outcome()
    assert audit.active
    return audit


def leg(
    audit: DecodeAudit, tokens: int, sent: float, answered: float, request: str = "r", p: str = "p0"
) -> int:
    key = audit.dispatch(request, p, tokens, sent)
    assert key is not None
    audit.answered(key, answered)
    return key


def test_nothing_is_judged_before_the_engine_reports_its_counters() -> None:
    audit = DecodeAudit("d0", BLOCK)
    assert audit.dispatch("r", "p0", 100, 0.0) is None
    assert audit.observe(MetricsSnapshot(prompt_tokens=500), 1.0) == Outcome()  # an engine without them
    assert not audit.active and audit.dispatch("r", "p0", 100, 2.0) is None


def test_a_leg_whose_tokens_were_loaded_is_cleared_and_never_flagged() -> None:
    audit = started(loaded=1000)
    leg(audit, 236, sent=1.0, answered=1.5, request="fine")
    assert audit.observe(counters(1236), 1.6) == Outcome()  # too soon to judge
    first = audit.observe(counters(1236), 1.5 + LATER)
    assert first.recomputed is None
    second = audit.observe(counters(1236), 1.5 + LATER + 0.25)
    assert [h.request_id for h in second.loaded] == ["fine"] and second.recomputed is None


def test_local_cache_hits_count_as_loaded() -> None:
    audit = started()
    leg(audit, 300, sent=1.0, answered=1.2)
    assert audit.observe(counters(transferred=44, cached=256), 1.2 + LATER).recomputed is None


def test_a_leg_whose_prompt_the_engine_computed_is_a_verdict_naming_it() -> None:
    audit = started(loaded=1000)
    leg(audit, 236, sent=1.0, answered=1.5, request="slow", p="p1")
    out = audit.observe(counters(1000, computed=236), 1.5 + LATER)
    assert out.recomputed is not None
    assert (out.recomputed.decode, out.recomputed.tokens) == ("d0", 236)
    assert [h.request_id for h in out.recomputed.legs] == ["slow"] and out.recomputed.prefills == ("p1",)
    assert "computed 236 prompt tokens" in out.recomputed.note()
    # Reported once: the next snapshots say nothing more.
    assert audit.observe(counters(1000, computed=236), 2.0 + LATER) == Outcome()


def test_a_scrape_older_than_the_answer_cannot_condemn_it() -> None:
    audit = started()
    leg(audit, 236, sent=1.0, answered=1.5)
    # Arrives long after the answer, but was scraped before it: the counters could not include it yet.
    stale = counters(0, age_s=LATER + 1.0)
    assert audit.observe(stale, 1.5 + LATER + 0.5) == Outcome()
    assert audit.observe(counters(236), 1.5 + LATER + 1.0).recomputed is None


def test_a_heartbeat_that_waited_in_the_socket_cannot_condemn_a_leg_that_answered_after_its_scrape() -> None:
    # The agent's clock runs 100 s ahead of ours; heartbeats normally take 0.01 s to be handled.
    audit = DecodeAudit("d0", BLOCK)
    skew = 100.0

    def beat(loaded: int, sent_mono: float, handled_mono: float) -> Outcome:
        snap = dataclasses.replace(counters(loaded), sent_at=sent_mono + skew)
        return audit.observe(snap, handled_mono, wall=handled_mono + 0.0)

    assert beat(0, 0.0, 0.01) == Outcome()  # the baseline: 0.01 s is the least delay seen
    leg(audit, 236, sent=1.0, answered=1.5)
    # Scraped at 1.2 (before the answer), sent at 1.2, but the orchestrator was starved until 6.0:
    # with the age alone the scrape would look 4.8 s old and the leg settled, its tokens missing.
    assert beat(0, 1.2, 6.0) == Outcome()
    assert beat(236, 6.1, 6.1 + LATER).recomputed is None, "a timely scrape includes it"


def test_legs_sent_before_the_first_snapshot_are_not_judged() -> None:
    audit = DecodeAudit("d0", BLOCK)
    assert audit.dispatch("before", "p0", 236, 0.5) is None
    assert audit.observe(counters(0), 1.0) == Outcome()  # the baseline
    assert audit.observe(counters(0), 5.0) == Outcome()


def test_a_recompute_hidden_by_a_leg_counted_early_is_found_at_the_next_check_with_both_named() -> None:
    audit = started()
    leg(audit, 200, sent=1.0, answered=1.1, request="recomputed")
    early = audit.dispatch("early", "p0", 200, 1.5)  # counted at its first token, answers later
    assert early is not None
    assert audit.observe(counters(200), 1.1 + LATER).recomputed is None  # 200 handed, 200 counted
    audit.answered(early, 1.6)
    out = audit.observe(counters(200), 1.6 + LATER)
    assert out.recomputed is not None and out.recomputed.tokens == 200
    assert {h.request_id for h in out.recomputed.legs} == {"recomputed", "early"}


def test_other_traffic_running_the_counters_ahead_does_not_hide_a_later_recompute() -> None:
    audit = started()
    # Colocated requests' prefix-cache hits: 5,000 tokens no leg explains.
    assert audit.observe(counters(0, cached=5000), 1.0) == Outcome()
    leg(audit, 300, sent=2.0, answered=2.1)
    out = audit.observe(counters(0, cached=5000, computed=300), 2.1 + LATER)
    assert out.recomputed is not None and out.recomputed.tokens == 300


def test_shortfalls_under_a_block_are_rounding_and_do_not_add_up() -> None:
    audit = started()
    total = 0
    for i in range(40):  # each leg one token short, one check each
        t = 1.0 + i
        leg(audit, 100, sent=t, answered=t + 0.1, request=f"r{i}")
        total += 99
        assert audit.observe(counters(total), t + 0.1 + LATER).recomputed is None, i


def test_an_engine_restart_starts_afresh_and_judges_no_leg_in_doubt() -> None:
    audit = started(loaded=5000)
    key = audit.dispatch("in-doubt", "p0", 300, 1.0)
    assert key is not None
    assert audit.observe(counters(40), 1.5) == Outcome()  # the counters went back
    audit.answered(key, 1.6)
    assert audit.observe(counters(40), 1.6 + LATER) == Outcome()
    leg(audit, 100, sent=3.0, answered=3.1)
    assert audit.observe(counters(40), 3.1 + LATER).recomputed is not None


def test_a_leg_that_failed_is_not_judged_whatever_it_counted() -> None:
    audit = started()
    key = audit.dispatch("failed", "p0", 300, 1.0)
    assert key is not None
    audit.abandon(key)
    assert audit.observe(counters(0), 1.0 + LATER) == Outcome()


# --- the registry: verdicts feed the P→D link breakers ------------------------------------------------


def test_repeated_verdicts_open_the_link_and_loaded_legs_close_it() -> None:
    registry = Registry(100.0, breaker=BreakerPolicy(failures_to_open=3, open_s=1.0))
    verdicts: list[Recomputed] = []
    registry.on_kv_audit = lambda outcome: verdicts.extend([outcome.recomputed] if outcome.recomputed else [])
    info = InstanceInfo(url="http://d", role="decode", model="m", block_size=BLOCK)
    registry.hello("d0", info, 0.0)
    seq = 0

    def beat(now: float, loaded: int) -> None:
        nonlocal seq
        seq += 1
        registry.heartbeat("d0", Heartbeat(seq=seq, engine_state="ready", metrics=counters(loaded)), now)

    beat(0.0, 0)
    now = 1.0
    for i in range(3):
        key = registry.audit_dispatch("d0", f"slow-{i}", "p0", 200, now)
        assert key is not None
        registry.audit_done("d0", key, now + 0.1, answered=True)
        beat(now + 0.1 + LATER, 0)
        now += 5.0
    assert [v.legs[0].request_id for v in verdicts] == ["slow-0", "slow-1", "slow-2"]
    assert ("p0", "d0") in registry.snapshot().blocked_links
    assert registry.get("d0") is not None and registry.get("d0").state == "ready"  # type: ignore[union-attr]
    # After the open period, a probe leg that loads its KV closes the link (two checks later).
    registry.tick(now)
    key = registry.audit_dispatch("d0", "probe", "p0", 200, now)
    assert key is not None
    registry.audit_done("d0", key, now + 0.1, answered=True)
    beat(now + 0.1 + LATER, 200)
    beat(now + 0.1 + LATER + 0.25, 200)
    assert ("p0", "d0") not in registry.snapshot().blocked_links
