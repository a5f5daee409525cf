"""The change log a ranking follows: what changed between two snapshots' marks, or that it cannot say."""

from __future__ import annotations

from vllm_disagg.orchestrator.state.changes import LOG_LIMIT, ChangeLog


def test_a_mark_gives_the_instances_changed_since_an_earlier_one() -> None:
    log = ChangeLog()
    log.note("a")
    first = log.mark()
    log.note("b")
    log.note_all(["c", "b"])
    second = log.mark()
    assert first.since(0) == ["a"]
    assert second.since(first.end) == ["b", "c", "b"]
    assert second.since(second.end) == []


def test_a_mark_is_not_moved_by_changes_noted_after_it() -> None:
    log = ChangeLog()
    log.note("a")
    mark = log.mark()
    log.note("b")
    assert mark.since(0) == ["a"]


def test_a_reader_ahead_of_a_mark_is_told_it_cannot_follow() -> None:
    log = ChangeLog()
    old = log.mark()
    log.note("a")
    new = log.mark()
    assert old.since(new.end) is None


def test_after_a_restart_no_mark_reaches_back_before_it() -> None:
    log = ChangeLog()
    log.note("a")
    before = log.mark()
    log.restart()
    log.note("b")
    after = log.mark()
    assert after.since(before.end) is None
    assert after.since(after.base) == ["b"]


def test_past_its_limit_the_log_starts_over_and_a_reader_from_before_is_told_to_rebuild() -> None:
    log = ChangeLog()
    log.note("a")
    early = log.mark()
    log.note_all(f"i{n}" for n in range(LOG_LIMIT))
    full = log.mark()  # the log held more than its limit: this mark starts a new list
    log.note("x")
    later = log.mark()
    assert later.since(early.end) is None
    assert later.since(full.end) == ["x"]
    assert early.since(0) == ["a"]  # a mark given before keeps its list
