"""A request's priority and tenant, as admission reads them (docs/admission.md).

**Priority** is vLLM's: an integer, lower is sooner, 0 the default. It comes from the body's
``priority`` field (as vLLM's OpenAI server accepts it) or the ``x-priority`` header, which wins where
both are given (so that a proxy in front can set a class its clients cannot). Priorities at or above
``admission.sheddable_priority`` (1) form the sheddable class.

**Tenant**: the ``x-tenant-id`` header where given (a name of letters, digits and ``._:-``); else the
client's API key, never itself: ``key-`` and the first 12 hex digits of its SHA-256; else ``default``.
A header any client can set is only as trustworthy as the proxy that sets it: where clients are not
behind one, leave the header out and tenants follow their keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from vllm_disagg.config import TENANT_NAME, AdmissionConfig
from vllm_disagg.errors import BadRequest

_PRIORITY_BOUND = 1 << 31  # vLLM's priority is a C int in spirit; nothing sane is larger
DEFAULT_TENANT = "default"
OTHER_TENANTS = "other"


def _priority_value(raw: object, where: str) -> int:
    if isinstance(raw, bool):
        raise BadRequest(f"{where} must be an integer, got a boolean", param="priority")
    if isinstance(raw, str):
        text = raw.strip()
        try:
            raw = int(text)
        except ValueError:
            raise BadRequest(f"{where} must be an integer, got {text[:40]!r}", param="priority") from None
    if not isinstance(raw, int):
        raise BadRequest(f"{where} must be an integer", param="priority")
    if not -_PRIORITY_BOUND <= raw < _PRIORITY_BOUND:
        raise BadRequest(f"{where} is out of range: {raw}", param="priority")
    return raw


def priority_of(body: Mapping[str, Any], headers: Mapping[str, str], config: AdmissionConfig) -> int:
    """The request's priority: the header's, else the body's, else 0; ``BadRequest`` for a bad one."""
    header = headers.get(config.priority_header)
    if header is not None:
        return _priority_value(header, f"the {config.priority_header} header")
    if "priority" in body and body["priority"] is not None:
        return _priority_value(body["priority"], "priority")
    return 0


def tenant_of(headers: Mapping[str, str], config: AdmissionConfig) -> str:
    """The request's tenant: the header's name, else its API key's hash, else ``default``."""
    named = headers.get(config.tenant_header)
    if named is not None:
        named = named.strip()
        if not TENANT_NAME.fullmatch(named):
            raise BadRequest(
                f"the {config.tenant_header} header must be 1-64 of letters, digits and ._:-",
                param=config.tenant_header,
            )
        return named
    auth = headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return "key-" + hashlib.sha256(key.strip().encode()).hexdigest()[:12]
    return DEFAULT_TENANT


class TenantLabels:
    """Bounded metric labels for tenants: configured ones and the first ``limit`` others seen by name,
    the rest as ``other`` (a client could otherwise mint a time series per request)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self._named = {tenant for tenant, _ in config.tenant_weights} | {DEFAULT_TENANT}
        self._limit = config.max_tenant_labels
        self._seen: set[str] = set()

    def name(self, tenant: str) -> str:
        if tenant in self._named or tenant in self._seen:
            return tenant
        if len(self._seen) < self._limit:
            self._seen.add(tenant)
            return tenant
        return OTHER_TENANTS

    def add(self, tenant: str) -> None:
        """A tenant an operator configured (its weight set): always named."""
        self._named.add(tenant)
