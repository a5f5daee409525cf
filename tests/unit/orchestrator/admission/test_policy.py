"""The admission queue's policy (``admission.policy``), table by table: who is admitted in what order,
how tenants share, who is refused and why, the limits, and that no ticket is ever lost."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from vllm_disagg.config import AdmissionConfig
from vllm_disagg.orchestrator.admission.policy import (
    ADMITTED,
    FITS,
    AdmissionQueue,
    Fit,
    Shed,
    Ticket,
    Verdict,
)

FULL = Fit(False, "prefill")  # the pair has no room: whoever is offered waits
DECODE_FULL = Fit(False, "decode")


@dataclass
class Req:
    name: str


def ticket(
    name: str,
    *,
    at: float = 0.0,
    priority: int = 0,
    tenant: str = "a",
    target: float | None = None,
    cost: float = 1.0,
    model: str = "m",
) -> Ticket[Req]:
    return Ticket(
        payload=Req(name),
        model=model,
        priority=priority,
        tenant=tenant,
        arrival=at,
        deadline=at + (target if target is not None else 5.0),
        has_target=target is not None,
        cost=cost,
    )


def queue(**config: object) -> AdmissionQueue[Req]:
    return AdmissionQueue(AdmissionConfig(**config))  # type: ignore[arg-type]


def names(outcomes: list[tuple[Ticket[Req], Verdict]]) -> list[tuple[str, str]]:
    """Each outcome as (request, "admitted" or the refusal's reason)."""
    return [(t.payload.name, v if isinstance(v, str) else v.reason) for t, v in outcomes]


def admit_n(n: int) -> Callable[[Ticket[Req]], Fit]:
    """A check that lets ``n`` requests through, then finds no room."""
    left = [n]

    def check(_: Ticket[Req]) -> Fit:
        left[0] -= 1
        return FITS if left[0] >= 0 else FULL

    return check


def test_an_empty_queue_admits_a_request_that_fits_at_once() -> None:
    q = queue()
    assert names(q.offer(ticket("r1"), FITS, 0.0)) == [("r1", "admitted")]
    assert q.depth() == 0


def test_a_request_whose_pair_is_full_waits_and_is_admitted_when_room_comes() -> None:
    q = queue()
    r1 = ticket("r1")
    assert q.offer(r1, FULL, 0.0) == []
    assert r1.state == "queued" and q.depth("m") == 1
    assert names(q.drain(0.1, lambda _: FULL)) == []
    assert q.blocked("m") == "prefill"
    assert names(q.drain(0.2, lambda _: FITS)) == [("r1", "admitted")]
    assert q.depth() == 0 and q.blocked("m") == ""


def test_a_newcomer_does_not_overtake_those_waiting_even_if_its_pair_fits() -> None:
    q = queue()
    q.offer(ticket("first"), FULL, 0.0)
    assert q.offer(ticket("second", at=0.1), FITS, 0.1) == []  # it queues behind
    assert names(q.drain(0.2, admit_n(2))) == [("first", "admitted"), ("second", "admitted")]


@pytest.mark.parametrize(
    ("offered", "order"),
    [
        # (name, priority, arrival, TTFT target): the admission order when room comes for all.
        ([("late", 0, 0.0, 3.0), ("soon", 0, 0.5, 1.0)], ["soon", "late"]),  # earliest deadline first
        ([("low", 1, 0.0, 1.5), ("high", -1, 1.0, 9.0)], ["high", "low"]),  # priority before deadline
        ([("p0", 0, 0.0, 2.0), ("p1", 1, 0.0, 2.0), ("pm1", -1, 0.0, 2.0)], ["pm1", "p0", "p1"]),
        ([("x", 0, 0.0, 2.0), ("y", 0, 0.0, 2.0)], ["x", "y"]),  # a tie: first come, first served
    ],
)
def test_order_is_priority_first_then_deadline(
    offered: list[tuple[str, int, float, float]], order: list[str]
) -> None:
    q = queue(sheddable_priority=5)
    for name, priority, at, target in offered:
        q.offer(ticket(name, at=at, priority=priority, target=target), FULL, at)
    assert names(q.drain(1.01, lambda _: FITS)) == [(n, "admitted") for n in order]


def test_no_lower_priority_request_is_admitted_while_a_higher_one_waits() -> None:
    """Head of line: when the most important request does not fit, nothing behind it goes, even a
    request whose own pair would fit (no priority inversion)."""
    q = queue(sheddable_priority=5)
    q.offer(ticket("important", priority=-1), FULL, 0.0)
    q.offer(ticket("routine", priority=2), FULL, 0.0)
    seen: list[str] = []

    def check(t: Ticket[Req]) -> Fit:
        seen.append(t.payload.name)
        return FITS if t.payload.name == "routine" else DECODE_FULL

    assert q.drain(0.5, check) == []
    assert seen == ["important"]
    assert q.blocked("m") == "decode"


def test_a_tenant_behind_its_share_goes_before_a_flooding_one() -> None:
    """Tenant b's one request waits behind a's burst of ten in arrival and deadline, but a has been
    served and b has not: b goes next."""
    q = queue()
    for i in range(10):
        q.offer(ticket(f"a{i}", at=i * 0.01, tenant="a"), FULL, i * 0.01)
    q.offer(ticket("b0", at=0.5, tenant="b"), FULL, 0.5)
    first = names(q.drain(1.0, admit_n(1)))
    assert first == [("a0", "admitted")]  # level: earliest deadline
    assert names(q.drain(1.1, admit_n(1))) == [("b0", "admitted")]  # a is ahead of its share now


def test_weights_share_admissions_in_their_ratio() -> None:
    q = queue(tenant_weights=(("gold", 3.0),))
    for i in range(40):
        q.offer(ticket(f"g{i}", at=i * 0.001, tenant="gold"), FULL, 0.0)
        q.offer(ticket(f"s{i}", at=i * 0.001, tenant="silver"), FULL, 0.0)
    admitted = [n for n, _ in names(q.drain(1.0, admit_n(20)))]
    gold = sum(1 for n in admitted if n.startswith("g"))
    assert gold == 15  # 3:1 of 20


def test_an_idle_tenant_banks_no_credit() -> None:
    """b was away while a was served alone; back, it is level with a, not owed a's whole history."""
    q = queue()
    for i in range(50):
        q.offer(ticket(f"a{i}", tenant="a"), FITS, float(i))
    for i in range(4):
        q.offer(ticket(f"a-late{i}", at=60.0, tenant="a"), FULL, 60.0)
        q.offer(ticket(f"b{i}", at=60.0, tenant="b"), FULL, 60.0)
    admitted = [n for n, _ in names(q.drain(61.0, lambda _: FITS))]
    assert admitted[:2] == ["a-late0", "b0"] or admitted[:2] == ["b0", "a-late0"]
    assert [n[0] for n in admitted[2:6]] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


@pytest.mark.parametrize(
    ("fit", "expected"),
    [
        (FULL, [("shed", "sheddable")]),  # saturated: the sheddable class is refused, never queued
        (FITS, [("shed", "admitted")]),  # room: it is served like any other
    ],
)
def test_the_sheddable_class_is_refused_while_its_pair_is_saturated(
    fit: Fit, expected: list[tuple[str, str]]
) -> None:
    q = queue(sheddable_priority=1)
    assert names(q.offer(ticket("shed", priority=1), fit, 0.0)) == expected


def test_the_sheddable_class_never_waits_behind_others() -> None:
    q = queue(sheddable_priority=1)
    q.offer(ticket("normal"), FULL, 0.0)
    # Its own pair fits, but someone already waits: the pair is saturated for the queue.
    assert names(q.offer(ticket("bulk", priority=3), FITS, 0.0)) == [("bulk", "sheddable")]
    assert q.depth("m") == 1


def test_a_full_queue_refuses_the_tenant_over_its_share() -> None:
    q = queue(max_queue=4)
    for i in range(3):
        q.offer(ticket(f"flood{i}", tenant="flood"), FULL, 0.0)
    q.offer(ticket("steady0", tenant="steady"), FULL, 0.0)
    out = q.offer(ticket("steady1", at=0.1, tenant="steady"), FULL, 0.1)
    assert names(out) == [("flood2", "tenant_over_share")]  # its worst-ranked: the latest deadline
    out = q.offer(ticket("flood3", at=0.2, tenant="flood"), FULL, 0.2)
    assert names(out) == [("flood3", "tenant_over_share")]  # flood holds its share: the newcomer goes


def test_a_full_queue_with_one_tenant_refuses_the_worst_ranked() -> None:
    q = queue(max_queue=2, sheddable_priority=9)
    q.offer(ticket("loose", target=9.0), FULL, 0.0)
    q.offer(ticket("tight", target=1.0), FULL, 0.0)
    assert names(q.offer(ticket("urgent", priority=-1), FULL, 0.0)) == [("loose", "queue_full")]
    assert names(q.offer(ticket("routine", target=20.0), FULL, 0.0)) == [("routine", "queue_full")]


def test_a_request_whose_ttft_target_is_out_of_reach_is_refused_at_once() -> None:
    q = queue()
    out = q.offer(ticket("r", target=0.5), Fit(False, "prefill", unreachable=True), 0.0)
    assert len(out) == 1
    verdict = out[0][1]
    assert isinstance(verdict, Shed)
    assert (verdict.reason, verdict.stage) == ("deadline_unreachable", "prefill")
    assert verdict.retry_after_s >= 1


def test_a_waiting_request_is_refused_when_its_deadline_or_the_longest_wait_passes() -> None:
    q = queue(max_wait_s=10.0)
    q.offer(ticket("slo", target=2.0), FULL, 0.0)
    q.offer(ticket("patient"), FULL, 0.0)  # no target: only the longest wait applies
    assert names(q.drain(1.9, lambda _: FULL)) == []
    assert names(q.drain(2.0, lambda _: FULL)) == [("slo", "deadline_unreachable")]
    assert names(q.drain(9.9, lambda _: FULL)) == []
    assert names(q.drain(10.0, lambda _: FULL)) == [("patient", "queue_timeout")]


def test_the_head_is_refused_when_the_check_says_its_target_is_out_of_reach() -> None:
    q = queue()
    q.offer(ticket("doomed", target=1.0), FULL, 0.0)
    q.offer(ticket("fine", target=3.0), FULL, 0.0)

    def check(t: Ticket[Req]) -> Fit:
        return Fit(False, "prefill", unreachable=True) if t.payload.name == "doomed" else FITS

    assert names(q.drain(0.8, check)) == [("doomed", "deadline_unreachable"), ("fine", "admitted")]


def test_retry_after_follows_the_pace_of_admissions() -> None:
    q = queue(ttft_s=3.0)
    assert q.retry_after("m") == 3  # nothing seen yet: the default budget
    for i in range(5):
        q.offer(ticket(f"r{i}"), FULL, 0.0)
    for step in range(1, 4):
        q.drain(2.0 * step, admit_n(1))  # one admission every 2 s
    assert q.retry_after("m") == 6  # two still waiting and one more: 3 x 2 s
    assert 1 <= q.retry_after("other-model") <= 60


def test_models_queue_apart() -> None:
    q = queue()
    q.offer(ticket("m-held", model="m"), FULL, 0.0)
    assert names(q.offer(ticket("n-free", model="n"), FITS, 0.0)) == [("n-free", "admitted")]
    assert q.depth("m") == 1 and q.depth("n") == 0


def test_a_withdrawn_request_leaves_the_queue_and_is_never_admitted() -> None:
    q = queue()
    gone = ticket("gone")
    q.offer(gone, FULL, 0.0)
    q.offer(ticket("stays"), FULL, 0.0)
    q.withdraw(gone)
    assert gone.state == "withdrawn"
    assert names(q.drain(0.1, lambda _: FITS)) == [("stays", "admitted")]
    with pytest.raises(ValueError, match="only a waiting ticket"):
        q.withdraw(gone)


def test_a_ticket_cannot_be_offered_twice() -> None:
    q = queue()
    once = ticket("once")
    q.offer(once, FITS, 0.0)
    with pytest.raises(ValueError, match="offered twice"):
        q.offer(once, FITS, 0.0)


def test_weights_must_be_positive_and_finite() -> None:
    q = queue()
    q.set_weight("t", 2.0)
    assert q.weight("t") == 2.0 and q.weight("unknown") == 1.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number > 0"):
            q.set_weight("t", bad)
    assert ADMITTED == "admitted"
