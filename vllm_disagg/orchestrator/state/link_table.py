"""What the scheduler reads of the P->D links: a predicted KV transfer time per pair.

``LinkTable`` is the read side of what ``link_rates.LinkRates`` (owned by the registry) learns from
measured transfers; a ``RegistrySnapshot`` carries one (``RegistrySnapshot.links``). It is pure data
and picklable, so gateway workers get it with their state. ``EMPTY_LINKS`` knows nothing: every
``transfer_s`` is None, and the scheduler then ignores transfer time, as before links were learned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

Link = tuple[str, str]  # (prefill agent id, decode agent id)


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """One link's learned rate: seconds per KV byte, and how sure (samples) and how old it is."""

    s_per_byte: float
    samples: int
    learned_at: float  # the registry's monotonic clock, at the newest sample


@dataclass(frozen=True, slots=True)
class LinkTable:
    """Learned links, per-tier typical rates for links never measured, and KV bytes per token."""

    links: Mapping[Link, LinkEstimate] = field(default_factory=lambda: MappingProxyType({}))
    # tier (``link_rates.link_tier``: "domain", "node", "zone", "other", or "any") -> seconds per byte
    typical: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    bytes_per_token: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))  # by model

    def transfer_s(self, p: str, d: str, tier: str, model: str, tokens: int) -> float | None:
        """Predicted seconds to move ``tokens`` tokens' KV from ``p`` to ``d`` (the link's own rate,
        else its tier's typical, else any link's); None where nothing is known."""
        per_token = self.bytes_per_token.get(model)
        if per_token is None or tokens <= 0:
            return None if per_token is None else 0.0
        known = self.links.get((p, d))
        rate = known.s_per_byte if known is not None else self.typical.get(tier, self.typical.get("any"))
        return None if rate is None else tokens * per_token * rate


EMPTY_LINKS = LinkTable()
