"""Ready means its KV link works: a NIXL engine is joining until a warm-up proved its link, again after
each restart of its engine; engines that need no handshake are ready with their engine."""

from __future__ import annotations

import random

import pytest

from vllm_disagg.orchestrator.kv_warmup import is_pending, partner_pair, warmup_prompt
from vllm_disagg.orchestrator.state.health import derive_state
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.messages import EngineState, Heartbeat, InstanceInfo, Role

NIXL = {"engine": "vllm", "kv_connector": "NixlConnector"}


def info(role: Role, port: int, **kw: object) -> InstanceInfo:
    fields: dict[str, object] = {**NIXL, "block_size": 16, **kw}
    return InstanceInfo(url=f"http://127.0.0.1:{port}", role=role, model="m", **fields)  # type: ignore[arg-type]


def engine(reg: Registry, agent_id: str, state: EngineState, seq: int = 1) -> None:
    assert reg.heartbeat(agent_id, Heartbeat(seq=seq, engine_state=state), 0.0) is not None


def test_a_ready_engine_with_an_unproven_link_is_joining_and_nothing_else_changes() -> None:
    common = {"draining": False, "cordoned": False, "late": False, "breaker_routable": True}
    assert derive_state(engine_state="ready", kv_link_ready=False, **common) == "joining"
    assert derive_state(engine_state="ready", kv_link_ready=True, **common) == "ready"
    assert (
        derive_state(engine_state="ready", kv_link_ready=False, **{**common, "cordoned": True}) == "cordoned"
    )
    assert derive_state(engine_state="unhealthy", kv_link_ready=False, **common) == "suspect"


def test_a_nixl_engine_is_routed_to_only_once_its_link_is_proven_in_its_session() -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    reg.hello("d0", info("decode", 9001), 0.0)
    engine(reg, "d0", "ready")
    view = reg.get("d0")
    assert view is not None and (view.state, view.kv_link_ready) == ("joining", False)
    assert "d0" not in reg.snapshot().decode_ids.get("m", ())
    assert reg.kv_link_proven("d0", session=view.session + 1) is None  # another session's warm-up
    assert reg.get("d0").state == "joining"  # type: ignore[union-attr]
    proven = reg.kv_link_proven("d0", view.session)
    assert proven is not None and (proven.state, proven.kv_link_ready) == ("ready", True)
    assert reg.snapshot().decode_ids["m"] == ("d0",)


@pytest.mark.parametrize("between", ["unhealthy", "restarting", "starting"])
def test_an_engine_that_stopped_serving_proves_its_link_again_when_it_is_back(between: EngineState) -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    session = reg.hello("p0", info("prefill", 9000), 0.0).session
    engine(reg, "p0", "ready")
    reg.kv_link_proven("p0", session)
    engine(reg, "p0", between, seq=2)
    engine(reg, "p0", "ready", seq=3)  # a new engine, maybe: a new NIXL agent, no handshake done
    assert reg.get("p0").state == "joining"  # type: ignore[union-attr]
    reg.kv_link_proven("p0", session)
    reg.engine_restarting("p0", "role change")
    engine(reg, "p0", "ready", seq=4)
    assert reg.get("p0").state == "joining"  # type: ignore[union-attr]


def test_a_nixl_engine_that_changes_duty_by_routing_proves_a_link_in_its_new_duty_first() -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    session = reg.hello("a", info("both", 9000), 0.0).session
    engine(reg, "a", "ready")
    reg.kv_link_proven("a", session)
    reg.set_role("a", "both")  # no change: nothing to prove
    assert reg.get("a").state == "ready"  # type: ignore[union-attr]
    view = reg.set_role("a", "decode")
    assert (view.state, view.kv_link_ready, view.session) == ("joining", False, session)
    assert "a" not in reg.snapshot().decode_ids.get("m", ()) and reg.unproven() == {"a"}
    proven = reg.kv_link_proven("a", session)
    assert proven is not None and proven.state == "ready" and reg.snapshot().decode_ids["m"] == ("a",)
    sim = reg.hello("s", info("prefill", 9001, engine="sim"), 0.0)  # needs no proof: moves ready
    engine(reg, "s", "ready")
    assert reg.set_role("s", "decode").state == "ready" and sim.kv_link_ready


def test_the_registry_lists_the_instances_whose_link_is_still_to_prove_as_their_views_change() -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    p0 = reg.hello("p0", info("prefill", 9000), 0.0)
    reg.hello("sim", info("decode", 9001, engine="sim"), 0.0)  # needs no proof: never listed
    engine(reg, "sim", "ready")
    assert reg.unproven() == {"p0"}  # listed from its hello, engine starting or not
    engine(reg, "p0", "ready")
    reg.kv_link_proven("p0", p0.session)
    assert reg.unproven() == frozenset()  # the warm-up's scan then reads no view at all
    engine(reg, "p0", "restarting", seq=2)
    assert reg.unproven() == {"p0"}  # its next engine proves its link again
    reg.goodbye("p0", "stopped")
    reg.remove("p0")
    assert reg.unproven() == frozenset()  # forgotten with its instance


def test_a_registry_whose_owner_runs_no_warm_up_asks_for_no_proof() -> None:
    reg = Registry(heartbeat_timeout_s=10.0)  # a benchmark's, a simulator's: nobody sends warm-ups
    reg.hello("d0", info("decode", 9001), 0.0)
    engine(reg, "d0", "ready")
    assert reg.get("d0").state == "ready"  # type: ignore[union-attr]


def test_a_proof_for_an_engine_not_ready_now_is_not_taken() -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    session = reg.hello("p0", info("prefill", 9000), 0.0).session
    engine(reg, "p0", "ready")
    engine(reg, "p0", "restarting", seq=2)  # the warm-up answered from the engine that is going away
    assert reg.kv_link_proven("p0", session) is None
    engine(reg, "p0", "ready", seq=3)
    assert reg.get("p0").state == "joining"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "kw", [{"engine": "sim"}, {"kv_connector": ""}, {"kv_connector": "vllm-disagg"}], ids=str
)
def test_engines_whose_link_needs_no_handshake_are_ready_with_their_engine(kw: dict[str, str]) -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    reg.hello("d0", info("decode", 9001, **kw), 0.0)
    engine(reg, "d0", "ready")
    view = reg.get("d0")
    assert view is not None and (view.state, view.kv_link_ready) == ("ready", True)
    assert not is_pending(view)


def test_a_warm_up_pairs_the_other_side_able_to_exchange_kv_proven_ones_first() -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    reg.hello("d-other-block", info("decode", 9001, block_size=32), 0.0)
    reg.hello("d-new", info("decode", 9002), 0.0)
    reg.hello("d-proven", info("decode", 9003), 0.0)
    reg.hello("d-starting", info("decode", 9004), 0.0)
    reg.hello("p0", info("prefill", 9000), 0.0)
    for agent_id in ("d-other-block", "d-new", "d-proven", "p0"):
        engine(reg, agent_id, "ready")
    reg.kv_link_proven("d-proven", 1)
    snap = reg.snapshot()
    p0 = snap.by_id["p0"]
    assert is_pending(p0)
    pair = partner_pair(p0, snap)
    assert pair is not None and (pair.prefill.agent_id, pair.decode.agent_id) == ("p0", "d-proven")
    d_new = partner_pair(snap.by_id["d-new"], snap)
    assert d_new is not None and (d_new.prefill.agent_id, d_new.decode.agent_id) == ("p0", "d-new")
    assert partner_pair(snap.by_id["d-other-block"], snap) is None  # its KV fits no prefill instance


def test_a_warm_up_prompt_is_a_block_and_more_within_the_context_and_never_the_same() -> None:
    reg = Registry(heartbeat_timeout_s=10.0, prove_kv_links=True)
    wide = reg.hello("a", info("prefill", 9000, block_size=128, max_model_len=512), 0.0)
    narrow = reg.hello("b", info("prefill", 9001, block_size=128, max_model_len=100), 0.0)
    rng = random.Random(7)
    first, second = warmup_prompt(wide, rng), warmup_prompt(wide, rng)
    assert len(first) == len(second) > 128 and first != second
    assert all(3 <= t < 256 for t in first)
    assert len(warmup_prompt(narrow, rng)) == 98
