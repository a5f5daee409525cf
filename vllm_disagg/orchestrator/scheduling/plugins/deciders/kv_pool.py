"""kv-pool-decider: straight to the decode instance when an agent's KV pool holds the whole prompt;
otherwise as the uncached-tokens-decider.

Engines launched with the project's own connector (``InstanceInfo.kv_connector == "vllm-disagg"``)
save a prompt's full blocks in their agent's node-level pool and load blocks from it. When some pool
holds every full block of the prompt, a prefill leg would only compute what is already there: the
request goes to the decode instance D alone, and D's engine loads the prompt's KV from its agent's
pool. If the holder is another agent, the gateway first has D's agent fetch the blocks from it
(``kv_grant`` to the holder, ``kv_fetch`` to D's agent), which takes a transfer, not a prefill.

The rule fires only for a D that runs the connector, a prompt of at least ``minBlocks`` full blocks
whose token ids are known exactly, and a holder that can hand KV to D: D itself, or a live instance
of the same model, revision, block size and connector that serves its pool (``kv_pool_endpoint``) to
a D that has one too. Of several holders, D's own pool wins, then the least busy. Without pools
(no ``vllm-disagg`` instance) ``request.pooled_tokens`` is empty and the rule costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm_disagg.orchestrator.scheduling.framework import ModeChoice, PluginSpec, ProfileContext
from vllm_disagg.orchestrator.scheduling.plugins import check_int
from vllm_disagg.orchestrator.scheduling.plugins.deciders import uncached_tokens
from vllm_disagg.orchestrator.state.views import InstanceView, pool_of
from vllm_disagg.protocol.messages import POOL_CONNECTOR

TYPE = "kv-pool-decider"


@dataclass(frozen=True, slots=True)
class Params:
    """``threshold``: as the uncached-tokens-decider's (>= 0); ``min_blocks``: full blocks a prompt
    needs to go straight to decode (>= 1)."""

    threshold: int = 0
    min_blocks: int = 1

    def __post_init__(self) -> None:
        check_int(TYPE, "threshold", self.threshold, ge=0)
        check_int(TYPE, "min_blocks", self.min_blocks, ge=1)


def can_hand_over(holder: InstanceView, decode: InstanceView) -> bool:
    """May ``holder``'s agent hand pool blocks to ``decode``'s? Both serve a pool (``decode``'s may be
    its host's, another agent's), the KV is alike."""
    h, d = holder.info, decode.info
    return (
        holder.state != "dead"
        and bool(h.kv_pool_endpoint)
        and bool(d.kv_pool_endpoint or d.kv_pool_node)
        and h.kv_connector == POOL_CONNECTOR
        and h.model == d.model
        and h.revision == d.revision
        and h.block_size == d.block_size
    )


class KvPoolDecider:
    """Colocated on D with ``kv_source`` when a pool holds the whole prompt; else uncached-tokens."""

    TYPE: ClassVar[str] = TYPE
    __slots__ = ("_otherwise", "name", "params")

    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.params = params
        otherwise = uncached_tokens.Params(params.threshold)
        self._otherwise = uncached_tokens.UncachedTokensDecider(name, otherwise)

    def shortcut(self, ctx: ProfileContext, decode: InstanceView) -> ModeChoice | None:
        """Straight to ``decode`` when a pool it can load from holds every full block of the prompt."""
        request = ctx.request
        pooled = request.pooled_tokens
        info = decode.info
        if not pooled or not request.tokenized or info.kv_connector != POOL_CONNECTOR:
            return None
        size = info.block_size
        blocks = request.prompt_len // size
        if blocks < self.params.min_blocks:
            return None
        need = blocks * size
        d = decode.agent_id
        if pooled.get(pool_of(decode), 0) >= need:
            whose = "own" if pool_of(decode) == d else "host's"
            why = f"straight to decode: {d}'s {whose} KV pool holds all {blocks} blocks of the prompt"
            return ModeChoice("colocated", why, d)
        snapshot = ctx.snapshot
        by_id = snapshot.by_id
        holders = [
            v
            for agent_id, tokens in pooled.items()
            if tokens >= need and (v := by_id.get(agent_id)) is not None and can_hand_over(v, decode)
        ]
        if not holders:
            return None
        holder = min(holders, key=lambda v: (snapshot.in_flight_of(v.agent_id), v.agent_id)).agent_id
        return ModeChoice(
            "colocated",
            f"straight to decode: {holder}'s KV pool holds all {blocks} blocks of the prompt; "
            f"{d} fetches them from there",
            holder,
        )

    def choose(self, ctx: ProfileContext, decode: InstanceView, prefill_ready: bool) -> ModeChoice:
        """The uncached-tokens rule (no pool holds the whole prompt)."""
        return self._otherwise.choose(ctx, decode, prefill_ready)


PLUGIN = PluginSpec(TYPE, Params, KvPoolDecider, "decider")
