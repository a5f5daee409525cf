"""What a running vLLM says about itself, for an agent that attaches to it (``connect``, ``--attach``).

An attached engine was started by someone else, so the agent cannot know its flags; guessing them
(the simulator's block size, no connector) let the orchestrator pair engines whose KV blocks do not
fit each other. vLLM 0.32 tells an outside observer this much (docs/vllm-attach-facts.md):

- ``GET /v1/models``: every served name, ``root`` (the ``--model`` path or hub id as typed) and the
  real ``max_model_len``;
- ``GET /metrics``: ``vllm:cache_config_info`` carries the engine's real block size and whether prefix
  caching is on; ``vllm:nixl_*`` series exist only when NIXL is the KV connector;
- ``GET /version``, and ``GET /kv_event_sources``: where the engine publishes its KV-cache events;
- only with ``VLLM_SERVER_DEV_MODE=1``: ``GET /server_info?config_format=json``, the whole config
  (connector and ``kv_role``, revision, tensor-parallel size, dtype);
- and what its streamed answers carry (token ids, a chat prompt given as ids), asked with three
  one-token requests (``probe``): a vLLM before 0.10.2 or another server may not say them.

Without dev mode the revision and ``kv_role`` cannot be known, and they are reported as unknown ("")
rather than guessed. The parsers are pure; ``discover`` is the thin HTTP part.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yarl

from vllm_disagg import jsonutil
from vllm_disagg.agent.engine_kinds import tokenizer_source
from vllm_disagg.agent.layout import attached_layout
from vllm_disagg.agent.probe import ProbeUnanswered, probe_capabilities
from vllm_disagg.agent.session import AgentSession, RoleSwitch
from vllm_disagg.agent.vllm_command import launched_kv_role
from vllm_disagg.config import AgentConfig
from vllm_disagg.protocol.engine_urls import host_local_endpoint
from vllm_disagg.protocol.messages import EngineCapabilities, InstanceInfo, KvLayout, Role

log = logging.getLogger(__name__)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
NIXL_PREFIX = "vllm:nixl_"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ROLE_OF_KV_ROLE: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
SERVER_INFO_TIMEOUT_S = 60.0  # vLLM's first /server_info runs collect_env (see ``discover``)


class DiscoveryError(Exception):
    """The engine did not answer what discovery needs (``/v1/models``), or left a question unanswered."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """A running vLLM as it describes itself; "" or 0 where it does not say."""

    served_names: tuple[str, ...]
    root: str = ""  # --model as typed: a path or a hub id (not a revision)
    max_model_len: int = 0
    block_size: int = 0
    prefix_caching: bool | None = None
    kv_connector: str = ""
    kv_role: str = ""  # dev mode only
    revision: str = ""  # dev mode only
    tensor_parallel_size: int = 0  # dev mode only
    dtype: str = ""  # dev mode only
    version: str = ""
    kv_events_endpoint: str = ""  # where to subscribe to its KV-cache events ("": it publishes none)
    kv_events_exposed: tuple[str, ...] = ()  # its KV-event sockets other hosts can reach (it says)
    dev_mode: bool = False
    notes: tuple[str, ...] = field(default=())  # what could not be learned, for the operator's log
    capabilities: EngineCapabilities = field(default_factory=EngineCapabilities)  # what its answers carry
    layout: KvLayout = field(default_factory=KvLayout)  # agent/layout.py ``attached_layout``

    @property
    def role(self) -> Role | None:
        """The role the engine's ``kv_role`` allows (None when unknown or without a connector)."""
        return _ROLE_OF_KV_ROLE.get(self.kv_role)


def check_role(role: Role, facts: EngineFacts) -> None:
    """``DiscoveryError`` when the engine's ``kv_role`` (if it tells) cannot serve ``role``."""
    if facts.role is not None and facts.role not in (role, "both"):
        raise DiscoveryError(
            f"the engine's kv_role is {facts.kv_role}: it can serve as {facts.role}, not {role}"
        )


def role_switch(cfg: AgentConfig, role: Role, facts: EngineFacts | None) -> RoleSwitch:
    """How the engine can serve ``role``: the ``set_role`` check.

    The simulator serves any role as it runs. A vLLM's ``kv_role`` is fixed when it starts: one the
    agent launched serves another role by routing if it is ``kv_both``, else the agent restarts it with
    the new role's ``kv_role``; an attached one (the agent cannot restart it) only the role it says (in
    dev mode; unknown is allowed). ``role_switch: restart`` restarts any launched engine.
    """
    if role == cfg.role:
        return RoleSwitch("live")
    if cfg.attach_url:
        if facts is not None:
            try:
                check_role(role, facts)
            except DiscoveryError as exc:
                return RoleSwitch("refuse", str(exc))
        return RoleSwitch("live")
    if cfg.engine == "vllm" and not cfg.kv_connector:
        why = "the engine runs without a KV connector: it can only serve whole requests (role both)"
        return RoleSwitch("refuse", why)
    if cfg.role_switch == "restart":
        return RoleSwitch("restart", f"role_switch is restart: the engine restarts as {role}")
    if cfg.engine != "vllm":
        return RoleSwitch("live")

    kv_role = launched_kv_role(cfg)
    if kv_role != "kv_both":
        return RoleSwitch("restart", f"the engine was launched with kv_role {kv_role}: it restarts as {role}")
    return RoleSwitch("live")


def attached_instance_info(cfg: AgentConfig, facts: EngineFacts) -> tuple[InstanceInfo, list[str]]:
    """The Hello of an agent attached to the engine ``facts`` describe, and what the operator should
    read about it. ``DiscoveryError`` when the engine cannot serve the agent's role."""
    check_role(cfg.role, facts)
    notes = list(facts.notes)
    wanted = cfg.served_model_name or cfg.model
    model = wanted
    if wanted not in facts.served_names:
        model = facts.served_names[0]
        notes.append(f"the engine serves {list(facts.served_names)}, not {wanted!r}: registered as {model!r}")
    block_size = facts.block_size or cfg.sim.block_size
    if not facts.block_size:
        notes.append(f"block size taken from the config: {block_size}")
    info = InstanceInfo(
        url=cfg.engine_url,
        role=cfg.role,
        model=model,
        engine=cfg.engine,
        revision=facts.revision,
        block_size=block_size,
        # The simulator moves KV its own way (and shows vLLM's nixl series for dashboards); a launched
        # one says no connector, so an attached one must too, or the two would never be paired.
        kv_connector=facts.kv_connector if cfg.engine == "vllm" else "",
        max_model_len=facts.max_model_len,
        tokenizer=tokenizer_source(cfg),
        tensor_parallel_size=facts.tensor_parallel_size,
        capabilities=facts.capabilities,
        layout=facts.layout,
        labels=dict(cfg.labels),
    )
    return info, notes


def parse_models(body: Any) -> tuple[tuple[str, ...], str, int]:
    """``/v1/models`` -> (served names, root, max_model_len); ``DiscoveryError`` if it has no model."""
    data = body.get("data") if isinstance(body, dict) else None
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)] if data else []
    # LoRA adapters are listed too, with the base model as ``parent``: only base models serve as-is.
    base = [c for c in cards if not c.get("parent")]
    if not base:
        raise DiscoveryError(f"/v1/models lists no model: {jsonutil.dumps(body).decode()[:200]}")
    root = base[0].get("root")
    max_len = base[0].get("max_model_len")
    return (
        tuple(c["id"] for c in base),
        root if isinstance(root, str) else "",
        max_len if isinstance(max_len, int) else 0,
    )


def metric_labels(exposition: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample of ``name`` in a Prometheus text exposition, None if absent."""
    for line in exposition.splitlines():
        if line.startswith(name + "{"):
            end = line.rfind("}")
            return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(line[:end])}
    return None


def parse_metrics(exposition: str) -> tuple[int, bool | None, str]:
    """``/metrics`` -> (block size, prefix caching on, KV connector): 0, None, "" where it does not say."""
    info = metric_labels(exposition, CACHE_CONFIG_INFO) or {}
    block = info.get("block_size", "")
    caching = info.get("enable_prefix_caching")
    nixl = any(line.startswith(NIXL_PREFIX) for line in exposition.splitlines())
    return (
        int(block) if block.isdigit() else 0,
        None if caching is None else caching == "True",
        "NixlConnector" if nixl else "",
    )


def parse_server_info(body: Any) -> dict[str, Any]:
    """Dev mode's ``/server_info?config_format=json`` -> the fields discovery uses (absent: left out)."""
    config = body.get("vllm_config") if isinstance(body, dict) else None
    if not isinstance(config, dict):
        return {}

    def section(name: str) -> Mapping[str, Any]:
        value = config.get(name)
        return value if isinstance(value, dict) else {}

    model, cache, parallel = section("model_config"), section("cache_config"), section("parallel_config")
    transfer = section("kv_transfer_config")
    found: dict[str, Any] = {
        "revision": model.get("revision"),
        "dtype": model.get("dtype"),
        "max_model_len": model.get("max_model_len"),
        "tensor_parallel_size": parallel.get("tensor_parallel_size"),
        "block_size": cache.get("block_size"),
        "kv_connector": transfer.get("kv_connector"),
        "kv_role": transfer.get("kv_role"),
    }
    kinds = {"revision": str, "dtype": str, "kv_connector": str, "kv_role": str}
    return {
        k: v
        for k, v in found.items()
        if v is not None and isinstance(v, kinds.get(k, int)) and not isinstance(v, bool)
    }


def parse_kv_event_sources(body: Any, engine_host: str) -> str:
    """``/kv_event_sources`` -> the ZMQ endpoint to subscribe to ("" if none), a bound wildcard made the
    engine's host. With data parallelism each rank publishes apart; rank 0's is the one followed."""
    if not isinstance(body, dict) or not body:
        return ""
    source = body.get("0", next(iter(body.values())))
    if not isinstance(source, dict) or not source.get("enable_kv_cache_events"):
        return ""
    endpoint = source.get("endpoint")
    if source.get("publisher") != "zmq" or not isinstance(endpoint, str):
        return ""
    if endpoint.startswith("ipc://"):
        return endpoint  # a socket file: reachable only on the engine's host, as it is
    if not endpoint.startswith("tcp://"):
        return ""
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::"):
        host = engine_host
    return f"tcp://{host}:{port}"


def exposed_kv_event_sources(body: Any) -> tuple[str, ...]:
    """The ZMQ endpoints in ``/kv_event_sources`` that other hosts can reach: a PUB or replay ROUTER
    vLLM binds on ``tcp://*`` or a non-loopback address, or a host it sends the events to."""
    if not isinstance(body, dict):
        return ()
    found: list[str] = []
    for source in body.values():
        if not isinstance(source, dict) or not source.get("enable_kv_cache_events"):
            continue
        for key in ("endpoint", "replay_endpoint"):
            endpoint = source.get(key)
            if isinstance(endpoint, str) and endpoint and not host_local_endpoint(endpoint):
                found.append(endpoint)
    return tuple(dict.fromkeys(found))


def warn_exposed_kv_events(subscribed: str, facts: EngineFacts | None) -> tuple[str, ...]:
    """Log a warning when an attached engine's KV events can be read from other hosts; which endpoints.

    The events carry every cached block's token ids, users' prompts, and only the agent beside the
    engine needs them. An attached engine's ``--kv-events-config`` is its operator's, so the agent
    cannot change it, only say so loudly: ``ipc://`` or a loopback address keeps them on the host."""
    exposed = list(facts.kv_events_exposed) if facts is not None else []
    if subscribed and not host_local_endpoint(subscribed):
        exposed.append(subscribed)
    exposed = list(dict.fromkeys(exposed))
    if exposed:
        log.warning(
            "the engine's KV-cache events (every cached prompt's token ids) can be read from other hosts "
            "at %s: start vLLM with --kv-events-config endpoint ipc:///a/private/dir/events.sock (or "
            "firewall the port) and no replay_endpoint, and pass that endpoint to the agent "
            "(docs/agent.md, KV events)",
            ", ".join(exposed),
        )
    return tuple(exposed)


def _events_endpoint(events: tuple[int, bytes], url: str) -> str:
    """Where to subscribe to the engine's KV events, from its ``/kv_event_sources`` answer ("": none)."""
    if events[0] != 200:
        return ""
    return parse_kv_event_sources(_json(events[1]), yarl.URL(url).host or "127.0.0.1")


async def discover(
    http: aiohttp.ClientSession,
    url: str,
    *,
    timeout_s: float = 10.0,
    server_info_timeout_s: float = SERVER_INFO_TIMEOUT_S,
    known: EngineFacts | None = None,
) -> EngineFacts:
    """Ask the vLLM at ``url`` what it is. ``DiscoveryError`` when a question gets no answer at all (a
    timeout or a dropped connection: silence must not be read as "not there", or an engine that was
    only slow would be registered without its ``kv_role``) or ``/v1/models`` does not answer 200. A
    4xx is an answer: a 404 on ``/server_info`` says dev mode is off.

    ``/server_info`` has its own, longer budget (at least ``server_info_timeout_s``): vLLM 0.32 answers
    its first one only after ``collect_env``, which shells out to pip and nvidia-smi (3.5 s idle, 10+ s busy).

    ``known``: what an earlier look found. An engine that says the same version and serves the same
    models keeps its capabilities without being probed again: the probes are real requests, and
    whether a server returns token ids is a matter of its version.
    """
    base = url.rstrip("/")
    answers = await _ask(http, base, timeout_s, max(timeout_s, server_info_timeout_s))
    (m_status, models), (x_status, metrics), (v_status, version), (s_status, server), events = answers
    if m_status != 200:
        why = models.decode(errors="replace")[:200] or "no answer"
        raise DiscoveryError(f"GET {base}/v1/models: {m_status}: {why}")
    names, root, max_len = parse_models(_json(models))
    v = _json(version) if v_status == 200 else {}
    said_version = str(v.get("version", "")) if isinstance(v, dict) else ""
    capabilities, notes = await _capabilities(http, base, names, said_version, known, timeout_s)
    block, caching, connector = 0, None, ""
    if x_status == 200:
        block, caching, connector = parse_metrics(metrics.decode(errors="replace"))
    if not block:
        notes.append("no vllm:cache_config_info on /metrics (--disable-log-stats?): block size unknown")
    dev = parse_server_info(_json(server)) if s_status == 200 else {}
    if not dev:
        notes.append("no /server_info (VLLM_SERVER_DEV_MODE unset): kv_role, revision, TP size unknown")
    return EngineFacts(
        served_names=names,
        root=root,
        max_model_len=dev.get("max_model_len", max_len),
        block_size=dev.get("block_size", block),
        prefix_caching=caching,
        kv_connector=dev.get("kv_connector", connector),
        kv_role=dev.get("kv_role", ""),
        revision=dev.get("revision", ""),
        tensor_parallel_size=dev.get("tensor_parallel_size", 0),
        dtype=dev.get("dtype", ""),
        version=said_version,
        kv_events_endpoint=_events_endpoint(events, url),
        kv_events_exposed=exposed_kv_event_sources(_json(events[1])) if events[0] == 200 else (),
        dev_mode=bool(dev),
        notes=tuple(notes),
        capabilities=capabilities,
        layout=_layout(root, said_version, (x_status, metrics), (s_status, server)),
    )


def _layout(root: str, version: str, metrics: tuple[int, bytes], server: tuple[int, bytes]) -> KvLayout:
    exposition = metrics[1].decode(errors="replace") if metrics[0] == 200 else ""
    return attached_layout(
        root=root,
        version=version,
        cache_info=metric_labels(exposition, CACHE_CONFIG_INFO),
        server_info=_json(server[1]) if server[0] == 200 else None,
    )


async def _capabilities(
    http: aiohttp.ClientSession,
    base: str,
    names: tuple[str, ...],
    version: str,
    known: EngineFacts | None,
    timeout_s: float,
) -> tuple[EngineCapabilities, list[str]]:
    """What the engine can do, and notes for the operator: as ``known`` found when the engine says the
    same version and serves the same models, else probed."""
    if known is not None and version and (known.version, known.served_names) == (version, names):
        return known.capabilities, []
    try:
        return await probe_capabilities(http, base, names[0], timeout_s=timeout_s)
    except ProbeUnanswered as exc:
        raise DiscoveryError(str(exc)) from None


_PATHS = ("/v1/models", "/metrics", "/version", "/server_info?config_format=json", "/kv_event_sources")


async def _ask(
    http: aiohttp.ClientSession, base: str, timeout_s: float, server_info_timeout_s: float
) -> list[tuple[int, bytes]]:
    """Every question at once, each answer as (status, body); ``DiscoveryError`` if one got none."""

    async def get(path: str, budget_s: float) -> tuple[int, bytes]:
        try:
            async with http.get(base + path, timeout=aiohttp.ClientTimeout(total=budget_s)) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            return 0, f"no answer in {budget_s:g} s".encode()
        except aiohttp.ClientError as exc:
            return 0, (str(exc) or type(exc).__name__).encode()

    answers = await asyncio.gather(*(
        get(path, server_info_timeout_s if path.startswith("/server_info") else timeout_s)
        for path in _PATHS
    ))  # fmt: skip
    for path, (status, said) in zip(_PATHS, answers, strict=True):
        if status == 0:
            raise DiscoveryError(f"GET {base}{path}: unreachable: {said.decode(errors='replace')[:200]}")
    return answers


def _json(raw: bytes) -> Any:
    try:
        return jsonutil.loads(raw)
    except ValueError:
        return None


class AttachedEngine:
    """Keeps an attached agent's Hello true to its engine: asks the engine at start and again each time
    it turns ready (someone may have restarted it with other flags), and says Hello again on a change.
    """

    def __init__(self, cfg: AgentConfig, http: aiohttp.ClientSession) -> None:
        self._cfg = cfg
        self._http = http
        self._task: asyncio.Task[None] | None = None
        self.session: AgentSession | None = None
        self.facts: EngineFacts | None = None

    async def first_look(self) -> InstanceInfo | None:
        """The Hello as the engine describes itself, None while it does not answer (``DiscoveryError``
        when it cannot serve the agent's role: the agent must not register)."""
        try:
            facts = await discover(self._http, self._cfg.engine_url)
        except DiscoveryError as exc:
            log.info("engine not described yet (%s); will ask again once it is ready", exc)
            return None
        return self._adopt(facts)

    def _adopt(self, facts: EngineFacts, cfg: AgentConfig | None = None) -> InstanceInfo:
        info, notes = attached_instance_info(cfg or self._cfg, facts)
        self.facts = facts
        log.info(
            "attached engine: vLLM %s serving %s (root %r), block size %d, max model len %d, connector %r, "
            "kv_role %r, TP %s",
            facts.version or "?", list(facts.served_names), facts.root, info.block_size, info.max_model_len,
            info.kv_connector, facts.kv_role or "unknown", facts.tensor_parallel_size or "unknown",
        )  # fmt: skip
        for note in notes:
            log.warning("attached engine: %s", note)
        return info

    def engine_state(self, state: str) -> None:
        """The supervisor's state callback: look again when the engine turns ready."""
        if state == "ready" and self.session is not None and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._look_again(self.session), name="attach-discovery")

    async def _look_again(self, session: AgentSession) -> None:
        try:
            facts = await discover(self._http, self._cfg.engine_url, known=self.facts)
            # The role is the session's: the orchestrator may have changed it since the agent started.
            cfg = dataclasses.replace(self._cfg, role=session.instance.role)
            info = self._adopt(facts, cfg)
        except DiscoveryError as exc:
            log.error("attached engine: %s; keeping what the orchestrator was told", exc)
            return
        if info != session.instance:
            log.warning("attached engine changed: saying Hello again as %s", info)
            session.set_instance(info)

    async def close(self) -> None:
        """Stop a look in progress."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
