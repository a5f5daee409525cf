"""What agents report is brought into range before routing reads it, and routing answers whatever
numbers a heartbeat carries (issue 31: one ``tpot_s = -0.05`` failed every request for its model)."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.errors import NoCapacity
from vllm_disagg.orchestrator.scheduling.framework import SchedulingRequest
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.metrics_check import MAX_COUNTER, MAX_QUEUE, MetricsCheck, checked
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, KvLinkCount, MetricsSnapshot, Role

NOW = 1000.0
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
ANY_INT = st.integers(min_value=-(2**63), max_value=2**64)
OPTIONAL_FLOAT = st.none() | ANY_FLOAT
OPTIONAL_INT = st.none() | ANY_INT

metrics_strategy = st.builds(
    MetricsSnapshot,
    scraped_at=ANY_FLOAT,
    num_running=ANY_INT,
    num_waiting=ANY_INT,
    kv_cache_usage=ANY_FLOAT,
    ttft_s=OPTIONAL_FLOAT,
    tpot_s=OPTIONAL_FLOAT,
    prefix_cache_hit_rate=OPTIONAL_FLOAT,
    window_s=ANY_FLOAT,
    requests_finished=ANY_INT,
    prompt_tokens=ANY_INT,
    generation_tokens=ANY_INT,
    queue_s=OPTIONAL_FLOAT,
    prefill_tokens_per_s=OPTIONAL_FLOAT,
    mean_prompt_tokens=OPTIONAL_FLOAT,
    prompt_tokens_computed=OPTIONAL_INT,
    prompt_tokens_cached=OPTIONAL_INT,
    prompt_tokens_transferred=OPTIONAL_INT,
    age_s=ANY_FLOAT,
    sent_at=ANY_FLOAT,
    kv_in_bytes=OPTIONAL_FLOAT,
    kv_in_seconds=OPTIONAL_FLOAT,
    kv_in_transfers=OPTIONAL_INT,
    kv_in_links=st.lists(
        st.builds(KvLinkCount, st.just("tcp://p:1"), ANY_INT, ANY_FLOAT, ANY_INT), max_size=2
    ),
)


def in_range(m: MetricsSnapshot) -> None:
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if isinstance(value, float):
            assert math.isfinite(value) and value >= 0, f.name
        elif isinstance(value, int):
            assert 0 <= value <= MAX_COUNTER, f.name
    assert 0.0 <= m.kv_cache_usage <= 1.0
    assert m.prefix_cache_hit_rate is None or 0.0 <= m.prefix_cache_hit_rate <= 1.0
    assert m.num_running <= MAX_QUEUE and m.num_waiting <= MAX_QUEUE
    for link in m.kv_in_links:
        assert 0 <= link.nbytes <= MAX_COUNTER and 0 <= link.transfers <= MAX_COUNTER
        assert math.isfinite(link.seconds) and link.seconds >= 0


@settings(max_examples=300, deadline=None)
@given(metrics_strategy)
def test_every_figure_comes_out_in_range_and_a_second_check_changes_nothing(m: MetricsSnapshot) -> None:
    sane, fixed = checked(m)
    in_range(sane)
    assert checked(sane) == (sane, ())
    assert (sane is m) == (not fixed)


def test_figures_in_range_pass_as_they_are_and_bad_ones_become_unknown_or_bounded() -> None:
    good = MetricsSnapshot(
        num_running=3, kv_cache_usage=0.4, ttft_s=0.2, tpot_s=0.02, prefix_cache_hit_rate=0.5
    )
    assert checked(good) == (good, ())
    bad = MetricsSnapshot(
        num_running=-2,
        num_waiting=10**12,
        kv_cache_usage=math.nan,
        tpot_s=-0.05,
        ttft_s=math.inf,
        queue_s=math.nan,
    )
    sane, fixed = checked(bad)
    assert (sane.num_running, sane.num_waiting) == (0, MAX_QUEUE)
    assert sane.kv_cache_usage == 1.0, "a usage that is not a number counts as full: it draws nothing"
    assert (sane.tpot_s, sane.ttft_s, sane.queue_s) == (None, None, None), "unknown, as with no samples"
    assert fixed == ("kv_cache_usage", "num_running", "num_waiting", "queue_s", "tpot_s", "ttft_s")
    assert checked(MetricsSnapshot(kv_cache_usage=1.7))[0].kv_cache_usage == 1.0
    assert checked(MetricsSnapshot(kv_cache_usage=-0.1))[0].kv_cache_usage == 0.0


def test_the_log_names_an_agents_bad_fields_once_until_they_come_back_in_range(
    caplog: pytest.LogCaptureFixture,
) -> None:
    check = MetricsCheck()
    bad = MetricsSnapshot(tpot_s=-0.05)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert check("d1", bad).tpot_s is None
        check("d1", MetricsSnapshot(tpot_s=0.02))
        check("d1", bad)
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2 and all(m.startswith("d1 reported tpot_s out of range") for m in told), told


def registry_with(metrics: dict[str, MetricsSnapshot]) -> Registry:
    reg = Registry(heartbeat_timeout_s=60.0)
    for agent_id, m in metrics.items():
        role: Role = "prefill" if agent_id.startswith("p") else "decode"
        reg.hello(agent_id, InstanceInfo(url=f"http://{agent_id}:8000", role=role, model="m"), NOW)
        reg.heartbeat(agent_id, Heartbeat(seq=1, engine_state="ready", metrics=m), NOW)
    return reg


def test_a_negative_tpot_neither_fails_routing_nor_draws_the_traffic() -> None:
    honest = MetricsSnapshot(num_running=1, tpot_s=0.01, ttft_s=0.1)
    scheduler = PluginScheduler()
    for tpot in (-0.05, -0.0499, math.nan, -math.inf):  # -0.05 divided by zero; -0.0499 drew the traffic
        forged = dataclasses.replace(honest, tpot_s=tpot)
        reg = registry_with({"p0": honest, "d0": honest, "d1": forged})
        picks = set()
        for i in range(20):
            request = SchedulingRequest(
                request_id=f"r{i}", model="m", prompt_len=100, is_chat=False, stream=False
            )
            picks.add(scheduler.decide(request, reg.snapshot(), NOW).decode)
        assert reg.snapshot().by_id["d1"].metrics.tpot_s is None, "kept as unknown: the default TPOT"
        assert picks == {"d0"}, f"tpot_s={tpot}: the measured 10 ms beats the default 20 ms every time"


@settings(max_examples=200, deadline=None)
@given(st.lists(metrics_strategy, min_size=4, max_size=4), st.integers(0, 10**6), st.booleans())
def test_routing_answers_whatever_numbers_the_heartbeats_carry(
    metrics: list[MetricsSnapshot], prompt_len: int, stream: bool
) -> None:
    reg = registry_with(dict(zip(("p0", "p1", "d0", "d1"), metrics, strict=True)))
    request = SchedulingRequest(
        request_id="r", model="m", prompt_len=prompt_len, is_chat=False, stream=stream
    )
    try:
        decision = PluginScheduler().decide(request, reg.snapshot(), NOW)
    except NoCapacity:  # every decode instance full, say: a 503 with its reason, not a failure
        return
    assert decision.decode in ("d0", "d1")
    assert decision.explanation is not None
    assert "nan" not in str(decision.explanation.to_json()).lower(), "every score a number"
