"""The cluster simulator's engine on virtual time: steps, batching, KV capacity, prefix hits, chunked
prefill, held KV and death, each checked against the arithmetic of its profile."""

from __future__ import annotations

import pytest

from vllm_disagg.cluster_sim.engine import Engine, Leg
from vllm_disagg.cluster_sim.profile import EngineProfile
from vllm_disagg.cluster_sim.virtual_clock import EventLoop, VirtualClock
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens
from vllm_disagg.protocol.messages import KvEvent

PROFILE = EngineProfile(
    "test", block_size=4, num_blocks=64, max_num_seqs=4, prefill_s_per_token=0.01, decode_step_s=0.1,
    decode_step_s_per_seq=0.01,
)  # fmt: skip


class Seen:
    """When each leg's first and last token came, and the tokens failed legs had."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.failed: dict[str, int] = {}

    def leg(self, rid: str, prompt: list[int], n: int, **kwargs: object) -> Leg:
        return Leg(
            rid, PromptTokens(prompt), n,
            on_first=lambda leg, t: self.first.__setitem__(rid, t),
            on_done=lambda leg, t: self.done.__setitem__(rid, t),
            on_fail=lambda leg, k: self.failed.__setitem__(rid, k),
            **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip


def engine(profile: EngineProfile = PROFILE, events: list[KvEvent] | None = None) -> tuple[Engine, EventLoop]:
    loop = EventLoop(VirtualClock())
    sink = None if events is None else (lambda _id, evs: events.extend(evs))
    return Engine("e", profile, loop, sink), loop


def test_a_lone_request_takes_one_prefill_step_then_one_step_per_token() -> None:
    e, loop = engine()
    seen = Seen()
    e.submit(seen.leg("a", list(range(10)), 3))
    loop.run()
    step = 0.1 + 0.01  # one sequence in the batch
    assert seen.first["a"] == pytest.approx(10 * 0.01 + step)  # the step that prefills samples a token
    assert seen.done["a"] == pytest.approx(10 * 0.01 + 3 * step)
    assert e.steps == 3 and e.finished == 1 and not e.running and e.reserved == 0


def test_a_request_arriving_mid_step_joins_the_batch_at_the_next_step() -> None:
    e, loop = engine()
    seen = Seen()
    e.submit(seen.leg("a", list(range(8)), 4))
    loop.at(0.05, lambda: e.submit(seen.leg("b", list(range(100, 108)), 2)))
    loop.run()
    first_a = 8 * 0.01 + 0.11
    assert seen.first["a"] == pytest.approx(first_a)
    # b waits for a's first step to end, then shares steps (batch of 2: 0.12 s each).
    assert seen.first["b"] == pytest.approx(first_a + 8 * 0.01 + 0.12)
    assert seen.done["b"] == pytest.approx(first_a + 8 * 0.01 + 2 * 0.12)


def test_the_batch_is_capped_and_the_queue_is_fcfs() -> None:
    e, loop = engine(PROFILE.replace(max_num_seqs=2))
    seen = Seen()
    for rid in "abc":
        e.submit(seen.leg(rid, [ord(rid)] * 4, 2))
    loop.run()
    assert seen.first["a"] == seen.first["b"] < seen.first["c"]
    assert seen.first["c"] >= seen.done["a"]  # c got in when a slot freed


def test_kv_blocks_for_prompt_and_output_are_reserved_and_the_head_of_the_queue_waits_for_room() -> None:
    e, loop = engine(PROFILE.replace(num_blocks=6))  # 4-token blocks
    seen = Seen()
    e.submit(seen.leg("a", list(range(12)), 4))  # 16 tokens: 4 blocks
    e.submit(seen.leg("b", list(range(100, 112)), 4))  # 4 more do not fit beside a
    loop.run(until=0.3)
    assert e.reserved == 4 and [leg.request_id for leg in e.waiting] == ["b"]
    loop.run()
    assert seen.first["b"] >= seen.done["a"]


def test_a_repeated_prefix_is_a_cache_hit_and_only_the_rest_is_prefilled() -> None:
    events: list[KvEvent] = []
    e, loop = engine(events=events)
    seen = Seen()
    prompt = list(range(16))
    e.submit(seen.leg("a", prompt, 1))
    loop.run()
    e.submit(seen.leg("b", [*prompt[:12], 99, 98, 97, 96], 1))
    started = loop.clock.now
    loop.run()
    # 3 blocks of 4 cached; as vLLM, the prompt's last token is always computed: 4 tokens here.
    assert e.cached_tokens == 12 and seen.first["b"] - started == pytest.approx(4 * 0.01 + 0.11)
    assert [ev.kind for ev in events] == ["stored", "stored"]
    assert len(events[0].block_hashes) == 4 and len(events[1].block_hashes) == 1


def test_kv_from_a_prefill_engine_is_not_computed_and_a_prefill_leg_holds_its_kv_until_released() -> None:
    p, loop = engine()
    seen = Seen()
    p.submit(seen.leg("a", list(range(10)), 1, hold=True))
    loop.run(until=1.0)
    assert p.held == {"a": 3} and p.held_blocks == 3  # the partial last block too
    p.release_hold("a")
    assert p.held_blocks == 0
    p.submit(seen.leg("z", list(range(50, 60)), 1, hold=True))
    loop.run()  # never pulled: freed when vLLM's 30 s lease ends
    assert p.held_blocks == 0 and loop.clock.now == pytest.approx(1.0 + 10 * 0.01 + 0.11 + 30.0)
    d, loop = engine()
    d.submit(seen.leg("d", list(range(10)), 2, external=10))
    loop.run()
    assert d.computed_tokens == 0 and d.external_tokens == 10
    assert seen.first["d"] == pytest.approx(0.11)


def test_chunked_prefill_spreads_a_long_prompt_over_steps_within_the_budget() -> None:
    e, loop = engine(PROFILE.replace(max_batched_tokens=8, num_blocks=256))
    seen = Seen()
    e.submit(seen.leg("a", list(range(20)), 1))
    loop.run()
    assert e.steps == 3  # 8 + 8 + 4 prompt tokens; the first token comes with the last chunk
    assert seen.first["a"] == pytest.approx(20 * 0.01 + 3 * 0.11)


def test_a_killed_engine_fails_its_legs_with_the_tokens_they_had_and_forgets_its_cache() -> None:
    e, loop = engine()
    seen = Seen()
    e.submit(seen.leg("a", list(range(8)), 10))
    loop.run(until=8 * 0.01 + 3 * 0.11 + 0.001)  # three steps: three tokens
    e.submit(seen.leg("b", list(range(50, 58)), 10))
    e.kill()
    loop.run()
    assert seen.failed == {"a": 3, "b": 0} and not seen.done
    assert not e.alive and len(e.cache) == 0 and e.reserved == 0
    e.revive()
    e.submit(seen.leg("c", list(range(8)), 1))
    loop.run()
    assert "c" in seen.done and e.cached_tokens == 0  # the old cache is gone


def test_the_heartbeat_snapshot_reports_the_queue_the_kv_use_and_windowed_latencies() -> None:
    e, loop = engine()
    seen = Seen()
    e.submit(seen.leg("a", list(range(8)), 2))
    loop.run()
    snap = e.snapshot(loop.clock.now)
    assert snap.num_running == 0 and snap.requests_finished == 1
    assert snap.ttft_s == pytest.approx(seen.first["a"]) and snap.tpot_s == pytest.approx(0.11)
    assert snap.prefill_tokens_per_s == pytest.approx(8 / seen.first["a"])
    assert e.snapshot(loop.clock.now + 60).ttft_s is None  # out of the 10 s window
