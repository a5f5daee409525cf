"""The chaos load spread over replicas (``chaos/spread.py``), against real HTTP servers on loopback: the
rotation, a refused connection tried on the next replica, failures on a killed replica told apart, the
replicas' counters summed; and the ``--replicas`` flags refused before anything starts."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from tests.chaos.test_chaos_parts import gateway_stub, planner
from tests.helpers import eventually, free_port
from vllm_disagg.chaos.check import Checker
from vllm_disagg.chaos.load import LoadConfig, LoadGenerator, Tally
from vllm_disagg.chaos.report import RECOVERY_COUNTERS, ChaosReport, counter_growth
from vllm_disagg.chaos.spread import NO_REPLICA, Targets, health_check, post_spread
from vllm_disagg.cli.commands import main


def test_requests_go_round_robin_over_the_replicas_in_rotation() -> None:
    targets = Targets(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    assert [targets.pick(set()) for _ in range(4)] == [0, 1, 2, 0]
    targets.take_out(2)
    assert [targets.pick(set()) for _ in range(3)] == [1, 0, 1]
    assert targets.pick({0, 1}) is None and targets.in_rotation == [0, 1]
    targets.put_back(2)
    assert targets.in_rotation == [0, 1, 2]


def test_when_the_health_check_failed_every_replica_in_service_the_requests_fail_open_to_them() -> None:
    """As a load balancer does (Envoy's panic threshold): checks that timed out on a stalled host must not
    leave the requests nowhere to go; a replica taken out stays out, and a refusal by a healthy one is
    not a failed check."""
    targets = Targets(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    targets.take_out(0)
    targets.checked(1, False)
    assert [targets.pick(set()) for _ in range(2)] == [2, 2], "the one healthy replica, while there is one"
    assert targets.pick({2}) is None, "a healthy replica refused: not a reason to fail open"
    targets.checked(2, False)
    assert [targets.pick(set()) for _ in range(3)] == [1, 2, 1], "every one in service failed its check"
    assert targets.pick({1, 2}) is None, "never to the replica taken out"


def test_a_request_fails_on_a_killed_replica_only_when_the_kill_came_while_it_ran() -> None:
    targets = Targets(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    targets.killed(1, at=10.0)
    assert targets.killed_between(1, 9.0, 11.0)
    assert not targets.killed_between(1, 10.5, 12.0) and not targets.killed_between(1, 8.0, 9.5)
    assert not targets.killed_between(0, 9.0, 11.0)


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_a_refused_connection_goes_to_the_next_replica_and_an_error_answer_does_not() -> None:
    refusing = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def failing(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async with gateway_stub(_ok) as up, gateway_stub(failing) as erring, aiohttp.ClientSession() as http:
        targets = Targets([refusing, up])
        answer = await post_spread(http, targets, "/v1/completions", b"{}", {}, 5.0)
        assert (answer.replica, answer.status, answer.body, answer.refused) == (1, 200, b"ok", 1)
        targets = Targets([erring, up])
        answer = await post_spread(http, targets, "/v1/completions", b"{}", {}, 5.0)
        assert (answer.replica, answer.status, answer.body, answer.refused) == (0, 500, b"boom", 0)
        answer = await post_spread(http, Targets([refusing]), "/v1/completions", b"{}", {}, 5.0)
        assert (answer.replica, answer.status, answer.refused) == (NO_REPLICA, None, 1)
        assert "refused" in answer.error


async def test_the_health_check_takes_a_failing_replica_out_and_puts_it_back_once_it_passes() -> None:
    healthy = {"now": True}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if healthy["now"] else 503)

    app = web.Application()
    app.router.add_get("/health/ready", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    refusing = f"http://127.0.0.1:{free_port()}"  # nothing listens there: fails the check too
    try:
        targets = Targets([f"http://127.0.0.1:{runner.addresses[0][1]}", refusing])
        targets.take_out(0)  # the check's verdict does not undo a take_out
        checks = asyncio.ensure_future(health_check(targets, "/health/ready", 0.01))
        try:
            await eventually(lambda: targets.in_rotation == [], what="the refusing replica out")
            targets.put_back(0)
            assert targets.in_rotation == [0]
            healthy["now"] = False
            await eventually(lambda: targets.in_rotation == [], what="the failing replica out")
            assert targets.pick(set()) in (0, 1), "every replica failed its check: the requests fail open"
            healthy["now"] = True
            await eventually(lambda: targets.in_rotation == [0], what="the passing replica back")
        finally:
            checks.cancel()
    finally:
        await runner.cleanup()


async def test_a_failure_on_a_replica_killed_while_the_request_ran_is_counted_apart() -> None:
    arrived = asyncio.Event()

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        arrived.set()
        await asyncio.sleep(0.3)
        assert request.transport is not None
        request.transport.abort()  # the replica dies mid-answer
        return resp

    async with gateway_stub(cut) as dying, gateway_stub(_ok) as live:
        cfg = LoadConfig(dying, "sim-model", 1, 30, 1, request_timeout_s=10, replica_urls=(dying, live))
        load = LoadGenerator(cfg, planner(1), Checker("sim-model"), Tally())
        running = asyncio.ensure_future(load.run(asyncio.Event()))
        await asyncio.wait_for(arrived.wait(), timeout=10)
        load.targets.take_out(0)
        load.targets.killed(0, time.monotonic())
        await asyncio.wait_for(running, timeout=30)
    tally = load.tally
    assert (tally.sent, tally.failed, tally.failed_on_killed_replicas) == (1, 1, 1)
    assert tally.per_replica == {0: {"killed": 1}}
    assert tally.examples["failed"][0]["on_killed_replica"] is True
    report = ChaosReport(
        1, 0, 1, 0, 0, 0, 0, 1.0, [], tally.examples, replicas=2, failed_on_killed_replicas=1
    )
    assert report.ok and report.failed_on_live_replicas == 0


def test_the_replicas_counters_are_summed_and_a_restarted_one_counts_from_its_restart() -> None:
    def counters(retries: float) -> dict[str, float]:
        return {**dict.fromkeys(RECOVERY_COUNTERS.values(), 0.0), "vllm_disagg_retries_total": retries}

    # Replica 0 grew from 5 to 8; replica 1 was restarted (7 before, 2 now: 2 since its restart).
    growth = counter_growth([counters(5), counters(7)], [counters(8), counters(2)])
    assert growth == {**dict.fromkeys(RECOVERY_COUNTERS, 0), "retried": 5}


@pytest.mark.parametrize(
    "flags",
    [
        ["--replicas", "1"],
        ["--replicas", "-2"],
        ["--kinds", "replica"],
        ["--replicas", "3", "--lease-ttl-s", "1"],
        ["--replicas", "3", "--kinds", "engine,node"],
    ],
    ids=[
        "one-replica",
        "negative",
        "replica-kills-without-replicas",
        "ttl-below-etcds-minimum",
        "unknown-kind",
    ],
)
def test_bad_replica_flags_are_refused_before_anything_starts(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chaos", *flags]) == 2
    assert "configuration error" in capsys.readouterr().err
