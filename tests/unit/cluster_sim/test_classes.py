"""Priority classes and tenants of a trace: the mixes ``--priority-mix`` and ``--tenants`` describe, and
their seeded assignment to the requests."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest

from vllm_disagg.cluster_sim.classes import PriorityMix, TenantMix, with_classes
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest
from vllm_disagg.cluster_sim.traces import SYNTHETIC

MIX = PriorityMix.parse("0.2:-1,0.6:0,0.2:1")
TENANTS = TenantMix.parse("a:2:0.75,b:1:0.25")


def trace(n: int, *, session_every: int = 0) -> Trace:
    """``n`` requests; with ``session_every``, runs of that many consecutive requests share a session."""
    return Trace(
        "t",
        [
            TraceRequest(float(i), 32, 4, (i,), 16, f"s{i // session_every}" if session_every else "")
            for i in range(n)
        ],
    )


def test_mixes_parse_into_shares_priorities_tenants_and_weights() -> None:
    assert MIX.shares == ((0.2, -1), (0.6, 0), (0.2, 1))
    assert TENANTS.tenants == (("a", 2.0, 0.75), ("b", 1.0, 0.25))
    assert TENANTS.weights() == (("a", 2.0), ("b", 1.0))


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        pytest.param(PriorityMix.parse, "0.5:0", "add up to 0.5", id="priority-shares-short-of-one"),
        pytest.param(PriorityMix.parse, "0.5:0,0.5:0", "named twice", id="priority-twice"),
        pytest.param(PriorityMix.parse, "0.5:high,0.5:0", "not SHARE:PRIORITY", id="priority-not-int"),
        pytest.param(PriorityMix.parse, "1", "not SHARE:PRIORITY", id="priority-no-colon"),
        pytest.param(PriorityMix.parse, "1.5:0,-0.5:1", "a share is in (0, 1]", id="share-out-of-range"),
        pytest.param(PriorityMix.parse, "x:0", "is not a number", id="share-not-a-number"),
        pytest.param(TenantMix.parse, "a:1:0.5,b:1:0.4", "add up to 0.9", id="tenant-shares-short"),
        pytest.param(TenantMix.parse, "a:0:1", "weight must be a number > 0", id="tenant-weight-zero"),
        pytest.param(TenantMix.parse, "a:inf:1", "weight must be a number > 0", id="tenant-weight-infinite"),
        pytest.param(
            TenantMix.parse, "a b:1:1", "not NAME:WEIGHT:SHARE", id="tenant-name-the-gateway-refuses"
        ),
        pytest.param(TenantMix.parse, "a:1", "not NAME:WEIGHT:SHARE", id="tenant-no-share"),
        pytest.param(TenantMix.parse, "a:1:0.5,a:1:0.5", "named twice", id="tenant-twice"),
    ],
)
def test_a_malformed_mix_is_refused_saying_why(
    parse: Callable[[str], object], text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(text)


def test_requests_get_each_class_and_tenant_in_its_share() -> None:
    n = 6000
    mixed = with_classes(trace(n), MIX, TENANTS, seed=3)
    counts: Counter[int | str] = Counter(r.priority for r in mixed.requests)
    counts.update(r.tenant for r in mixed.requests)
    shares: dict[int | str, float] = {p: s for s, p in MIX.shares} | {t: s for t, _, s in TENANTS.tenants}
    for key, share in shares.items():
        sigma = math.sqrt(n * share * (1 - share))  # binomial: 4 sigma is never reached by chance here
        assert abs(counts[key] - n * share) < 4 * sigma, (key, counts[key])
    # Only the class and the tenant change.
    assert [replace(r, priority=0, tenant="default") for r in mixed.requests] == list(trace(n).requests)


def test_the_assignment_is_a_function_of_the_seed_and_a_longer_trace_extends_a_shorter_one() -> None:
    def classes(n: int, seed: int) -> list[tuple[int, str]]:
        return [(r.priority, r.tenant) for r in with_classes(trace(n), MIX, TENANTS, seed).requests]

    assert classes(500, seed=1) == classes(500, seed=1)
    assert classes(500, seed=1) != classes(500, seed=2)
    assert classes(800, seed=1)[:500] == classes(500, seed=1)


def test_priorities_and_tenants_are_drawn_apart_so_one_mix_leaves_the_others_draws_alone() -> None:
    both = with_classes(trace(400), MIX, TENANTS, seed=5)
    priorities_only = with_classes(trace(400), MIX, None, seed=5)
    other_tenants = with_classes(trace(400), MIX, TenantMix.parse("x:1:0.5,y:1:0.5"), seed=5)
    assert [r.priority for r in both.requests] == [r.priority for r in priorities_only.requests]
    assert [r.priority for r in both.requests] == [r.priority for r in other_tenants.requests]
    assert {r.tenant for r in priorities_only.requests} == {"default"}


def test_every_turn_of_a_session_keeps_its_first_turns_class_and_tenant() -> None:
    mixed = with_classes(trace(600, session_every=6), MIX, TENANTS, seed=0)
    by_session: dict[str, set[tuple[int, str]]] = {}
    for r in mixed.requests:
        by_session.setdefault(r.session, set()).add((r.priority, r.tenant))
    assert all(len(kinds) == 1 for kinds in by_session.values())
    assert len({kind for kinds in by_session.values() for kind in kinds}) > 1  # yet sessions differ


def test_no_mix_leaves_the_trace_as_it_is() -> None:
    original = SYNTHETIC["poisson"](n_requests=50)
    assert with_classes(original, None, None, seed=0) is original
    assert {(r.priority, r.tenant) for r in original.requests} == {(0, "default")}
