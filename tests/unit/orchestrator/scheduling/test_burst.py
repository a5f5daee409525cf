"""No herding: picks made within one heartbeat see each other, and a stale scraped queue is discounted.

A burst is many decisions on the same metrics; each holds its decode instance from the decision on
(``Registry.hold``, as ``Flow`` does), so the next pick sees it. And a scrape taken during the last
burst must not keep an emptied instance out of the next (``predict.queued_now``, ``InFlight``).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.orchestrator.scheduling.framework import SchedulingRequest
from vllm_disagg.orchestrator.scheduling.predict import queued_now
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.in_flight import InFlight
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot

NOW = 1000.0
BATCH = 8  # the decode engines' max_num_seqs


def _cluster(decodes: int) -> Registry:
    """One prefill and ``decodes`` equal decode instances, ready, idle as scraped."""
    reg = Registry(heartbeat_timeout_s=10.0)
    ids = [("p0", "prefill")] + [(f"d{i}", "decode") for i in range(decodes)]
    for agent_id, role in ids:
        reg.hello(agent_id, InstanceInfo(url=f"http://{agent_id}:8000", role=role, model="m"), NOW)  # type: ignore[arg-type]
        hb = Heartbeat(seq=1, engine_state="ready", draining=False, metrics=MetricsSnapshot(scraped_at=0.5))
        reg.heartbeat(agent_id, hb, NOW)
    return reg


def _burst(reg: Registry, size: int, seed: int) -> list[str]:
    """``size`` decisions in a row, each holding its decode instance as the gateway's flow does."""
    scheduler, picked = PluginScheduler(), []
    for n in range(size):
        request = SchedulingRequest(f"burst-{seed}-{n}", "m", 40, False, True, {}, False)
        d = scheduler.decide(request, reg.snapshot(), NOW).decode
        reg.hold(d)
        picked.append(d)
    return picked


@settings(max_examples=60, deadline=None)
@given(decodes=st.integers(2, 4), size=st.integers(1, 64), seed=st.integers(0, 10**6))
def test_a_burst_splits_over_equal_decode_instances_within_one(decodes: int, size: int, seed: int) -> None:
    reg = _cluster(decodes)
    picked = _burst(reg, size, seed)
    counts = [picked.count(f"d{i}") for i in range(decodes)]
    assert max(counts) - min(counts) <= 1, counts


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.integers(0, 2 * BATCH), min_size=2, max_size=4),
    size=st.integers(1, 48),
    seed=st.integers(0, 10**6),
)
def test_no_decode_instance_is_sent_past_its_batch_while_a_peer_has_room(
    loads: list[int], size: int, seed: int
) -> None:
    reg = _cluster(len(loads))
    for i, load in enumerate(loads):  # legs already running there
        for _ in range(load):
            reg.acquire(f"d{i}")
    scheduler, sent = PluginScheduler(), {f"d{i}": load for i, load in enumerate(loads)}
    for n in range(size):
        request = SchedulingRequest(f"b-{seed}-{n}", "m", 40, False, True, {}, False)
        d = scheduler.decide(request, reg.snapshot(), NOW).decode
        if sent[d] >= BATCH:
            room = [p for p, k in sent.items() if k < BATCH]
            assert not room, f"{d} past its batch while {room} have room: {sent}"
        sent[d] += 1
        reg.hold(d)


def test_a_burst_without_holds_herds() -> None:
    """What the holds fix: picks that do not see each other put a whole burst on one instance."""
    reg, scheduler = _cluster(2), PluginScheduler()
    snap = reg.snapshot()
    request = SchedulingRequest("same-heartbeat", "m", 40, False, True, {}, False)
    assert len({scheduler.decide(request, snap, NOW).decode for _ in range(24)}) == 1


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_count_at_a_scrape_is_the_fewest_since_the_scrape_before_and_what_ended_is_never_overstated(
    data: st.DataObject,
) -> None:
    flight, next_id = InFlight(), 0
    live: list[int] = []
    counts_since: list[int] = [0]  # counts seen since the last heartbeat that brought a scrape
    at_scrape_set: set[int] = set()
    for _ in range(data.draw(st.integers(1, 12), label="scrapes")):
        steps = data.draw(st.lists(st.booleans(), max_size=20), label="steps")  # True: add
        taken = data.draw(st.integers(0, len(steps)), label="scrape taken after step")
        scrape_set = set(live) if taken == 0 else None
        for i, add in enumerate(steps, 1):
            if add:
                live.append(next_id)
                next_id += 1
                flight.add("d")
            elif live:
                live.pop(data.draw(st.integers(0, len(live) - 1), label="which ends"))
                flight.remove("d")
            counts_since.append(len(live))
            if i == taken:
                scrape_set = set(live)
            gone = len(at_scrape_set - set(live))
            assert flight.ended().get("d", 0) <= gone
        assert scrape_set is not None
        at = flight.scraped("d")
        assert at == min(counts_since) <= len(scrape_set)
        counts_since, at_scrape_set = [len(live)], scrape_set
        assert flight.ended().get("d", 0) == 0


def test_the_scraped_queue_is_discounted_by_the_requests_that_ended_since() -> None:
    busy = MetricsSnapshot(scraped_at=1.0, num_running=BATCH, num_waiting=4)
    reg = _cluster(1)
    for _ in range(12):
        reg.acquire("d0")
    # The count at a scrape is the fewest since the scrape before: this one may have been taken
    # before the 12 came (none ended since); the next, with the queue, after.
    between = MetricsSnapshot(scraped_at=0.8, num_running=BATCH, num_waiting=4)
    for seq, metrics in ((2, between), (3, busy)):
        reg.heartbeat("d0", Heartbeat(seq=seq, engine_state="ready", draining=False, metrics=metrics), NOW)
        assert reg.snapshot().ended_since_scrape.get("d0", 0) == 0
    view = reg.get("d0")
    assert view is not None
    assert queued_now(view, reg.snapshot()) == 4  # nothing ended yet: the queue is as scraped
    for _ in range(3):
        reg.release("d0")
    assert queued_now(view, reg.snapshot()) == 1  # three left: three moved from the queue to the batch
    for _ in range(5):
        reg.hold("d0")  # the next burst's picks: they are not in the engine's queue
    assert queued_now(view, reg.snapshot()) == 1
    for _ in range(9):
        reg.release("d0")
    assert queued_now(view, reg.snapshot()) == 0
    fresh = MetricsSnapshot(scraped_at=2.0, num_running=0, num_waiting=2)
    reg.heartbeat("d0", Heartbeat(seq=4, engine_state="ready", draining=False, metrics=fresh), NOW)
    view = reg.get("d0")
    assert view is not None
    assert queued_now(view, reg.snapshot()) == 2  # a new scrape starts the count over
