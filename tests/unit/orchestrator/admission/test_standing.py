"""A tenant's standing (``admission.policy``): one offering more than its weighted share of the recent
load fills the engines less deep (``Ticket.fill``), keeping headroom for the tenants within their share
in proportion to their load; and a request of such a tenant, held back at its lower fill, does not hold
back the best request of a tenant within its share (of the same priority only)."""

from __future__ import annotations

import pytest

from tests.unit.orchestrator.admission.test_policy import FULL, Req, names, queue, ticket
from vllm_disagg.config import AdmissionConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admission.policy import (
    DEMAND_WINDOW,
    FITS,
    RESERVE_PER_LOAD,
    AdmissionQueue,
    Fit,
    Ticket,
)


def offered(q: AdmissionQueue[Req], load: dict[str, int], model: str = "m") -> None:
    """Arrivals in these numbers per tenant, interleaved, each admitted at once (an idle cluster)."""
    left = dict(load)
    n = 0
    while any(left.values()):
        for tenant in sorted(left):
            if left[tenant]:
                left[tenant] -= 1
                n += 1
                q.offer(ticket(f"{tenant}{n}", tenant=tenant, model=model), FITS, 0.0)


def fill(q: AdmissionQueue[Req], tenant: str, model: str = "m") -> float:
    return q.fill(ticket("probe", tenant=tenant, model=model))


@pytest.mark.parametrize(
    ("load", "weights", "fills"),
    [
        ({"a": 100}, {}, {"a": 1.0}),  # alone: never over its share, however much it sends
        ({"a": 50, "b": 50}, {}, {"a": 1.0, "b": 1.0}),  # level
        ({"a": 45, "b": 55}, {}, {"a": 1.0, "b": 1.0}),  # within the tolerance: no flapping
        ({"a": 25, "b": 75}, {}, {"a": 1.0, "b": 0.25}),  # a quarter of the load within: the floor
        ({"a": 10, "b": 90}, {}, {"a": 1.0, "b": 1.0 - RESERVE_PER_LOAD * 0.1}),  # headroom for a's tenth
        ({"a": 25, "b": 75}, {"b": 3.0}, {"a": 1.0, "b": 1.0}),  # b's weight is its load's part
        ({"a": 50, "b": 50}, {"a": 3.0}, {"a": 1.0, "b": 0.25}),  # b sends twice its weight's part
    ],
)
def test_a_tenant_over_its_share_of_the_recent_load_fills_less_deep(
    load: dict[str, int], weights: dict[str, float], fills: dict[str, float]
) -> None:
    q: AdmissionQueue[Req] = AdmissionQueue(AdmissionConfig(over_share_fill=0.25), weights)
    offered(q, load)
    assert {t: fill(q, t) for t in fills} == pytest.approx(fills)


def test_the_load_is_the_last_arrivals_so_a_flood_that_stopped_is_forgotten() -> None:
    q = queue()
    offered(q, {"a": 25, "b": 75})
    assert fill(q, "b") < 1.0
    offered(q, {"a": DEMAND_WINDOW // 2, "b": DEMAND_WINDOW // 2})
    assert fill(q, "b") == 1.0
    assert fill(q, "b", model="other") == 1.0  # each model's load is its own


def test_the_queue_sets_each_ticket_s_fill_before_it_is_checked() -> None:
    q = queue()
    offered(q, {"a": 25, "b": 75})
    q.offer(ticket("b-waits", tenant="b", at=1.0), FULL, 1.0)
    seen: dict[str, float] = {}

    def check(t: Ticket[Req]) -> Fit:
        seen[t.payload.name] = t.fill
        return FITS

    assert names(q.drain(1.1, check)) == [("b-waits", "admitted")]
    assert seen == {"b-waits": pytest.approx(1.0 - RESERVE_PER_LOAD * 25 / 101)}  # b-waits counted


def test_a_flooding_tenant_held_back_at_its_fill_does_not_hold_back_one_within_its_share() -> None:
    """b's request is the head (a is level and b's deadline is sooner) but does not fit at b's lower
    fill; a's fits at a's full one: a's goes, b's waits for room at its own depth."""
    q = queue()
    offered(q, {"a": 25, "b": 75})
    q.offer(ticket("a-level", tenant="a"), FITS, 0.0)  # served last: level with b, not behind it
    q.offer(ticket("b-head", tenant="b", at=1.0, target=1.0), FULL, 1.0)
    q.offer(ticket("a-next", tenant="a", at=1.2, target=1.0), FULL, 1.2)
    checked: list[str] = []

    def check(t: Ticket[Req]) -> Fit:  # room at the full depth only
        checked.append(t.payload.name)
        return FITS if t.fill == 1.0 else FULL

    assert names(q.drain(1.3, check, max_admit=1)) == [("a-next", "admitted")]
    assert checked == ["b-head", "a-next"]
    assert names(q.drain(1.4, check)) == []  # b's waits: nothing within its share is left to go
    assert q.blocked("m") == "prefill" and q.depth("m") == 1


def test_a_request_within_its_share_never_goes_before_a_more_important_one() -> None:
    q = queue(sheddable_priority=5)
    offered(q, {"a": 25, "b": 75})
    q.offer(ticket("b-urgent", tenant="b", priority=-1, at=1.0), FULL, 1.0)
    q.offer(ticket("a-routine", tenant="a", priority=0, at=1.0), FULL, 1.0)
    checked: list[str] = []

    def check(t: Ticket[Req]) -> Fit:
        checked.append(t.payload.name)
        return FITS if t.fill == 1.0 else FULL

    assert q.drain(1.1, check) == []
    assert checked == ["b-urgent"]


def test_a_tenant_within_its_share_is_shed_when_out_of_reach_and_the_next_is_looked_at() -> None:
    q = queue()
    offered(q, {"a": 25, "b": 75})
    q.offer(ticket("a-level", tenant="a"), FITS, 0.0)
    q.offer(ticket("b-head", tenant="b", at=1.0, target=1.0), FULL, 1.0)
    q.offer(ticket("a-late", tenant="a", at=1.1, target=1.0), FULL, 1.1)

    def check(t: Ticket[Req]) -> Fit:
        if t.payload.name == "a-late":
            return Fit(False, "prefill", unreachable=True)
        return FITS if t.fill == 1.0 else FULL

    assert names(q.drain(1.3, check)) == [("a-late", "deadline_unreachable")]
    assert q.depth("m") == 1


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_the_over_share_fill_is_a_fraction_in_0_1(value: float) -> None:
    with pytest.raises(ConfigError, match="over_share_fill"):
        AdmissionConfig(over_share_fill=value)
