"""Typed, versioned messages between the orchestrator and its agents.

Every message is a frozen dataclass with a ``TAG``. The protocol's version is ``major.minor``
(``PROTOCOL_VERSION``.``PROTOCOL_MINOR``): peers of one major version talk whatever their minors.
A minor release appends fields with defaults (an older peer's frame decodes with the defaults, and an
older peer ignores the fields it does not know); anything that changes meaning bumps the major.

A session: agent -> ``Hello``; orchestrator -> ``Welcome`` or ``Refuse``; then agent -> ``Heartbeat``
every ``Welcome.heartbeat_interval_s`` (and ``KvEvents`` as its engine's prefix cache changes);
orchestrator -> ``Command``, agent -> ``Ack``; either side -> ``Goodbye`` when it leaves. See
docs/protocol.md for an example of each. Agents with a KV pool (1.3) also report its contents as
``KvEvent``s of medium ``"pool"``, and move blocks between pools on ``kv_grant`` / ``kv_fetch``.
From 1.5 a command's payload and its Ack's result are typed per kind (``protocol/commands.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from vllm_disagg.protocol.commands import COMMAND_KINDS as COMMAND_KINDS
from vllm_disagg.protocol.commands import (
    POOL_MINOR,
    TYPED_MINOR,
    AckResult,
    CommandPayload,
    check,
    from_args,
    to_args,
    to_detail,
)
from vllm_disagg.protocol.commands import CommandKind as CommandKind

PROTOCOL_VERSION = 1  # the major version: peers must agree on it
# 1: unknown fields are ignored, Hello and Welcome say their minor. 2: ``Ack.code``. 3: KV pools
# (``kv_grant``/``kv_fetch`` commands, ``Ack.detail``, ``InstanceInfo.kv_pool_endpoint``, ``KvEvent.medium``).
# 4: ``InstanceInfo.capabilities`` (what the engine's streamed answers carry). 5: typed payloads
# (``Command.payload``, ``Ack.result``) in place of the string maps ``args`` and ``detail``. 6: fencing
# (``Command.epoch``: the term of the leader that sent it; ``STALE_EPOCH`` refusals). 7: where an
# instance runs and how it lays out its KV (``InstanceInfo.labels``, ``InstanceInfo.layout``), and
# the KV an engine pulled in (``MetricsSnapshot.kv_in_bytes``, ``kv_in_seconds``, ``kv_in_links``).
# 8: ``MetricsSnapshot.kv_pool_hit_rate``. 9: ``InstanceInfo.kv_pool_node`` (engines sharing one
# host's KV pool).
PROTOCOL_MINOR = 9
# A field added after 1.0 is marked with the minor that added it: the codec leaves it out of a frame
# while it holds its default, since a peer of 1.0 refuses fields it does not know.
SINCE_MINOR_1 = {"since_minor": 1}
SINCE_MINOR_2 = {"since_minor": 2}
SINCE_MINOR_3 = {"since_minor": 3}
SINCE_MINOR_4 = {"since_minor": 4}
SINCE_MINOR_5 = {"since_minor": TYPED_MINOR}
SINCE_MINOR_6 = {"since_minor": 6}
SINCE_MINOR_7 = {"since_minor": 7}
SINCE_MINOR_8 = {"since_minor": 8}
SINCE_MINOR_9 = {"since_minor": 9}
# ``Ack.code`` of a ``set_role`` the engine can obey only by restarting with the role's KV role: the
# orchestrator drains the instance, then asks again with ``SetRole.restart`` (1.4: ``args["restart"]``).
RESTART_REQUIRED = "restart_required"
# ``Ack.code`` of a command whose ``epoch`` is older than one this agent has obeyed: it came from a
# leader that has since been replaced (docs/operations.md, replicas), and was not carried out.
STALE_EPOCH = "stale_epoch"

Role = Literal["prefill", "decode", "both"]
EngineState = Literal["starting", "ready", "unhealthy", "restarting", "stopped"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
ENGINE_STATES: tuple[EngineState, ...] = ("starting", "ready", "unhealthy", "restarting", "stopped")
# Command kinds an agent knows from this minor on: never sent to an agent of an older one.
COMMAND_SINCE_MINOR: Mapping[CommandKind, int] = MappingProxyType({"kv_grant": 3, "kv_fetch": 3})
# An agent says Hello again after 0.1 s doubling to this (jittered): what an orchestrator that has just
# started waits, at most, to hear from every agent (a replica's readiness, /health/ready).
HELLO_BACKOFF_MAX_S = 2.0
AGENT_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # what the tools choose and the admin API accepts


def default_agent_id(role: str, url: str) -> str:
    """``ROLE-HOST-PORT`` for an engine at ``url``, in the characters of ``AGENT_ID``."""
    parsed = urlsplit(url)
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{role}-{parsed.hostname}-{parsed.port}")[:128]


KvEventKind = Literal["stored", "removed", "cleared"]
KV_EVENT_KINDS: tuple[KvEventKind, ...] = ("stored", "removed", "cleared")
# Where a KV event's blocks live: the engine's own prefix cache, or its agent's node-level pool (1.3).
# A plain string, not a literal: a medium a later minor adds must not make this one refuse the frame.
MEDIUM_GPU = "gpu"
MEDIUM_POOL = "pool"
# Its pool's disk tier: blocks evicted from the pool's memory, read back when asked for (an
# orchestrator that does not know the medium ignores its events).
MEDIUM_DISK = "disk"
# ``InstanceInfo.kv_connector`` of an engine launched with the project's own connector: it saves the
# prompt's full blocks in its agent's pool and loads blocks from there.
POOL_CONNECTOR = "vllm-disagg"


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine's answers carry, as its agent found out when it registered (1.4).

    A stream can resume on another instance only where its engine says which tokens it sent: the
    prompt's ids and each event's ``token_ids`` when asked ``return_token_ids`` (vLLM 0.10.2 and
    later), and, for a chat, a chat request that takes its prompt as ids (``kv_transfer_params.
    prompt_token_ids``, vLLM 0.32). ``known`` is False where nobody asked (an agent before 1.4, which
    only ran vLLM 0.32 or the simulator): the gateway then assumes vLLM 0.32's.
    """

    known: bool = False
    completions_token_ids: bool = False  # a streamed /v1/completions says its prompt's and tokens' ids
    chat_token_ids: bool = False  # a streamed /v1/chat/completions does
    chat_prompt_ids: bool = False  # a chat runs ``kv_transfer_params.prompt_token_ids`` as its prompt

    def token_ids(self, chat: bool) -> bool:
        """Does a stream of this route say its token ids (assumed so when not known)?"""
        if not self.known:
            return True
        return self.chat_token_ids if chat else self.completions_token_ids

    def resumes(self, chat: bool) -> bool:
        """Can this engine take over a stream of this route mid-way (it is sent the context as ids)?"""
        if not self.known:
            return True
        return self.chat_token_ids and self.chat_prompt_ids if chat else self.completions_token_ids

    def missing(self) -> list[str]:
        """What a known engine lacks, by field name."""
        if not self.known:
            return []
        return [name for name in _CAPABILITIES if not getattr(self, name)]


_CAPABILITIES = ("completions_token_ids", "chat_token_ids", "chat_prompt_ids")
# What vLLM 0.32 and the simulated engine (which speaks it) do: the engines the agent launches.
VLLM_CAPABILITIES = EngineCapabilities(
    known=True, completions_token_ids=True, chat_token_ids=True, chat_prompt_ids=True
)

# Bounds on ``InstanceInfo.labels`` (1.7): a Hello past them is refused (``invalid_hello``).
MAX_LABELS = 16
LABEL_KEY = re.compile(r"[a-z0-9]([a-z0-9_.-]{0,61}[a-z0-9])?")
MAX_LABEL_VALUE = 128
# The topology labels the scheduler reads (docs/scheduler.md, topology): the machine, the rack or zone,
# and the transfer domain (an NVLink island, say) within which KV moves fastest.
LABEL_NODE = "node"
LABEL_ZONE = "zone"
LABEL_DOMAIN = "domain"


def label_problem(labels: Mapping[str, str]) -> str | None:
    """Why these labels break the bounds, or None where they keep them."""
    if len(labels) > MAX_LABELS:
        return f"{len(labels)} labels, at most {MAX_LABELS}"
    for key, value in labels.items():
        if not LABEL_KEY.fullmatch(key):
            return f"label key {key[:64]!r} is not 1-63 lower-case letters, digits, '_', '.' or '-'"
        if not 1 <= len(value) <= MAX_LABEL_VALUE:
            return f"label {key!r}: its value must be 1 to {MAX_LABEL_VALUE} characters"
    return None


@dataclass(frozen=True, slots=True)
class KvLayout:
    """How the engine runs and lays out its KV cache, as far as its agent could tell (1.7).

    A launched engine's come from its command line and environment, an attached one's from what its
    server says (``/server_info`` in dev mode, ``vllm:cache_config_info``, ``/version``). 0 and "" mean
    not known: an unknown field is never held against a pair (``orchestrator/state/compat.py``).
    """

    tp_size: int = 0
    tp_rank: int = 0
    pp_size: int = 0
    pp_rank: int = 0
    dp_size: int = 0
    dp_rank: int = 0
    dtype: str = ""  # the model's (e.g. bfloat16)
    kv_cache_dtype: str = ""  # "auto" resolved where known (e.g. bfloat16, fp8_e4m3)
    kv_layout: str = ""  # e.g. NHD, HND, or the CPU backend's LBHNC
    attention_backend: str = ""  # e.g. FLASH_ATTN, CPU_ATTN
    vllm_version: str = ""
    model_path: str = ""  # the engine's --model
    max_num_seqs: int = 0  # the engine's batch: decode requests it runs at once


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """What an agent tells the orchestrator about its engine when it says Hello."""

    url: str  # base URL of the engine's OpenAI server, e.g. http://127.0.0.1:8101
    role: Role
    model: str  # served model name clients ask for
    engine: str = "vllm"  # "vllm" or "sim"
    revision: str = ""
    block_size: int = 16
    kv_connector: str = ""  # e.g. NixlConnector; P and D must match to exchange KV
    max_model_len: int = 0
    tokenizer: str = ""  # where the orchestrator can load the tokenizer (vLLM: weights dir); "": bytes (sim)
    tensor_parallel_size: int = 0  # 0: not known (an attached vLLM tells only in dev mode)
    # ``tcp://host:port`` where the agent serves its KV pool's blocks to other agents; "" without a pool.
    kv_pool_endpoint: str = field(default="", metadata=SINCE_MINOR_3)
    capabilities: EngineCapabilities = field(default_factory=EngineCapabilities, metadata=SINCE_MINOR_4)
    # Where it runs (``LABEL_NODE``, ``LABEL_ZONE``, ``LABEL_DOMAIN`` and the operator's own), bounded.
    labels: dict[str, str] = field(default_factory=dict, metadata=SINCE_MINOR_7)
    layout: KvLayout = field(default_factory=KvLayout, metadata=SINCE_MINOR_7)
    # The agent whose KV pool the engine uses, where it shares its host's pool with other engines (one
    # pool per host: blocks move between them through shared memory); "": its own agent's, or none.
    kv_pool_node: str = field(default="", metadata=SINCE_MINOR_9)


MAX_KV_LINKS = 64  # sources a heartbeat reports KV fetches from (``MetricsSnapshot.kv_in_links``)


@dataclass(frozen=True, slots=True)
class KvLinkCount:
    """KV an agent's pool fetched from one other agent's pool, lifetime (1.7)."""

    source: str  # the source pool's endpoint (``InstanceInfo.kv_pool_endpoint`` of its instance)
    nbytes: int = 0
    seconds: float = 0.0  # summed wall time of the fetches, request to last byte
    transfers: int = 0


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """The engine's state as the agent scraped it; windowed values are over the last ``window_s``."""

    scraped_at: float = 0.0  # agent's wall clock
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    ttft_s: float | None = None  # mean time to first token over the window; None without samples
    tpot_s: float | None = None  # mean time per output token over the window
    prefix_cache_hit_rate: float | None = None  # hit tokens / queried tokens over the window
    window_s: float = 0.0
    requests_finished: int = 0  # engine's lifetime count of finished requests
    prompt_tokens: int = 0  # engine's lifetime counters
    generation_tokens: int = 0
    queue_s: float | None = None  # mean time a request waited in the engine's queue over the window
    prefill_tokens_per_s: float | None = None  # prompt tokens prefilled per second of prefill time
    mean_prompt_tokens: float | None = None  # mean prompt length of requests over the window
    # The engine's lifetime ``vllm:prompt_tokens_by_source_total``: prompt tokens it computed, found in
    # its own prefix cache, and pulled from a prefill engine. None where the engine does not export them.
    prompt_tokens_computed: int | None = None
    prompt_tokens_cached: int | None = None
    prompt_tokens_transferred: int | None = None
    age_s: float = 0.0  # seconds from the start of the scrape to the heartbeat that carries it
    sent_at: float = 0.0  # agent's wall clock when the heartbeat carrying it was made (0: unknown)
    # KV this engine pulled in, lifetime (1.7): the ``_sum``s of vLLM's NIXL histograms
    # ``vllm:nixl_bytes_transferred`` and ``vllm:nixl_xfer_time_seconds`` (no source: the gateway knows
    # which P each pull came from). None where the engine exports neither.
    kv_in_bytes: float | None = field(default=None, metadata=SINCE_MINOR_7)
    kv_in_seconds: float | None = field(default=None, metadata=SINCE_MINOR_7)
    # ... and how many transfers they sum (the histograms' ``_count``): the orchestrator attributes an
    # increase to as many of the pulls it sent as finished, oldest first.
    kv_in_transfers: int | None = field(default=None, metadata=SINCE_MINOR_7)
    # KV this agent's pool fetched from other agents' pools, lifetime, per source (1.7; the project's
    # connector), at most ``MAX_KV_LINKS`` sources.
    kv_in_links: list[KvLinkCount] = field(default_factory=list, metadata=SINCE_MINOR_7)
    # Of the prompt blocks this agent's KV pool was asked for over the window, the share it held, in
    # memory or read back from its disk tier (1.8; the project's connector). None: no pool, or no ask.
    kv_pool_hit_rate: float | None = field(default=None, metadata=SINCE_MINOR_8)


@dataclass(frozen=True, slots=True)
class Hello:
    """Agent -> orchestrator, first message of a session."""

    TAG: ClassVar[str] = "hello"
    protocol_version: int
    agent_id: str
    instance: InstanceInfo
    # Random per agent process: a Hello with the incarnation of a live session is that agent back on
    # a new connection (a blip), which resumes its session; any other Hello starts a new one.
    incarnation: str = ""
    protocol_minor: int = field(default=0, metadata=SINCE_MINOR_1)  # absent (0) from agents of 1.0


@dataclass(frozen=True, slots=True)
class Welcome:
    """Orchestrator -> agent: the session is accepted; heartbeat at this interval."""

    TAG: ClassVar[str] = "welcome"
    protocol_version: int
    agent_id: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    protocol_minor: int = field(default=0, metadata=SINCE_MINOR_1)  # 0 to an agent of 1.0


@dataclass(frozen=True, slots=True)
class Refuse:
    """Either side: this frame or session is refused, and why. ``code`` is machine-readable."""

    TAG: ClassVar[str] = "refuse"
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Agent -> orchestrator at a fixed interval: liveness, engine state and a metrics snapshot."""

    TAG: ClassVar[str] = "heartbeat"
    seq: int
    engine_state: EngineState
    draining: bool = False
    metrics: MetricsSnapshot = field(default_factory=MetricsSnapshot)


@dataclass(frozen=True, slots=True)
class Command:
    """Orchestrator -> agent: do something; answered by an ``Ack`` with the same id.

    What to do is ``payload`` (1.5), typed per kind; to a peer before 1.5 the same goes as ``args``,
    a string map (``for_minor``). ``read`` gives the payload whichever of the two a command carries.
    """

    TAG: ClassVar[str] = "command"
    id: int
    kind: CommandKind
    args: dict[str, str] = field(default_factory=dict)  # up to 1.4; empty beside a payload
    payload: CommandPayload | None = field(default=None, metadata=SINCE_MINOR_5)
    # The leadership term of the orchestrator that sent it (1.6), from etcd; 0 from a single
    # orchestrator without etcd. An agent refuses a command older than the newest it has obeyed.
    epoch: int = field(default=0, metadata=SINCE_MINOR_6)

    @classmethod
    def of(cls, id: int, payload: CommandPayload, epoch: int = 0) -> Command:
        """Command ``id`` asking for ``payload``, in leadership term ``epoch``."""
        return cls(id=id, kind=payload.KIND, payload=payload, epoch=epoch)

    def for_minor(self, minor: int) -> Command:
        """This command as an agent of protocol 1.``minor`` reads it: before 1.5, its payload as args
        (an agent before 1.6 ignores ``epoch``: it cannot fence)."""
        if minor >= TYPED_MINOR or self.payload is None:
            return self
        return Command(id=self.id, kind=self.kind, args=to_args(self.payload), epoch=self.epoch)

    def read(self) -> CommandPayload:
        """What this command asks, from its payload or (a peer before 1.5) its args; ``ValueError``
        naming the value that is wrong."""
        payload = self.payload if self.payload is not None else from_args(self.kind, self.args)
        if self.kind != payload.KIND:  # ``kind`` stays on the wire for peers before 1.5: they must agree
            raise ValueError(f"a payload of kind {payload.KIND!r} in a {self.kind!r} command")
        check(payload)
        return payload


@dataclass(frozen=True, slots=True)
class Ack:
    """Agent -> orchestrator: the outcome of ``Command`` ``id``."""

    TAG: ClassVar[str] = "ack"
    id: int
    ok: bool
    error: str = ""
    # Machine-readable reason of a refusal (``RESTART_REQUIRED``); sent only to an orchestrator of 1.2+.
    code: str = field(default="", metadata=SINCE_MINOR_2)
    # Small results of a command (``kv_grant``: ``held``; ``kv_fetch``: ``requested``, ``already_held``,
    # ``reserved``), as decimal strings; sent only to an orchestrator of 1.3 or 1.4.
    detail: dict[str, str] = field(default_factory=dict, metadata=SINCE_MINOR_3)
    # The same, typed (``GrantResult``, ``FetchResult``); sent only to an orchestrator of 1.5+.
    result: AckResult | None = field(default=None, metadata=SINCE_MINOR_5)

    def for_minor(self, minor: int) -> Ack:
        """This Ack as an orchestrator of protocol 1.``minor`` reads it: its result as ``detail``
        before 1.5 (from 1.3; none before), and without ``code`` before 1.2."""
        ack = self
        if minor < TYPED_MINOR and ack.result is not None:
            detail = to_detail(ack.result) if minor >= POOL_MINOR else {}
            ack = replace(ack, result=None, detail=detail)
        if minor < 3 and ack.detail:
            ack = replace(ack, detail={})
        if minor < 2 and ack.code:
            ack = replace(ack, code="")
        return ack


@dataclass(frozen=True, slots=True)
class Goodbye:
    """Either side is leaving on purpose (shutdown), so the other need not wait for a timeout."""

    TAG: ClassVar[str] = "goodbye"
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One change to an engine's prefix cache (vLLM's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``).

    ``stored``: full blocks entered the cache, ``token_ids`` covering one block of ``block_size`` per
    hash, chained to ``parent_block_hash`` (None: the prompt's first block). ``removed``: these blocks
    left it. ``cleared``: it was emptied. Hashes are the engine's, folded to 64 bits. ``medium``
    (1.3) says whose blocks: the engine's prefix cache (``"gpu"``) or its agent's KV pool (``"pool"``,
    hashes ``wire.block_hash.event_hash`` of the pool's keys); the two are indexed apart.
    """

    kind: KvEventKind
    block_hashes: list[int] = field(default_factory=list)
    parent_block_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0  # only ``stored`` events carry one
    medium: str = field(default=MEDIUM_GPU, metadata=SINCE_MINOR_3)


@dataclass(frozen=True, slots=True)
class KvEvents:
    """Agent -> orchestrator: its engine's prefix-cache changes since the last one, in order."""

    TAG: ClassVar[str] = "kv_events"
    seq: int  # the agent's batch counter; grows for the agent process's whole life
    events: list[KvEvent] = field(default_factory=list)
    missed: int = 0  # engine batches lost (gaps in the engine's sequence, buffer overflow) since the last


Message = Hello | Welcome | Refuse | Heartbeat | Command | Ack | Goodbye | KvEvents
MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello,
    Welcome,
    Refuse,
    Heartbeat,
    Command,
    Ack,
    Goodbye,
    KvEvents,
)
