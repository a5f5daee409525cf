"""The registry: the instance state machine, expiry to the exact timeout, in-flight counts, snapshots."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vllm_disagg.clock import FakeClock
from vllm_disagg.orchestrator.control.plane import starved_after
from vllm_disagg.orchestrator.state.registry import InstanceState, Registry
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, MetricsSnapshot, Role

TIMEOUT = 1.0


def info(role: Role = "decode", model: str = "m", url: str = "http://127.0.0.1:9000") -> InstanceInfo:
    return InstanceInfo(url=url, role=role, model=model)


def hb(
    engine_state: EngineState = "ready", draining: bool = False, seq: int = 1, running: int = 0
) -> Heartbeat:
    return Heartbeat(
        seq=seq, engine_state=engine_state, draining=draining, metrics=MetricsSnapshot(num_running=running)
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def reg(clock: FakeClock) -> Registry:
    return Registry(heartbeat_timeout_s=TIMEOUT, suspect_after_s=TIMEOUT / 2)


def test_by_default_a_late_heartbeat_changes_nothing_until_the_instance_is_dead(clock: FakeClock) -> None:
    reg = Registry(heartbeat_timeout_s=TIMEOUT)
    reg.hello("a", info(), clock.monotonic())
    reg.heartbeat("a", hb(), clock.monotonic())
    assert reg.tick(clock.monotonic() + TIMEOUT * 0.99) == []
    assert reg.get("a").state == "ready"  # type: ignore[union-attr]
    assert reg.tick(clock.monotonic() + TIMEOUT) == ["a"]


Step = Callable[[Registry, float], object]

HELLO: Step = lambda r, now: r.hello("a", info(), now)  # noqa: E731
READY: Step = lambda r, now: r.heartbeat("a", hb("ready"), now)  # noqa: E731
STARTING: Step = lambda r, now: r.heartbeat("a", hb("starting"), now)  # noqa: E731
UNHEALTHY: Step = lambda r, now: r.heartbeat("a", hb("unhealthy"), now)  # noqa: E731
STOPPED: Step = lambda r, now: r.heartbeat("a", hb("stopped"), now)  # noqa: E731
AGENT_DRAIN: Step = lambda r, now: r.heartbeat("a", hb("ready", draining=True), now)  # noqa: E731
ADMIN_DRAIN: Step = lambda r, now: r.set_admin_drain("a", True)  # noqa: E731
ADMIN_UNDRAIN: Step = lambda r, now: r.set_admin_drain("a", False)  # noqa: E731
GOODBYE: Step = lambda r, now: r.goodbye("a", "bye")  # noqa: E731
EXPIRE_LATER: Step = lambda r, now: r.expire(now + TIMEOUT)  # noqa: E731
RESTARTING: Step = lambda r, now: r.heartbeat("a", hb("restarting"), now)  # noqa: E731
LATE: Step = lambda r, now: r.tick(now + TIMEOUT * 0.6)  # noqa: E731
FAIL: Step = lambda r, now: r.leg_failed("a", now)  # noqa: E731
SUCCEED: Step = lambda r, now: r.leg_succeeded("a")  # noqa: E731
ACQUIRE: Step = lambda r, now: r.acquire("a")  # noqa: E731
# A heartbeat, then time passes past the first open period (1 s by default) but not the doubled one.
OPEN_OVER: Step = lambda r, now: (r.heartbeat("a", hb(), now + 1.2), r.tick(now + 1.2))  # noqa: E731
CORDON: Step = lambda r, now: r.set_cordon("a", True)  # noqa: E731
UNCORDON: Step = lambda r, now: r.set_cordon("a", False)  # noqa: E731


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        pytest.param([HELLO], "joining", id="hello-alone-is-joining"),
        pytest.param([HELLO, STARTING], "joining", id="engine-starting-stays-joining"),
        pytest.param([HELLO, READY], "ready", id="engine-ready-heartbeat-makes-ready"),
        pytest.param([HELLO, READY, UNHEALTHY], "suspect", id="engine-unhealthy-is-suspect"),
        pytest.param([HELLO, READY, RESTARTING], "suspect", id="engine-restarting-is-suspect"),
        pytest.param([HELLO, READY, LATE], "suspect", id="a-late-heartbeat-is-suspect-before-dead"),
        pytest.param([HELLO, READY, LATE, READY], "ready", id="a-heartbeat-after-a-late-one-is-ready"),
        pytest.param([HELLO, READY, *[FAIL] * 2], "ready", id="two-failed-legs-keep-the-breaker-closed"),
        pytest.param([HELLO, READY, *[FAIL] * 3], "suspect", id="three-failed-legs-open-the-breaker"),
        pytest.param([HELLO, READY, *[FAIL] * 3, READY], "suspect", id="heartbeats-do-not-close-a-breaker"),
        pytest.param([HELLO, READY, *[FAIL] * 3, OPEN_OVER], "ready", id="half-open-after-the-open-period"),
        pytest.param(
            [HELLO, READY, *[FAIL] * 3, OPEN_OVER, ACQUIRE],
            "suspect",
            id="one-probe-at-a-time-when-half-open",
        ),
        pytest.param(
            [HELLO, READY, *[FAIL] * 3, OPEN_OVER, ACQUIRE, SUCCEED], "ready", id="a-good-probe-closes-it"
        ),
        pytest.param(
            [HELLO, READY, *[FAIL] * 3, OPEN_OVER, ACQUIRE, FAIL, OPEN_OVER],
            "suspect",
            id="a-failed-probe-opens-it-for-longer",
        ),
        pytest.param(
            [HELLO, READY, FAIL, FAIL, SUCCEED, FAIL, FAIL], "ready", id="a-success-resets-the-count"
        ),
        pytest.param([HELLO, READY, CORDON], "cordoned", id="admin-cordon-is-cordoned"),
        pytest.param([HELLO, READY, CORDON, UNCORDON], "ready", id="admin-uncordon-is-ready"),
        pytest.param([HELLO, READY, CORDON, HELLO, READY], "cordoned", id="a-cordon-outlives-the-session"),
        pytest.param([HELLO, READY, CORDON, ADMIN_DRAIN], "draining", id="draining-wins-over-cordoned"),
        pytest.param([HELLO, READY, UNHEALTHY, READY], "ready", id="engine-recovers-to-ready"),
        pytest.param([HELLO, READY, STOPPED], "dead", id="engine-stopped-is-dead"),
        pytest.param([HELLO, READY, AGENT_DRAIN], "draining", id="agent-drain-is-draining"),
        pytest.param([HELLO, READY, AGENT_DRAIN, READY], "ready", id="agent-undrain-is-ready-again"),
        pytest.param([HELLO, READY, ADMIN_DRAIN], "draining", id="admin-drain-is-draining-at-once"),
        pytest.param([HELLO, READY, ADMIN_DRAIN, READY], "draining", id="admin-drain-survives-heartbeats"),
        pytest.param([HELLO, READY, ADMIN_DRAIN, ADMIN_UNDRAIN], "ready", id="admin-undrain-is-ready"),
        pytest.param([HELLO, STARTING, ADMIN_DRAIN], "draining", id="draining-wins-over-joining"),
        pytest.param([HELLO, READY, GOODBYE], "dead", id="goodbye-is-dead"),
        pytest.param([HELLO, READY, EXPIRE_LATER], "dead", id="silence-for-timeout-is-dead"),
        pytest.param([HELLO, READY, GOODBYE, READY], "dead", id="heartbeat-does-not-revive-the-dead"),
        pytest.param([HELLO, READY, GOODBYE, HELLO], "joining", id="hello-after-death-is-a-new-session"),
        pytest.param([HELLO, READY, GOODBYE, HELLO, READY], "ready", id="the-dead-come-back-through-hello"),
        pytest.param(
            [HELLO, READY, ADMIN_DRAIN, HELLO, READY],
            "draining",
            id="a-new-session-keeps-the-operators-drain",
        ),
        pytest.param(
            [HELLO, READY, GOODBYE, ADMIN_DRAIN], "dead", id="draining-a-dead-instance-keeps-it-dead"
        ),
    ],
)
def test_state_transitions(
    reg: Registry, clock: FakeClock, steps: list[Step], expected: InstanceState
) -> None:
    for step in steps:
        step(reg, clock.monotonic())
        clock.advance(0.1)
    view = reg.get("a")
    assert view is not None
    assert view.state == expected


def test_heartbeat_from_an_unknown_agent_is_rejected(reg: Registry, clock: FakeClock) -> None:
    assert reg.heartbeat("nobody", hb(), clock.monotonic()) is None
    assert reg.get("nobody") is None


def test_heartbeat_from_a_dead_session_is_rejected_so_the_agent_says_hello_again(
    reg: Registry, clock: FakeClock
) -> None:
    reg.hello("a", info(), clock.monotonic())
    reg.goodbye("a")
    assert reg.heartbeat("a", hb(), clock.monotonic()) is None


def test_expiry_happens_exactly_at_the_timeout_and_not_before(reg: Registry, clock: FakeClock) -> None:
    reg.hello("a", info(), clock.monotonic())
    reg.heartbeat("a", hb(), clock.monotonic())
    last = clock.monotonic()
    assert reg.expire(last + TIMEOUT - 1e-6) == []
    assert reg.get("a").state == "suspect", "silent: no longer routed to, not yet dead"  # type: ignore[union-attr]
    assert reg.expire(last + TIMEOUT) == ["a"]
    view = reg.get("a")
    assert view is not None
    assert view.state == "dead"
    assert "no heartbeat" in view.dead_reason
    assert reg.expire(last + 10 * TIMEOUT) == [], "an instance dies once"


def test_each_heartbeat_restarts_the_timeout(reg: Registry, clock: FakeClock) -> None:
    reg.hello("a", info(), clock.monotonic())
    for _ in range(5):
        clock.advance(TIMEOUT * 0.9)
        reg.heartbeat("a", hb(), clock.monotonic())
        assert reg.expire(clock.monotonic()) == []
    assert reg.get("a").state == "ready"  # type: ignore[union-attr]


def test_a_joining_instance_that_never_heartbeats_expires_from_its_hello(
    reg: Registry, clock: FakeClock
) -> None:
    reg.hello("a", info(), clock.monotonic())
    assert reg.expire(clock.monotonic() + TIMEOUT) == ["a"]


def test_only_silent_instances_expire(reg: Registry, clock: FakeClock) -> None:
    reg.hello("quiet", info(), clock.monotonic())
    reg.hello("chatty", info(), clock.monotonic())
    clock.advance(TIMEOUT / 2)
    reg.heartbeat("chatty", hb(), clock.monotonic())
    clock.advance(TIMEOUT / 2)
    assert reg.expire(clock.monotonic()) == ["quiet"]


def test_hello_again_starts_a_new_session_with_the_new_info(reg: Registry, clock: FakeClock) -> None:
    first = reg.hello("a", info(url="http://old"), clock.monotonic())
    reg.goodbye("a")
    second = reg.hello("a", info(url="http://new"), clock.monotonic())
    assert (first.session, second.session) == (1, 2)
    assert second.info.url == "http://new"
    assert second.dead_reason == ""


def test_in_flight_counts_follow_acquire_and_release(reg: Registry, clock: FakeClock) -> None:
    reg.hello("a", info(), clock.monotonic())
    reg.acquire("a")
    reg.acquire("a")
    assert reg.snapshot().in_flight_of("a") == 2
    reg.release("a")
    assert reg.snapshot().in_flight_of("a") == 1
    reg.release("a")
    reg.release("a")  # an extra release never goes below zero
    assert reg.snapshot().in_flight_of("a") == 0
    assert reg.requests_total("a") == 2


def test_snapshot_is_cached_until_something_changes(reg: Registry, clock: FakeClock) -> None:
    reg.hello("a", info(), clock.monotonic())
    first = reg.snapshot()
    assert reg.snapshot() is first, "no change: the same object"
    reg.acquire("a")
    counted = reg.snapshot()
    assert counted is not first
    assert counted.instances is first.instances, "an in-flight change does not rebuild instance views"
    reg.heartbeat("a", hb(), clock.monotonic())
    rebuilt = reg.snapshot()
    assert rebuilt.version > first.version
    assert rebuilt.by_id["a"].state == "ready"
    assert first.by_id["a"].state == "joining", "an old snapshot never changes"


def test_snapshot_indexes_only_ready_instances_by_role_and_model(reg: Registry, clock: FakeClock) -> None:
    now = clock.monotonic()
    for agent_id, role, model in [
        ("p", "prefill", "m"),
        ("d", "decode", "m"),
        ("b", "both", "m"),
        ("other", "decode", "x"),
        ("starting", "decode", "m"),
    ]:
        reg.hello(agent_id, info(role=role, model=model), now)  # type: ignore[arg-type]
        if agent_id != "starting":
            reg.heartbeat(agent_id, hb(), now)
    reg.hello("gone", info(model="y"), now)
    reg.goodbye("gone")
    snap = reg.snapshot()
    assert sorted(v.agent_id for v in snap.ready_prefill["m"]) == ["b", "p"]
    assert sorted(v.agent_id for v in snap.ready_decode["m"]) == ["b", "d"]
    assert [v.agent_id for v in snap.ready_decode["x"]] == ["other"]
    assert snap.known_models == {"m", "x", "y"}, "dead instances still make their model known"
    assert snap.ready_models() == ["m", "x"]


def test_metrics_from_the_last_heartbeat_are_kept(reg: Registry, clock: FakeClock) -> None:
    reg.hello("a", info(), clock.monotonic())
    reg.heartbeat("a", hb(running=7), clock.monotonic())
    assert reg.snapshot().by_id["a"].metrics.num_running == 7


def test_admin_drain_of_an_unknown_instance_raises_key_error(reg: Registry) -> None:
    with pytest.raises(KeyError):
        reg.set_admin_drain("nobody", True)


@pytest.mark.parametrize(
    ("lag_s", "starved"),
    [(0.125, False), (0.2, False), (0.3, False), (0.4, True), (8.74, True)],
    ids=["on-time", "a-little-late", "late-within-two-periods", "late-beyond-two-periods", "seconds-late"],
)
def test_a_late_expiry_tick_means_the_orchestrator_was_starved(lag_s: float, starved: bool) -> None:
    # Period 0.125 s (heartbeat every 0.25 s). A starved orchestrator has heartbeats unread in its
    # socket; that tick is skipped so they are read before anyone is declared dead.
    assert (lag_s > starved_after(0.125)) is starved


def test_a_metrics_only_heartbeat_changes_the_view_but_not_the_membership(reg: Registry) -> None:
    reg.hello("a", info(), 0.0)
    reg.heartbeat("a", hb("ready"), 0.1)
    before = reg.snapshot()
    reg.heartbeat("a", Heartbeat(seq=2, engine_state="ready", metrics=MetricsSnapshot(num_waiting=7)), 0.2)
    after = reg.snapshot()
    assert after.version > before.version
    assert after.membership == before.membership, "the same instances in the same states"
    assert after.by_id["a"].metrics.num_waiting == 7
    assert after.ready_decode["m"][0] is after.by_id["a"], "every index holds the new view"
    assert after.by_model["m"][0] is after.by_id["a"]
    assert before.by_id["a"].metrics.num_waiting == 0, "an old snapshot never changes"


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(lambda r: r.heartbeat("a", hb("ready", draining=True), 0.2), id="agent-drains"),
        pytest.param(lambda r: r.set_admin_drain("a", True), id="operator-drains"),
        pytest.param(lambda r: r.heartbeat("a", hb("starting"), 0.2), id="engine-no-longer-ready"),
        pytest.param(lambda r: r.goodbye("a"), id="goodbye"),
        pytest.param(lambda r: r.hello("b", info(), 0.2), id="another-instance-joins"),
        pytest.param(lambda r: r.hello("a", info(), 0.2), id="a-new-session"),
    ],
)
def test_joining_leaving_or_changing_state_changes_the_membership(
    reg: Registry, step: Callable[[Registry], object]
) -> None:
    reg.hello("a", info(), 0.0)
    reg.heartbeat("a", hb("ready"), 0.1)
    before = reg.snapshot().membership
    step(reg)
    assert reg.snapshot().membership > before


def test_two_registries_never_share_an_identity() -> None:
    assert Registry(1.0).snapshot().registry_id != Registry(1.0).snapshot().registry_id


@pytest.mark.parametrize(
    ("steps", "lost"),
    [
        pytest.param([HELLO, READY, EXPIRE_LATER], ["no heartbeat"], id="death-by-silence-is-a-loss"),
        pytest.param([HELLO, READY, GOODBYE], ["goodbye: bye"], id="goodbye-is-a-loss"),
        pytest.param([HELLO, READY, RESTARTING], ["engine restarting"], id="an-engine-restart-is-a-loss"),
        pytest.param([HELLO, READY, UNHEALTHY, UNHEALTHY], ["engine unhealthy"], id="told-once-per-episode"),
        pytest.param([HELLO, READY, STOPPED], ["engine stopped"], id="an-engine-stop-is-a-loss"),
        pytest.param([HELLO, READY, HELLO], ["new session"], id="a-new-hello-over-a-live-one-is-a-loss"),
        pytest.param([HELLO, READY, LATE], [], id="a-late-heartbeat-is-not-yet-a-loss"),
        pytest.param([HELLO, READY, *[FAIL] * 3], [], id="an-open-breaker-is-not-a-loss"),
        pytest.param([HELLO, READY, CORDON, ADMIN_DRAIN], [], id="cordon-and-drain-let-requests-finish"),
        pytest.param([HELLO, READY, GOODBYE, EXPIRE_LATER], ["goodbye"], id="the-dead-are-lost-only-once"),
    ],
)
def test_the_gateway_is_told_when_requests_on_an_instance_are_lost(
    reg: Registry, clock: FakeClock, steps: list[Step], lost: list[str]
) -> None:
    told: list[tuple[str, str]] = []
    reg.on_lost = lambda agent_id, reason: told.append((agent_id, reason))
    for step in steps:
        step(reg, clock.monotonic())
        clock.advance(0.1)
    assert [agent for agent, _ in told] == ["a"] * len(lost)
    for (_, reason), wanted in zip(told, lost, strict=True):
        assert wanted in reason


def test_a_link_breaker_blocks_one_pairing_and_not_the_instances(reg: Registry, clock: FakeClock) -> None:
    for agent_id, role in [("p", "prefill"), ("d", "decode"), ("d2", "decode")]:
        reg.hello(agent_id, info(role=role), clock.monotonic())  # type: ignore[arg-type]
        reg.heartbeat(agent_id, hb(), clock.monotonic())
    for _ in range(3):
        reg.leg_failed("d", clock.monotonic(), partner="p")
    snap = reg.snapshot()
    assert snap.blocked_links == {("p", "d")}
    assert reg.link_breaker("p", "d").state == "open"
    assert reg.link_breaker("p", "d2").state == "closed"
    reg.leg_succeeded("d", partner="p")  # a request that started before it opened
    assert reg.snapshot().blocked_links == frozenset(), "a success on the link closes it"


def test_a_link_breaker_half_opens_after_its_period_and_goes_with_its_instances(
    reg: Registry, clock: FakeClock
) -> None:
    for agent_id, role in [("p", "prefill"), ("d", "decode")]:
        reg.hello(agent_id, info(role=role), clock.monotonic())  # type: ignore[arg-type]
        reg.heartbeat(agent_id, hb(), clock.monotonic())
    for _ in range(3):
        reg.leg_failed("d", clock.monotonic(), partner="p")
    reg.tick(clock.monotonic() + 0.5)
    assert reg.snapshot().blocked_links == {("p", "d")}
    reg.heartbeat("p", hb(), clock.monotonic() + 1.1)
    reg.heartbeat("d", hb(), clock.monotonic() + 1.1)
    reg.tick(clock.monotonic() + 1.1)
    assert reg.snapshot().blocked_links == frozenset(), "half-open: the next pairing is the probe"
    for _ in range(3):
        reg.leg_failed("d", clock.monotonic() + 1.2, partner="p")
    assert reg.snapshot().blocked_links == {("p", "d")}
    reg.goodbye("p")
    assert reg.snapshot().blocked_links == frozenset(), "a dead instance takes its links with it"


def test_membership_changes_when_a_breaker_changes_who_may_be_routed_to(
    reg: Registry, clock: FakeClock
) -> None:
    reg.hello("a", info(), clock.monotonic())
    reg.heartbeat("a", hb(), clock.monotonic())
    before = reg.snapshot().membership
    reg.leg_failed("a", clock.monotonic())
    assert reg.snapshot().membership == before, "one failure changes nothing routable"
    reg.leg_failed("a", clock.monotonic())
    reg.leg_failed("a", clock.monotonic())
    snap = reg.snapshot()
    assert snap.membership > before
    assert snap.ready_decode.get("m", ()) == ()
    assert "breaker open after 3 failures" in snap.by_id["a"].suspect_reason


def test_a_snapshot_shows_the_instances_as_they_were_when_taken_even_where_built_later(
    reg: Registry, clock: FakeClock
) -> None:
    now = clock.monotonic()
    reg.hello("p", info("prefill", url="http://127.0.0.1:9001"), now)
    reg.hello("d", info("decode", url="http://127.0.0.1:9002"), now)
    reg.heartbeat("p", hb(running=1), now)
    reg.heartbeat("d", hb(running=2), now)
    before = reg.snapshot()
    reg.heartbeat("d", hb(running=7, seq=2), now)  # a metrics change: the same membership
    reg.acquire("p")
    after = reg.snapshot()
    # before's view tuples are built only now, after the heartbeat: they still show running=2
    assert [v.metrics.num_running for v in before.by_model["m"]] == [2, 1]  # by agent id: d, p
    assert [v.metrics.num_running for v in after.by_model["m"]] == [7, 1]
    assert [v.agent_id for v in after.ready_prefill["m"]] == ["p"]
    assert [v.agent_id for v in after.ready_decode["m"]] == ["d"]
    assert {v.agent_id for v in after.instances} == {"p", "d"} and after.by_id["d"].metrics.num_running == 7
    assert after.model_ids is before.model_ids  # the id groups last as long as the membership
    assert after.in_flight_of("p") == 1 and before.in_flight_of("p") == 0
    reg.heartbeat("p", hb("unhealthy", seq=2), now)  # a state change: new groups
    assert reg.snapshot().prefill_ids.get("m", ()) == ()
    assert after.prefill_ids["m"] == ("p",)


def test_snapshots_share_the_views_until_the_next_change_and_never_see_it(
    reg: Registry, clock: FakeClock
) -> None:
    now = clock.monotonic()
    reg.hello("a", info(), now)
    reg.hello("b", info(url="http://127.0.0.1:9003"), now)
    first = reg.snapshot()
    reg.acquire("a")  # in-flight counts only: the same views, shared
    second = reg.snapshot()
    assert second.by_id is first.by_id and second.in_flight_of("a") == 1
    reg.heartbeat("a", hb(running=3), now)
    reg.hello("c", info(url="http://127.0.0.1:9004"), now)
    reg.goodbye("b", "bye")
    reg.remove("b")
    assert set(first.by_id) == set(second.by_id) == {"a", "b"}, "a change after a snapshot is not in it"
    assert first.by_id["a"].metrics.num_running == 0 and first.by_id["b"].state == "joining"
    third = reg.snapshot()
    assert set(third.by_id) == {"a", "c"} and third.by_id["a"].metrics.num_running == 3


# --- watching the registry (what rollouts and role changes step on instead of polling) --------------

Act = Callable[[Registry], object]


@pytest.mark.parametrize(
    ("act", "state_watcher", "flight_watcher"),
    [
        pytest.param(lambda r: r.hello("b", info(), 0.0), 1, 1, id="a join tells both"),
        pytest.param(
            lambda r: r.heartbeat("a", hb(running=3), 0.1), 1, 1, id="a heartbeat's metrics tell both"
        ),
        pytest.param(lambda r: r.set_admin_drain("a", True), 1, 1, id="an operator's drain tells both"),
        pytest.param(lambda r: r.set_role("a", "prefill"), 1, 1, id="a role change tells both"),
        pytest.param(lambda r: r.goodbye("a"), 1, 1, id="a death tells both"),
        pytest.param(lambda r: (r.goodbye("a"), r.remove("a")), 2, 2, id="a removal tells both again"),
        pytest.param(lambda r: r.acquire("a"), 0, 1, id="a request sent tells only the in-flight watcher"),
        pytest.param(lambda r: (r.acquire("a"), r.release("a")), 0, 2, id="a request over tells it too"),
        pytest.param(lambda r: r.set_remote_in_flight({"a": 2}), 0, 1, id="the workers' counts tell it"),
        pytest.param(lambda r: r.set_remote_in_flight({}), 0, 0, id="the same counts again tell nobody"),
        pytest.param(lambda r: r.count_sent({"a": 1}), 0, 0, id="a count of requests sent tells nobody"),
        pytest.param(lambda r: r.get("a"), 0, 0, id="reading tells nobody"),
    ],
)
def test_watchers_hear_of_each_change_a_snapshot_shows(
    act: Act, state_watcher: int, flight_watcher: int
) -> None:
    reg = Registry(heartbeat_timeout_s=TIMEOUT)
    reg.hello("a", info(), 0.0)
    reg.heartbeat("a", hb(), 0.0)
    heard = {"state": 0, "flight": 0}
    reg.watch(lambda: heard.__setitem__("state", heard["state"] + 1))
    reg.watch(lambda: heard.__setitem__("flight", heard["flight"] + 1), in_flight=True)
    act(reg)
    assert (heard["state"], heard["flight"]) == (state_watcher, flight_watcher)


def test_a_watcher_that_stopped_hears_nothing_and_others_go_on() -> None:
    reg = Registry(heartbeat_timeout_s=TIMEOUT)
    heard: list[str] = []
    stop_first = reg.watch(lambda: heard.append("first"))
    reg.watch(lambda: heard.append("second"))
    reg.hello("a", info(), 0.0)
    stop_first()
    stop_first()  # twice is harmless
    reg.heartbeat("a", hb(), 0.0)
    assert heard == ["first", "second", "second"]


def test_a_watcher_sees_the_change_already_made() -> None:
    reg = Registry(heartbeat_timeout_s=TIMEOUT)
    reg.hello("a", info(), 0.0)
    seen: list[bool] = []
    reg.watch(lambda: seen.append(reg.snapshot().by_id["a"].admin_draining))
    reg.set_admin_drain("a", True)
    assert seen == [True]
