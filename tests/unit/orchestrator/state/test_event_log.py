"""The event log: numbered, bounded, replayable, and never blocked by a slow reader."""

from __future__ import annotations

import itertools

from vllm_disagg.orchestrator.state.event_log import EventLog


def log(capacity: int = 1000, per_subscriber: int = 1000) -> EventLog:
    ticks = itertools.count(100)
    return EventLog(lambda: float(next(ticks)), capacity, per_subscriber)


def test_events_are_numbered_and_kept_up_to_the_capacity() -> None:
    events = log(capacity=3)
    for i in range(5):
        events.publish("state", instance=f"i{i}")
    assert [e.seq for e in events.since(0)] == [3, 4, 5]
    assert [e.fields["instance"] for e in events.since(4)] == ["i4"]
    assert events.last_seq == 5


async def test_a_subscriber_gets_every_event_after_it_subscribed_in_order() -> None:
    events = log()
    events.publish("joined", instance="before")
    sub = events.subscribe()
    for name in ("a", "b"):
        events.publish("joined", instance=name)
    first, second = await sub.next(), await sub.next()
    assert first is not None and second is not None
    assert (first.fields["instance"], second.fields["instance"]) == ("a", "b")
    sub.close()
    events.publish("joined", instance="after")  # nobody is told, nothing grows


async def test_a_subscriber_too_slow_to_keep_up_is_dropped_instead_of_growing_a_queue() -> None:
    events = log(per_subscriber=2)
    sub = events.subscribe()
    for i in range(5):
        events.publish("state", instance=f"i{i}")  # never blocks the publisher
    assert sub.dropped
    got = [await sub.next(), await sub.next()]
    assert got[0] is not None and got[0].seq == 2 and got[1] is None, "what fits, then the end of its stream"


def test_an_event_is_one_server_sent_event_with_its_id_and_kind() -> None:
    event = log().publish("link", prefill="p0", decode="d0", **{"from": "closed", "to": "open"})
    text = event.sse().decode()
    assert text.startswith("id: 1\nevent: link\ndata: {") and text.endswith("}\n\n")
    assert '"from":"closed"' in text and '"at":100.0' in text
