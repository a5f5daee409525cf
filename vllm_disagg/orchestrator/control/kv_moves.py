"""Moving a prompt's KV blocks from one agent's pool to another's: ``kv_grant``, then ``kv_fetch``.

The gateway asks for a move when a decode instance should load blocks another agent's pool holds
(engines sharing their host's pool, ``InstanceInfo.kv_pool_node``, move nothing between them, and
that pool's agent moves for them):
after a prefill leg between two ``vllm-disagg`` instances (the prefill engine saved the prompt's
blocks in its agent's pool) and for a request sent straight to decode (``Decision.kv_source``). The
control plane sends the commands (docs/protocol.md): ``kv_grant`` to the holder, whose Ack says how
many leading blocks it holds and has pinned for the receiver; then ``kv_fetch`` of those to the
receiver, whose Ack comes once the transfer has started (the blocks land layer by layer after it,
and the receiving engine can already load them). A move that fails leaves the decode engine to
compute what it lacks: the caller counts the reason and goes on, it never fails the request.

A gateway worker process has no control plane: its ``LinkKvMover`` (``workers/worker.py``) asks the
orchestrator's ``ControlKvMover`` over the workers' link.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vllm_disagg.errors import AgentTooOld, CommandError, CommandTimeout, ConfigError, NotLeader
from vllm_disagg.orchestrator.control.plane import ControlPlane
from vllm_disagg.orchestrator.state.views import GatewayRegistry, pool_of
from vllm_disagg.protocol.commands import FetchResult, GrantResult, KvFetch, KvGrant, z85
from vllm_disagg.protocol.kv_pool import MAX_COMMAND_KEYS, MAX_FETCH_TIMEOUT_S, MAX_GRANT_TTL_S

# Why a move failed (the ``reason`` label of ``vllm_disagg_kv_pool_transfer_failures_total``).
REASONS = (
    "no_pool",  # the holder or the receiver serves no pool (no kv_pool_endpoint)
    "too_old",  # an agent of protocol < 1.3
    "unreachable",  # no live session, or its socket is not connected
    "grant_timeout",
    "grant_refused",
    "not_held",  # the holder's pool no longer holds the prompt's first block
    "fetch_timeout",
    "fetch_refused",
    "invalid_handle",  # the prefill's kv_transfer_params.vllm_disagg is malformed
    "key_mismatch",  # the holder's pool names the prompt's blocks otherwise (PYTHONHASHSEED differs)
    "unavailable",  # no control plane to ask (a gateway without one, a worker's link down)
)
_ACK_MARGIN_S = 0.5  # the receiver times its fetch out first, and says so in its Ack


@dataclass(frozen=True, slots=True)
class KvMoveSettings:
    """How long a holder pins granted blocks, and how long the gateway waits for each Ack."""

    grant_ttl_s: float = 30.0  # the holder keeps granted blocks pinned this long if never fetched
    grant_timeout_s: float = 1.0  # for the holder's Ack
    fetch_timeout_s: float = 2.0  # for the receiver's transfer to start (its Ack comes then)

    def __post_init__(self) -> None:
        for name in ("grant_ttl_s", "grant_timeout_s", "fetch_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"kv_moves.{name} must be a number of seconds > 0, got {value}")
        # Agents cap what they are told at these anyway; a setting above them would be a silent lie.
        for name, most in (("grant_ttl_s", MAX_GRANT_TTL_S), ("fetch_timeout_s", MAX_FETCH_TIMEOUT_S)):
            if getattr(self, name) > most:
                raise ConfigError(f"kv_moves.{name} must be at most {most:g} s, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class MoveResult:
    """A move's outcome: ``ok`` once the receiver's transfer started, else ``reason`` and ``error``."""

    ok: bool
    reason: str = ""  # one of ``REASONS`` when not ok
    error: str = ""
    requested: int = 0  # blocks asked for
    held: int = 0  # leading blocks the holder granted
    already_held: int = 0  # leading blocks the receiver's pool had already
    reserved: int = 0  # blocks the receiver is fetching


class KvMover(Protocol):
    """What the gateway asks to move KV between agents' pools."""

    async def move(self, holder: str, receiver: str, keys: Sequence[str]) -> MoveResult:
        """Grant ``keys`` (hex, first block first) on ``holder``'s agent, then fetch them to
        ``receiver``'s."""
        ...


def failed(reason: str, error: str, requested: int = 0) -> MoveResult:
    """A failed move."""
    return MoveResult(False, reason, error, requested)


class ControlKvMover:
    """Moves KV with the orchestrator's control plane (in the orchestrator process)."""

    def __init__(
        self, control: ControlPlane, registry: GatewayRegistry, settings: KvMoveSettings | None = None
    ) -> None:
        self._control = control
        self._registry = registry
        self.settings = settings or KvMoveSettings()

    async def move(self, holder: str, receiver: str, keys: Sequence[str]) -> MoveResult:
        """``kv_grant`` to ``holder``, then ``kv_fetch`` to ``receiver``; never raises."""
        keys = list(keys[:MAX_COMMAND_KEYS])
        requested = len(keys)
        if not keys:
            return failed("not_held", "no block to move")
        h, r = self._registry.get(holder), self._registry.get(receiver)
        if h is None or r is None:
            return failed("unreachable", f"instance {holder if h is None else receiver!r} is not registered")
        # Engines sharing their host's pool: the agent that runs it grants and fetches for them.
        holder, receiver = pool_of(h), pool_of(r)
        if holder == receiver:  # one pool: the blocks are there, in the memory both engines map
            return MoveResult(True, requested=requested, held=requested, already_held=requested)
        h, r = self._registry.get(holder), self._registry.get(receiver)
        if h is None or r is None:
            return failed(
                "unreachable", f"the KV pool of {holder if h is None else receiver!r} is not registered"
            )
        if not h.info.kv_pool_endpoint or not r.info.kv_pool_endpoint:
            who = holder if not h.info.kv_pool_endpoint else receiver
            return failed("no_pool", f"instance {who!r} serves no KV pool", requested)
        control, settings = self._control, self.settings
        token = secrets.token_urlsafe(18)
        blocks = [bytes.fromhex(k) for k in keys]  # the gateway read them as lowercase hex
        grant = KvGrant(token, blocks, z85(control.public_key_of(receiver)), settings.grant_ttl_s)
        try:
            ack = await control.send_command(holder, grant, timeout_s=settings.grant_timeout_s)
        except (CommandError, NotLeader) as exc:
            return failed(_reason(exc, "grant_timeout"), str(exc), requested)
        if not ack.ok:
            return failed("grant_refused", f"{holder}: {ack.error}", requested)
        # An Ack without its counts (none of ours sends one) is taken at its word: all of them.
        held = min(requested, ack.result.held if isinstance(ack.result, GrantResult) else requested)
        if held < 1:
            return failed("not_held", f"{holder}'s pool no longer holds the prompt's first block", requested)
        endpoint, holder_key = h.info.kv_pool_endpoint, z85(control.public_key_of(holder))
        fetch = KvFetch(token, blocks[:held], endpoint, holder_key, settings.fetch_timeout_s)
        try:
            ack = await control.send_command(
                receiver, fetch, timeout_s=settings.fetch_timeout_s + _ACK_MARGIN_S
            )
        except (CommandError, NotLeader) as exc:
            return failed(_reason(exc, "fetch_timeout"), str(exc), requested)
        if not ack.ok:
            return failed("fetch_refused", f"{receiver}: {ack.error}", requested)
        got = ack.result if isinstance(ack.result, FetchResult) else FetchResult(held, 0, held)
        already, reserved = got.already_held, got.reserved
        if already + reserved < 1:  # e.g. its pool is not open yet (its engine has not said hello)
            return failed("fetch_refused", f"{receiver} fetches none of the {held} blocks", requested)
        return MoveResult(True, requested=requested, held=held, already_held=already, reserved=reserved)


def _reason(exc: CommandError | NotLeader, timeout: str) -> str:
    if isinstance(exc, NotLeader):  # a replica that does not lead, and no leader to ask
        return "unavailable"
    if isinstance(exc, CommandTimeout):
        return timeout
    if isinstance(exc, AgentTooOld):
        return "too_old"
    return "unreachable"
