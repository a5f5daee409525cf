"""The client's pins: the prefill instance, the decode instance, or both (the pair), resolved and checked.

A pin names an instance by agent id, engine URL or host:port. A pin the scheduler cannot honour is the
client's to fix, so it is a 400 (``BadRequest``) naming the body field and saying why: the instance is
not registered, serves another model, has a role that cannot run the leg ("both" runs either), is not
ready, is pinned as both prefill and decode, or (a pinned pair) cannot exchange KV with its partner.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_disagg.errors import BadRequest, NoCapacity
from vllm_disagg.orchestrator.scheduling.explain import ProfileTrace
from vllm_disagg.orchestrator.scheduling.framework import Filter, ProfileContext, ProfileName
from vllm_disagg.orchestrator.state.compat import pair_mismatch
from vllm_disagg.orchestrator.state.views import DECODE_ROLES, PREFILL_ROLES, InstanceView, RegistrySnapshot

# The body field naming each leg's pin (the 400's ``param``); the request headers are in ``gateway/parsing``.
PIN_PARAMS: dict[ProfileName, str] = {"prefill": "prefill_endpoint", "decode": "decode_endpoint"}
_ROLES = {"prefill": PREFILL_ROLES, "decode": DECODE_ROLES}


def find(pin: str, snapshot: RegistrySnapshot) -> InstanceView | None:
    """The instance ``pin`` names: an agent id, else an engine URL (a missing scheme means http)."""
    view = snapshot.by_id.get(pin)
    if view is not None:
        return view
    wanted = pin.rstrip("/")
    if "://" not in wanted:
        wanted = f"http://{wanted}"
    return next((v for v in snapshot.instances if v.info.url.rstrip("/") == wanted), None)


def resolve(pin: str, snapshot: RegistrySnapshot, model: str, leg: ProfileName) -> InstanceView:
    """The instance pinned for ``leg``, checked able to run it now; ``BadRequest`` saying why not."""
    view = find(pin, snapshot)
    param = PIN_PARAMS[leg]
    if view is None:
        raise BadRequest(f"the pinned {leg} instance {pin!r} is not registered", param=param)
    problem = ""
    if view.info.model != model:
        problem = f"serves model {view.info.model!r}, not {model!r}"
    elif view.info.role not in _ROLES[leg]:
        problem = f"has role {view.info.role!r} and cannot {leg}"
    elif view.state != "ready":
        problem = f"is {view.state}, not ready"
    if problem:
        raise BadRequest(f"the pinned {leg} instance {view.agent_id!r} {problem}", param=param)
    return view


def check_pair(ctx: ProfileContext, p: InstanceView, d: InstanceView, filters: Sequence[Filter]) -> None:
    """A pinned pair: two instances that can exchange KV by the compatibility rules, ``d`` passing the
    decode profile's KV filters with ``p`` as its partner (``ctx.partner``); ``BadRequest`` saying why
    not."""
    param = PIN_PARAMS["decode"]
    if p.agent_id == d.agent_id:
        raise BadRequest(
            f"the instance {p.agent_id!r} is pinned as both the prefill and the decode instance; "
            "a pair is two instances (pin only one leg to let the scheduler pick the other)",
            param=param,
        )
    # The compatibility rules' own words (``state/compat.py``); else the filter that keeps D out.
    why = pair_mismatch(p.info, d.info)
    if why is None:
        why = next((f"the {f.name} keeps them apart" for f in filters if not f.filter(ctx, [d])), None)
    if why is not None:
        raise BadRequest(
            f"the pinned prefill instance {p.agent_id!r} and decode instance {d.agent_id!r} cannot "
            f"exchange KV: {why}",
            param=param,
        )


def pinned_trace(population: int, d: InstanceView) -> ProfileTrace:
    """The decode profile's trace for a decode instance the client pinned: it alone, the client's pick."""
    return ProfileTrace("decode", population, (), 1, False, (d,), (), (1.0,), "client", 0)


def no_decode(model: str, trace: ProfileTrace, pinned: InstanceView | None) -> Exception:
    """Why the decode profile found nobody: a 400 where the client pinned P, else no capacity."""
    kept = ", ".join(f"{s.filter} kept {len(s.kept_out)} of {len(s.kept_in)}" for s in trace.stages)
    if pinned is not None:
        i = pinned.info
        return BadRequest(
            f"no ready decode instance can exchange KV with the pinned prefill instance {pinned.agent_id!r} "
            f"(model {i.model!r}, revision {i.revision!r}, block size {i.block_size}, "
            f"connector {i.kv_connector!r}): {kept}",
            param="prefill_endpoint",
        )
    return NoCapacity(f"no ready instance can decode model '{model}' ({trace.population} registered: {kept})")
