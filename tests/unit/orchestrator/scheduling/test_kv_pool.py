"""The kv-pool-decider with the shipped config: a request whose every full block some agent's KV pool
holds goes straight to its decode instance (colocated, ``kv_source`` the holder), with a reason that
says whose pool; anything short of that is decided as before."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pytest

from vllm_disagg.orchestrator.scheduling.config import default_config_text, load_config
from vllm_disagg.orchestrator.scheduling.framework import NO_CACHE, Decision, SchedulingRequest
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.deciders import kv_pool
from vllm_disagg.orchestrator.scheduling.scheduler import PluginScheduler
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.orchestrator.state.views import RegistrySnapshot
from vllm_disagg.protocol.messages import Heartbeat, InstanceInfo, MetricsSnapshot, Role

NOW = 1000.0
SCHEDULER = PluginScheduler()
PROMPT = 4 * 16 + 5  # four full blocks of 16 and a partial one
FULL = 4 * 16


@dataclass(frozen=True)
class Inst:
    id: str
    role: Role
    connector: str = "vllm-disagg"
    pool: bool = True  # serves a KV pool (kv_pool_endpoint)
    block_size: int = 16
    revision: str = ""
    dead: bool = False
    in_flight: int = 0
    node: str = ""  # the agent whose pool it shares (its host's); "": its own


P0, P1, D0 = Inst("p0", "prefill"), Inst("p1", "prefill"), Inst("d0", "decode")


def snapshot(*instances: Inst) -> RegistrySnapshot:
    reg = Registry(heartbeat_timeout_s=1.0)
    for i in instances:
        info = InstanceInfo(
            url=f"http://{i.id}:8000",
            role=i.role,
            model="m",
            block_size=i.block_size,
            kv_connector=i.connector,
            revision=i.revision,
            kv_pool_endpoint=f"tcp://{i.id}:11000" if i.pool and not i.node else "",
            kv_pool_node=i.node,
        )
        reg.hello(i.id, info, NOW)
        reg.heartbeat(i.id, Heartbeat(seq=1, engine_state="ready", metrics=MetricsSnapshot()), NOW)
        if i.dead:
            reg.goodbye(i.id)
        for _ in range(i.in_flight):
            reg.acquire(i.id)
    return reg.snapshot()


def request(
    pooled: Mapping[str, int], *, prompt_len: int = PROMPT, tokenized: bool = True, pin: str | None = None
) -> SchedulingRequest:
    return SchedulingRequest(
        "r1",
        "m",
        prompt_len,
        False,
        False,
        NO_CACHE,
        tokenized,
        pin,
        pooled_tokens=MappingProxyType(dict(pooled)),
    )


def decide(instances: tuple[Inst, ...], pooled: Mapping[str, int], **kwargs: Any) -> Decision:
    return SCHEDULER.decide(request(pooled, **kwargs), snapshot(*instances), NOW)


@pytest.mark.parametrize(
    ("instances", "pooled", "kv_source", "reason"),
    [
        pytest.param(
            (P0, D0),
            {"d0": FULL},
            "d0",
            "straight to decode: d0's own KV pool holds all 4 blocks of the prompt",
            id="the decode instance's own pool holds the prompt: nothing moves",
        ),
        pytest.param(
            (P0, D0),
            {"p0": FULL},
            "p0",
            "straight to decode: p0's KV pool holds all 4 blocks of the prompt; d0 fetches them from there",
            id="another agent's pool holds it: D fetches from there",
        ),
        pytest.param(
            (P0, D0),
            {"p0": FULL, "d0": FULL},
            "d0",
            "straight to decode: d0's own KV pool holds all 4 blocks of the prompt",
            id="its own pool wins over another's",
        ),
        pytest.param(
            (P0, P1, Inst("p0x", "prefill", in_flight=3), D0),
            {"p0x": FULL, "p1": FULL},
            "p1",
            "straight to decode: p1's KV pool holds all 4 blocks",
            id="of several holders the least busy",
        ),
    ],
)
def test_a_prompt_a_pool_holds_whole_goes_straight_to_decode(
    instances: tuple[Inst, ...], pooled: Mapping[str, int], kv_source: str, reason: str
) -> None:
    decision = decide(instances, pooled)
    assert (decision.mode, decision.prefill, decision.decode, decision.kv_source) == (
        "colocated",
        None,
        "d0",
        kv_source,
    )
    assert decision.explanation is not None
    explained = decision.explanation.to_json()
    decider = explained["decider"]
    assert decider["plugin"] == "kv-pool-decider"  # type: ignore[index]
    assert decider["reason"].startswith(reason)  # type: ignore[index]
    assert decider["kv_source"] == kv_source  # type: ignore[index]
    assert explained["prefill"] is None, "the prefill profile is not run"
    assert explained["request"]["pooled_tokens"] == dict(pooled)  # type: ignore[index]


@pytest.mark.parametrize(
    ("instances", "pooled", "kwargs"),
    [
        pytest.param((P0, D0), {}, {}, id="no pool holds anything"),
        pytest.param((P0, D0), {"p0": FULL - 16}, {}, id="a pool holds 3 of the 4 full blocks"),
        pytest.param((P0, D0), {"p0": FULL}, {"tokenized": False}, id="the prompt's ids are an estimate"),
        pytest.param((P0, D0), {"p0": 0}, {"prompt_len": 15}, id="a prompt without a full block"),
        pytest.param(
            (
                Inst("p0", "prefill", connector="NixlConnector", pool=False),
                Inst("d0", "decode", "NixlConnector", False),
            ),
            {"p0": FULL},
            {},
            id="a decode instance without the connector",
        ),
        pytest.param(
            (Inst("p0", "prefill", pool=False), D0), {"p0": FULL}, {}, id="a holder serving no pool"
        ),
        pytest.param((P0, Inst("d0", "decode", pool=False)), {"p0": FULL}, {}, id="a decode without a pool"),
        pytest.param((P0, Inst("px", "prefill", dead=True), D0), {"px": FULL}, {}, id="a dead holder"),
        pytest.param(
            (P0, Inst("px", "prefill", revision="r2"), D0),
            {"px": FULL},
            {},
            id="a holder of another revision",
        ),
        pytest.param((P0, D0), {"p0": FULL}, {"pin": "p0"}, id="a client that pinned its prefill instance"),
    ],
)
def test_anything_short_of_a_whole_prompt_in_a_usable_pool_is_decided_as_before(
    instances: tuple[Inst, ...], pooled: Mapping[str, int], kwargs: dict[str, Any]
) -> None:
    decision = decide(instances, pooled, **kwargs)
    assert decision.kv_source is None
    assert (decision.mode, decision.prefill) == ("disaggregated", "p0")


def test_min_blocks_is_a_parameter_checked_like_the_others() -> None:
    text = default_config_text().replace("minBlocks: 1", "minBlocks: 8")
    scheduler = PluginScheduler(load_config(text, "t"))
    decision = scheduler.decide(request({"p0": FULL}), snapshot(P0, D0), NOW)
    assert (decision.mode, decision.kv_source) == ("disaggregated", None), "4 blocks are fewer than 8"
    with pytest.raises(ValueError, match=r"^kv-pool-decider: min_blocks must be >= 1, got 0"):
        kv_pool.Params(min_blocks=0)
    with pytest.raises(ValueError, match=r"^kv-pool-decider: threshold must be >= 0"):
        kv_pool.Params(threshold=-1)


def test_the_decider_is_registered_and_otherwise_decides_as_uncached_tokens() -> None:
    spec = PLUGIN_SPECS["kv-pool-decider"]
    assert (spec.kind, spec.params) == ("decider", kv_pool.Params)
    decider = spec.factory("mine", kv_pool.Params(threshold=512))
    assert (decider.TYPE, decider.name) == ("kv-pool-decider", "mine")
    decision = PluginScheduler(
        load_config(default_config_text().replace("threshold: 0", "threshold: 512"), "t")
    ).decide(request({}, prompt_len=100), snapshot(P0, D0), NOW)
    assert decision.mode == "colocated" and decision.kv_source is None
    assert decision.explanation is not None
    assert "only 100 uncached prompt tokens (below threshold 512)" in str(decision.explanation.to_json())


D1 = Inst("d1", "decode")


@pytest.mark.parametrize("held", [FULL, 2 * 16], ids=["whole prompt", "two of its blocks"])
def test_the_decode_profile_prefers_an_instance_whose_own_pool_holds_the_prompt(held: int) -> None:
    # Two decode instances alike in every figure: only d1's own pool holds (part of) the prompt.
    picks = {
        SCHEDULER.decide(
            dataclasses.replace(request({"d1": held}), request_id=f"r{i}"), snapshot(P0, D0, D1), NOW
        ).decode
        for i in range(40)
    }
    assert picks == {"d1"}


def test_another_instances_pool_does_not_make_a_decode_instance_look_cached() -> None:
    # p0's pool holds a part of the prompt (too little to go straight to decode): neither D holds it,
    # so the two alike decode instances share the requests as they would with no pool at all.
    picks = {
        SCHEDULER.decide(
            dataclasses.replace(request({"p0": 2 * 16}), request_id=f"r{i}"), snapshot(P0, D0, D1), NOW
        ).decode
        for i in range(40)
    }
    assert picks == {"d0", "d1"}


D1_ON_P0 = Inst("d1", "decode", node="p0")  # shares p0's host pool


def test_a_decode_instance_sharing_the_host_pool_that_holds_the_prompt_loads_it_with_no_move() -> None:
    decision = decide((P0, D0, D1_ON_P0), {"p0": FULL})
    assert (decision.mode, decision.decode, decision.kv_source) == ("colocated", "d1", "d1")
    assert decision.explanation is not None
    assert "d1's host's KV pool holds all 4 blocks" in str(decision.explanation.to_json())


def test_the_decode_profile_counts_the_host_pool_as_its_cache() -> None:
    picks = {
        SCHEDULER.decide(
            dataclasses.replace(request({"p0": 2 * 16}), request_id=f"r{i}"), snapshot(P0, D0, D1_ON_P0), NOW
        ).decode
        for i in range(40)
    }
    assert picks == {"d1"}
