"""Which prefill and decode instances can move KV between them: the rules, read from vLLM 0.32's
connectors (each cited in docs/vllm-kv-layout-facts.md).

Every connector: the same served model, revision, block size and KV connector. Then, by connector:

- ``NixlConnector`` / ``NixlPushConnector``: what vLLM hashes into the handshake's compatibility hash
  (vLLM version, ``--model``, dtype, KV cache dtype, attention backend) equal; KV layouts equal; TP sizes
  that divide one another, and a heterogeneous TP pair only on a block-contiguous layout (LBHNC,
  BLHNC); no PP > 1 on the decode side.
- ``MooncakeConnector``: TP sizes that divide one another; dtype, KV cache dtype and layout equal.
- any other (the project's ``vllm-disagg`` pool, none): TP, PP, dtype, KV cache dtype, layout and
  attention backend equal.

A field either side does not know (0 or "") is never held against a pair. Ranks, DP and the batch are
never compared: every rank of a P/D pair handshakes with its peers on its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from vllm_disagg.orchestrator.state.views import DECODE_ROLES, PREFILL_ROLES, InstanceView, RegistrySnapshot
from vllm_disagg.protocol.kv_connectors import handoff_of
from vllm_disagg.protocol.messages import InstanceInfo, KvLayout

NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPushConnector"})
MOONCAKE_CONNECTORS = frozenset({"MooncakeConnector"})
# ``KVCacheLayout.is_block_contiguous`` (vllm/v1/kv_cache_layout.py): heads split per block.
BLOCK_CONTIGUOUS_LAYOUTS = frozenset({"LBHNC", "BLHNC"})
_CACHE_LIMIT = 1 << 16  # infos (and pairs of classes) remembered before those caches start over


class Mismatch(NamedTuple):
    """Why a pair cannot exchange KV: ``code`` (a metric label, bounded) and a sentence."""

    code: str
    text: str


def _differ(a: str | int, b: str | int) -> bool:
    return bool(a) and bool(b) and a != b


def _kv_dtype(layout: KvLayout) -> str:
    # "auto" is the model's dtype (vllm/config/cache.py ``CacheDType``).
    return layout.dtype if layout.kv_cache_dtype == "auto" else layout.kv_cache_dtype  # "": unknown


def _equal_fields(p: KvLayout, d: KvLayout, names: Iterable[str]) -> Mismatch | None:
    for name in names:
        a, b = (
            (_kv_dtype(p), _kv_dtype(d)) if name == "kv_cache_dtype" else (getattr(p, name), getattr(d, name))
        )
        if _differ(a, b):
            return Mismatch(name, f"{name} differs: prefill {a}, decode {b}")
    return None


def _tp(p: KvLayout, d: KvLayout, connector: str) -> Mismatch | None:
    a, b = p.tp_size, d.tp_size
    if not a or not b or a == b:
        return None
    if max(a, b) % min(a, b):
        return Mismatch(
            "tp_size", f"TP sizes must divide one another for {connector}: prefill {a}, decode {b}"
        )
    layout = p.kv_layout or d.kv_layout
    if connector in NIXL_CONNECTORS and layout and layout not in BLOCK_CONTIGUOUS_LAYOUTS:
        return Mismatch(
            "tp_layout",
            f"heterogeneous TP ({a} to {b}) needs a block-contiguous KV layout with {connector} "
            f"(LBHNC, BLHNC), not {layout}",
        )
    return None


_NIXL_HASHED = ("vllm_version", "model_path", "dtype", "kv_cache_dtype", "attention_backend", "kv_layout")
_MOONCAKE_EQUAL = ("dtype", "kv_cache_dtype", "kv_layout")
_OTHER_EQUAL = ("tp_size", "pp_size", "dtype", "kv_cache_dtype", "kv_layout", "attention_backend")


def layout_mismatch(p: KvLayout, d: KvLayout, connector: str) -> Mismatch | None:
    """Why prefill layout ``p`` cannot send its KV to decode layout ``d`` over ``connector``; None if
    it can (or nothing known says it cannot)."""
    if connector in NIXL_CONNECTORS:
        if d.pp_size > 1:
            return Mismatch("pp_size", f"{connector} cannot feed a decode instance with PP {d.pp_size} > 1")
        return _equal_fields(p, d, _NIXL_HASHED) or _tp(p, d, connector)
    if connector in MOONCAKE_CONNECTORS:
        return _equal_fields(p, d, _MOONCAKE_EQUAL) or _tp(p, d, connector)
    return _equal_fields(p, d, _OTHER_EQUAL)


def judge(p: InstanceInfo, d: InstanceInfo) -> Mismatch | None:
    """Why prefill instance ``p`` cannot hand its KV to decode instance ``d``; None if it can."""
    if p.model != d.model:
        return Mismatch("model", f"serves {d.model!r}, the partner {p.model!r}")
    if p.revision != d.revision:
        return Mismatch("revision", f"revision differs: prefill {p.revision!r}, decode {d.revision!r}")
    if p.kv_connector != d.kv_connector:
        return Mismatch(
            "connector", f"KV connector differs: prefill {p.kv_connector!r}, decode {d.kv_connector!r}"
        )
    if p.block_size != d.block_size:
        return Mismatch("block_size", f"block size differs: prefill {p.block_size}, decode {d.block_size}")
    if handoff_of(p.kv_connector) == "local":
        return Mismatch(
            "connector", f"{p.kv_connector} keeps KV under its own engine: it never crosses instances"
        )
    return layout_mismatch(p.layout, d.layout, p.kv_connector)


def pair_mismatch(p: InstanceInfo, d: InstanceInfo) -> str | None:
    """Why prefill instance ``p`` and decode instance ``d`` cannot be paired, in words; None if they can."""
    found = judge(p, d)
    return None if found is None else found.text


def _class_key(info: InstanceInfo) -> tuple[object, ...]:
    x = info.layout
    return (
        info.model,
        info.revision,
        info.kv_connector,
        info.block_size,
        x.tp_size,
        x.pp_size,
        x.dtype,
        _kv_dtype(x),
        x.kv_layout,
        x.attention_backend,
        x.vllm_version,
        x.model_path,
    )


class PairJudge:
    """``judge`` made cheap per request: each ``InstanceInfo`` gets a class number (equal for everything
    ``judge`` reads), and each pair of classes is judged once."""

    __slots__ = ("_by_key", "_of", "_pairs", "_uniform")

    def __init__(self) -> None:
        self._by_key: dict[tuple[object, ...], int] = {}
        # id(info) -> (info, its class); the info is held so that its id is not reused meanwhile.
        self._of: dict[int, tuple[InstanceInfo, int]] = {}
        self._pairs: dict[tuple[int, int], Mismatch | None] = {}
        # Whether every instance is of one class, for one registry membership.
        self._uniform: tuple[int, int, bool] = (0, -1, False)  # (registry id, membership, uniform)

    def uniform(self, snapshot: RegistrySnapshot) -> bool:
        """Are all the instances in ``snapshot`` (every model) of one class? Then one verdict holds
        for every pair of them: kept per membership version (infos change only with membership)."""
        registry, membership, found = self._uniform
        if (registry, membership) != (snapshot.registry_id, snapshot.membership):
            found = len({self.kv_class(v.info) for v in snapshot.by_id.values()}) <= 1
            self._uniform = (snapshot.registry_id, snapshot.membership, found)
        return found

    def kv_class(self, info: InstanceInfo) -> int:
        """``info``'s class: equal for two infos exactly when ``judge`` cannot tell them apart."""
        hit = self._of.get(id(info))
        if hit is not None:
            return hit[1]
        if len(self._of) >= _CACHE_LIMIT:
            self._of.clear()
        key = _class_key(info)
        number = self._by_key.get(key)
        if number is None:  # classes are kept: as many as distinct engine setups, and numbers must last
            number = self._by_key[key] = len(self._by_key)
        self._of[id(info)] = (info, number)
        return number

    def mismatch(self, p: InstanceInfo, d: InstanceInfo) -> Mismatch | None:
        """``judge(p, d)``, from the cache when a pair of the same classes was judged before."""
        pair = (self.kv_class(p), self.kv_class(d))
        try:
            return self._pairs[pair]
        except KeyError:
            if len(self._pairs) >= _CACHE_LIMIT:
                self._pairs.clear()
            found = self._pairs[pair] = judge(p, d)
            return found

    def keep(
        self,
        partner: InstanceView,
        candidates: Sequence[InstanceView],
        partner_decodes: bool,
        uniform: bool = False,
    ) -> list[InstanceView]:
        """The candidates that can exchange KV with ``partner`` (never the partner itself): ``mismatch``
        once per class met, then a class lookup per candidate (the per-request filter's hot path); one
        ``mismatch`` in all where ``uniform`` says the candidates and the partner share a class."""
        mine = partner.info
        pid = partner.agent_id
        if uniform:  # one class: one verdict for all, and only the partner itself to leave out
            if not candidates:
                return []
            first = candidates[0].info
            found = self.mismatch(first, mine) if partner_decodes else self.mismatch(mine, first)
            return [] if found is not None else [c for c in candidates if c.agent_id != pid]
        verdict: dict[int, bool] = {}  # a candidate class -> whether it pairs with the partner
        of, kv_class = self._of, self.kv_class
        kept = []
        for c in candidates:
            info = c.info
            hit = of.get(id(info))
            cls = hit[1] if hit is not None else kv_class(info)
            ok = verdict.get(cls)
            if ok is None:
                found = self.mismatch(info, mine) if partner_decodes else self.mismatch(mine, info)
                ok = verdict[cls] = found is None
            if ok and c.agent_id != pid:
                kept.append(c)
        return kept


def incompatible_pairs(
    views: Iterable[InstanceView], mismatch: Callable[[InstanceInfo, InstanceInfo], Mismatch | None] = judge
) -> Counter[tuple[str, str]]:
    """(model, reason code) -> ordered (prefill, decode) pairs of live instances of a model that cannot
    be paired."""
    by_model: dict[str, list[InstanceView]] = {}
    for v in views:
        if v.state != "dead":
            by_model.setdefault(v.info.model, []).append(v)
    counts: Counter[tuple[str, str]] = Counter()
    for model, live in by_model.items():
        for p in live:
            if p.info.role not in PREFILL_ROLES:
                continue
            for d in live:
                if d.info.role in DECODE_ROLES and d.agent_id != p.agent_id:
                    found = mismatch(p.info, d.info)
                    if found is not None:
                        counts[(model, found.code)] += 1
    return counts


class IncompatiblePairs:
    """``incompatible_pairs`` of a registry, recounted only when its membership changes."""

    __slots__ = ("_counts", "_judge", "_of")

    def __init__(self) -> None:
        self._judge = PairJudge()
        self._of: tuple[int, int] = (0, -1)
        self._counts: Mapping[tuple[str, str], int] = {}

    def counts(self, snap: RegistrySnapshot) -> Mapping[tuple[str, str], int]:
        """(model, reason) -> incompatible pairs among ``snap``'s live instances."""
        key = (snap.registry_id, snap.membership)
        if key != self._of:
            self._counts = incompatible_pairs(snap.instances, self._judge.mismatch)
            self._of = key
        return self._counts
