"""Whatever the arrivals, checks, withdrawals and clock: every request offered ends exactly once
(admitted, refused or withdrawn), none is admitted twice or refused after admission, the counts agree
with the tickets, and no request is admitted from the queue while a more important one still waits."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.config import AdmissionConfig
from vllm_disagg.orchestrator.admission.policy import ADMITTED, FITS, AdmissionQueue, Fit, Ticket, Verdict

FITS_OR_NOT = st.sampled_from(
    [FITS, Fit(False, "prefill"), Fit(False, "decode"), Fit(False, "prefill", unreachable=True)]
)
OFFER = st.tuples(
    st.just("offer"),
    st.integers(-2, 2),  # priority
    st.sampled_from(["a", "b", "c"]),  # tenant
    st.none() | st.floats(0.05, 5.0),  # TTFT target
    FITS_OR_NOT,
    st.sampled_from(["m", "n"]),  # model
)
DRAIN = st.tuples(st.just("drain"), st.lists(FITS_OR_NOT, min_size=1, max_size=6))
WITHDRAW = st.tuples(st.just("withdraw"), st.integers(0, 1000))
STEPS = st.lists(st.tuples(st.floats(0.0, 2.0), st.one_of(OFFER, DRAIN, WITHDRAW)), max_size=80)


@dataclass
class Req:
    n: int


@settings(max_examples=300, deadline=None)
@given(
    steps=STEPS,
    max_queue=st.integers(1, 6),
    sheddable=st.integers(0, 3),
    weights=st.dictionaries(st.sampled_from(["a", "b"]), st.floats(0.1, 5.0)),
)
def test_every_request_ends_exactly_once(
    steps: list[tuple[float, tuple[object, ...]]], max_queue: int, sheddable: int, weights: dict[str, float]
) -> None:
    config = AdmissionConfig(max_queue=max_queue, max_wait_s=3.0, sheddable_priority=sheddable)
    q: AdmissionQueue[Req] = AdmissionQueue(config, weights)
    tickets: list[Ticket[Req]] = []
    ended: dict[int, str] = {}  # request -> how it ended
    now = 0.0

    def record(outcomes: list[tuple[Ticket[Req], Verdict]]) -> None:
        for t, verdict in outcomes:
            assert t.payload.n not in ended, f"request {t.payload.n} ended twice"
            ended[t.payload.n] = "admitted" if verdict == ADMITTED else "shed"
            assert t.state == ended[t.payload.n]

    for gap, step in steps:
        now += gap
        if step[0] == "offer":
            _, priority, tenant, target, fit, model = step
            assert isinstance(priority, int) and isinstance(tenant, str) and isinstance(model, str)
            assert isinstance(fit, Fit) and (target is None or isinstance(target, float))
            t = Ticket(
                Req(len(tickets)),
                model,
                priority,
                tenant,
                now,
                now + (target or 5.0),
                target is not None,
            )
            tickets.append(t)
            record(q.offer(t, fit, now))
        elif step[0] == "drain":
            fits = step[1]
            assert isinstance(fits, list)
            answers = iter(fits * 50)

            def check(_: Ticket[Req], answers: Iterator[Fit] = answers) -> Fit:
                return next(answers)

            outcomes = q.drain(now, check)
            record(outcomes)
            still = list(q.waiting())
            for t, verdict in outcomes:  # no inversion: nothing more important is left waiting
                if verdict == ADMITTED:
                    assert all(w.priority >= t.priority for w in still if w.model == t.model)
        else:
            waiting = list(q.waiting())
            if waiting:
                gone = waiting[int(step[1]) % len(waiting)]  # type: ignore[call-overload]
                q.withdraw(gone)
                ended[gone.payload.n] = "withdrawn"
        queued = [t for t in tickets if t.state == "queued"]
        assert q.depth() == len(queued) == len(list(q.waiting()))
        assert all(q.depth(m) <= max_queue for m in ("m", "n"))
    record(q.drain(now + 1000.0, lambda _: FITS))  # everything left: admitted or timed out
    assert q.depth() == 0
    assert sorted(ended) == list(range(len(tickets)))
    assert all(t.state == ended[t.payload.n] for t in tickets)
