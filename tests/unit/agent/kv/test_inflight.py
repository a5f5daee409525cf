"""What the connector's worker has in flight, and what vLLM is told when: asynchronous loads settle
once their blocks land, fail or are late, and are reported once their copies are done; saves commit
in step order once copied, and a finished request's KV blocks go once no save reads them."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_disagg.agent.kv.arena import FAILED
from vllm_disagg.agent.kv.inflight import FINISHED, InFlightSave, Receive, Receiving, Saving

LAYERS = 4


@dataclass
class Copy:
    """A device copy the test completes by hand."""

    complete: bool = False

    def query(self) -> bool:
        return self.complete


def receiving(*receives: Receive) -> Receiving:
    r = Receiving()
    for receive in receives:
        r.add(receive)
    return r


def test_a_receive_settles_when_every_block_landed_and_loads_them_all() -> None:
    landed = {10: LAYERS, 11: 2}
    r = receiving(Receive("a", (10, 11), (5, 6), deadline=100.0))
    assert r.decide(landed.__getitem__, LAYERS, now=1.0) == []  # 11 is still landing: vLLM waits
    landed[11] = LAYERS
    (settled,) = r.decide(landed.__getitem__, LAYERS, now=2.0)
    assert settled.loaded == 2 and settled.failed_blocks == () and not settled.late
    assert r.decide(landed.__getitem__, LAYERS, now=3.0) == []  # once


def test_a_failed_block_settles_the_receive_at_once_with_the_blocks_before_it() -> None:
    landed = {10: LAYERS, 11: FAILED, 12: 0}
    r = receiving(Receive("a", (10, 11, 12), (5, 6, 7), deadline=100.0))
    (settled,) = r.decide(landed.__getitem__, LAYERS, now=1.0)
    assert settled.loaded == 1 and settled.failed_blocks == (6, 7) and not settled.late


def test_blocks_not_landed_by_the_deadline_are_given_up_on() -> None:
    landed = {10: 1}
    r = receiving(Receive("a", (10,), (5,), deadline=10.0))
    assert r.decide(landed.__getitem__, LAYERS, now=9.9) == []
    (settled,) = r.decide(landed.__getitem__, LAYERS, now=10.0)
    assert settled.loaded == 0 and settled.failed_blocks == (5,) and settled.late


def test_a_receive_is_reported_once_and_only_when_its_copy_is_done() -> None:
    r, copy = Receiving(), Copy()
    r.copying("a", copy)
    r.copying("b", FINISHED)
    assert r.finished() == {"b"} and len(r) == 1
    assert r.finished() == set()
    copy.complete = True
    assert r.finished() == {"a"} and len(r) == 0


def test_saves_are_committed_in_step_order_once_copied() -> None:
    first, second = Copy(), Copy(complete=True)
    s = Saving()
    s.add(InFlightSave("e:1", (1,), (b"k1",), frozenset({"a"}), first))
    s.add(InFlightSave("e:2", (2,), (b"k2",), frozenset({"b"}), second))
    assert s.done() == []  # the second is copied, but the first is not: nothing yet
    first.complete = True
    assert [save.owner for save in s.done()] == ["e:1", "e:2"]


def test_a_finished_request_s_blocks_go_once_no_save_reads_them() -> None:
    copy = Copy()
    s = Saving()
    s.add(InFlightSave("e:1", (1, 2), (b"k1", b"k2"), frozenset({"a", "b"}), copy))
    s.finishing(["a"])
    assert s.finished() == set()  # its save still reads its blocks
    s.finishing(["b"])
    copy.complete = True
    assert [save.owner for save in s.done()] == ["e:1"]
    assert s.finished() == {"a", "b"}
    assert s.finished() == set()  # once each


def test_only_requests_vllm_was_told_to_wait_for_are_reported() -> None:
    s = Saving()
    s.add(InFlightSave("e:1", (1,), (b"k1",), frozenset({"a"}), FINISHED))
    s.done()
    assert s.finished() == set()  # "a" finished with nothing delayed: not named, not reported
