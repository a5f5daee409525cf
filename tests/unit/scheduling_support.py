"""In-memory instances, snapshots and contexts for the scheduling plugin tests (no Registry involved), and
the hypothesis strategies of the scheduling property tests."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from types import MappingProxyType

from hypothesis import strategies as st

from vllm_disagg.orchestrator.scheduling.framework import (
    NO_CACHE,
    ProfileContext,
    ProfileName,
    SchedulingRequest,
)
from vllm_disagg.orchestrator.scheduling.plugins.catalog import PLUGIN_SPECS
from vllm_disagg.orchestrator.scheduling.plugins.scorers import kv_usage, prefix, queue, tpot, ttft
from vllm_disagg.orchestrator.state.registry import InstanceState
from vllm_disagg.orchestrator.state.views import DECODE_ROLES, PREFILL_ROLES, InstanceView, RegistrySnapshot
from vllm_disagg.protocol.messages import InstanceInfo, MetricsSnapshot, Role

MODEL = "m"

_SNAPSHOT_IDS = itertools.count(10_000)


def view(
    agent_id: str,
    *,
    role: Role = "both",
    state: InstanceState = "ready",
    agent_draining: bool = False,
    admin_draining: bool = False,
    model: str = MODEL,
    revision: str = "r1",
    block_size: int = 16,
    kv_connector: str = "NixlConnector",
    metrics: MetricsSnapshot | None = None,
) -> InstanceView:
    """One instance as a snapshot shows it; everything not given is a healthy, idle default."""
    return InstanceView(
        agent_id=agent_id,
        info=InstanceInfo(
            url=f"http://{agent_id}",
            role=role,
            model=model,
            revision=revision,
            block_size=block_size,
            kv_connector=kv_connector,
        ),
        state=state,
        session=1,
        engine_state="ready" if state == "ready" else "starting",
        agent_draining=agent_draining,
        admin_draining=admin_draining,
        joined_at=0.0,
        last_heartbeat=0.0,
        heartbeats=1,
        metrics=metrics if metrics is not None else MetricsSnapshot(),
        dead_reason="",
    )


def snapshot(*views: InstanceView, in_flight: Mapping[str, int] | None = None) -> RegistrySnapshot:
    """A snapshot holding ``views`` with the gateway's in-flight counts."""
    by_model: dict[str, list[str]] = {}
    prefill: dict[str, list[str]] = {}
    decode: dict[str, list[str]] = {}
    for v in sorted(views, key=lambda v: v.agent_id):
        by_model.setdefault(v.info.model, []).append(v.agent_id)
        if v.state == "ready" and v.info.role in PREFILL_ROLES:
            prefill.setdefault(v.info.model, []).append(v.agent_id)
        if v.state == "ready" and v.info.role in DECODE_ROLES:
            decode.setdefault(v.info.model, []).append(v.agent_id)
    return RegistrySnapshot(
        version=1,
        membership=1,
        registry_id=next(_SNAPSHOT_IDS),  # each made-up snapshot is its own registry: no shared cache
        by_id=MappingProxyType({v.agent_id: v for v in views}),
        in_flight=MappingProxyType(dict(in_flight or {})),
        known_models=frozenset(v.info.model for v in views),
        model_ids=MappingProxyType({m: tuple(ids) for m, ids in by_model.items()}),
        prefill_ids=MappingProxyType({m: tuple(ids) for m, ids in prefill.items()}),
        decode_ids=MappingProxyType({m: tuple(ids) for m, ids in decode.items()}),
    )


def request(
    request_id: str = "req-1", *, prompt_len: int = 1000, cached: Mapping[str, int] | None = None
) -> SchedulingRequest:
    """A chat request for ``MODEL`` with the given prefix-cache matches."""
    return SchedulingRequest(
        request_id=request_id,
        model=MODEL,
        prompt_len=prompt_len,
        is_chat=True,
        stream=False,
        cached_tokens=MappingProxyType(dict(cached)) if cached else NO_CACHE,
    )


def context(
    snap: RegistrySnapshot,
    *,
    profile: ProfileName = "decode",
    partner: InstanceView | None = None,
    req: SchedulingRequest | None = None,
) -> ProfileContext:
    """A profile context over ``snap`` for ``req`` (default: ``request()``)."""
    return ProfileContext(
        request=req if req is not None else request(),
        snapshot=snap,
        now=0.0,
        profile=profile,
        partner=partner,
    )


POSITIVE = st.floats(min_value=1e-3, max_value=1e3)
MAYBE = st.none() | st.just(0.0) | st.floats(min_value=0.0, max_value=10.0)
# Metrics as heartbeats bring them, broken scrapes included (NaN usage, negative or zero rates).
METRICS = st.builds(
    MetricsSnapshot,
    num_running=st.integers(0, 64),
    num_waiting=st.integers(0, 64),
    kv_cache_usage=st.floats(min_value=-0.5, max_value=1.5) | st.just(float("nan")),
    tpot_s=MAYBE,
    queue_s=MAYBE,
    prefill_tokens_per_s=MAYBE | st.floats(min_value=-5.0, max_value=0.0),
    mean_prompt_tokens=MAYBE,
    # the ttft-scorer falls back to its default rate where more prompt tokens came over KV transfer
    prompt_tokens_computed=st.none() | st.integers(0, 3),
    prompt_tokens_transferred=st.none() | st.integers(0, 3),
)
# Every scorer type with random parameters; a profile is any of them, in any order, any weight.
SCORERS = st.one_of(
    st.builds(queue.Params, max_queue=POSITIVE).map(lambda p: PLUGIN_SPECS[queue.TYPE].factory("q", p)),
    st.just(PLUGIN_SPECS[kv_usage.TYPE].factory("kv", kv_usage.Params())),
    st.builds(tpot.Params, slo_s=POSITIVE, default_tpot_s=POSITIVE).map(
        lambda p: PLUGIN_SPECS[tpot.TYPE].factory("tpot", p)
    ),
    st.builds(ttft.Params, slo_s=POSITIVE, default_prefill_tokens_per_s=POSITIVE).map(
        lambda p: PLUGIN_SPECS[ttft.TYPE].factory("ttft", p)
    ),
    st.just(PLUGIN_SPECS[prefix.TYPE].factory("prefix", prefix.Params())),
)
