"""One typed, frozen configuration tree, validated before anything starts.

Each part of the product takes its own section; ``__post_init__`` refuses values that cannot work
with a ``ConfigError`` naming the field, so a bad flag fails at start-up rather than at request time.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field, fields

from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.engine_urls import EngineNetworks, host_local_endpoint
from vllm_disagg.protocol.kv_connectors import check_kv_settings
from vllm_disagg.protocol.messages import ROLES, Role, label_problem


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{owner}.{name} must be > 0, got {value}")


def _non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ConfigError(f"{owner}.{name} must be >= 0, got {value}")


def _port(owner: str, name: str, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{owner}.{name} must be a TCP port (0..65535), got {value}")


@dataclass(frozen=True)
class SimTiming:
    """The simulated engine's timing model; all zero means an engine that answers at once."""

    prefill_s_per_token: float = 0.0  # compute per uncached prompt token
    decode_step_s: float = 0.0  # fixed cost of one decode step (one token for every running request)
    decode_step_s_per_seq: float = 0.0  # added per running request in the step
    kv_transfer_s_per_token: float = 0.0  # pulling remote KV, per transferred prompt token
    max_num_seqs: int = 8  # the batch: more requests wait in the queue
    num_blocks: int = 4096  # KV cache capacity in blocks
    block_size: int = 16  # tokens per KV block
    # Real bytes a KV pull carries per pulled token (0: only the token ids), so a slow or shaped network
    # between engines really slows the pull; it takes no delay of its own, as the others do.
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        _non_negative(
            "sim",
            prefill_s_per_token=self.prefill_s_per_token,
            decode_step_s=self.decode_step_s,
            decode_step_s_per_seq=self.decode_step_s_per_seq,
            kv_transfer_s_per_token=self.kv_transfer_s_per_token,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
        _positive(
            "sim", max_num_seqs=self.max_num_seqs, num_blocks=self.num_blocks, block_size=self.block_size
        )

    @property
    def zero_delay(self) -> bool:
        """True when the engine never waits: no step loop is needed."""
        return (
            self.prefill_s_per_token == 0
            and self.decode_step_s == 0
            and self.decode_step_s_per_seq == 0
            and self.kv_transfer_s_per_token == 0
        )


_SIM_TIMING_HELP = {
    "prefill_s_per_token": "prefill seconds per uncached prompt token",
    "decode_step_s": "fixed seconds per engine step",
    "decode_step_s_per_seq": "added seconds per running request per step",
    "kv_transfer_s_per_token": "seconds per prompt token pulled from a prefill engine",
    "max_num_seqs": "batch size; more requests wait",
    "num_blocks": "KV cache capacity in blocks",
    "block_size": "tokens per KV block",
    "kv_bytes_per_token": "real bytes a KV pull carries per pulled token (0: only the token ids)",
}


def sim_timing_flags() -> list[tuple[str, str, type]]:
    """``(flag, field, type)`` for every ``SimTiming`` field: the one flag set of sim-engine, agent and up."""
    defaults = SimTiming()
    return [
        (f"--{f.name.replace('_', '-')}", f.name, type(getattr(defaults, f.name))) for f in fields(SimTiming)
    ]


def add_sim_timing_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, defaults: bool
) -> None:
    """Add the timing flags; without ``defaults`` an unset flag stays None (to pass on only what was set)."""
    timing = SimTiming()
    for flag, name, kind in sim_timing_flags():
        default = getattr(timing, name) if defaults else None
        parser.add_argument(flag, dest=name, type=kind, default=default, help=_SIM_TIMING_HELP[name])


def sim_timing_from_args(args: argparse.Namespace) -> SimTiming:
    """The ``SimTiming`` the flags describe."""
    return SimTiming(**{name: getattr(args, name) for _, name, _ in sim_timing_flags()})


@dataclass(frozen=True)
class SimEngineConfig:
    """A simulated vLLM server."""

    model: str = "sim-model"
    host: str = "127.0.0.1"
    port: int = 8100
    engine_id: str = ""  # shown in kv_transfer_params; defaults to host:port
    max_model_len: int = 4096
    default_max_tokens: int = 16  # vLLM's default for /v1/completions
    timing: SimTiming = field(default_factory=SimTiming)
    kv_lease_s: float = 30.0  # blocks held for a decoder are freed after this if never pulled
    kv_events_port: int = 0  # publish vLLM-style KV-cache events on a ZeroMQ PUB socket here; 0: off
    # vLLM's --enable-prompt-tokens-details: usage reports the prompt tokens served from cache (local
    # prefix hits and KV pulled from a prefill engine). Off by default, as in vLLM.
    prompt_tokens_details: bool = False
    # vLLM's kv_load_failure_policy: "fail" answers 500 when the KV cannot be pulled; "recompute"
    # computes the prompt locally instead (silently slower: the gateway detects it from the usage).
    kv_load_failure_policy: str = "fail"
    # vLLM 0.32: a prefill's KV handle carries its own prefix-cache hits (remote_prefill_cached_tokens)
    # and the decode engine reports that figure as its cached_tokens, whatever it loaded. False: the
    # handle has no such key, and D reports what it loaded (engines that do).
    prefill_cache_in_handle: bool = True

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ConfigError(
                "sim.kv_load_failure_policy must be 'fail' or 'recompute', "
                f"got {self.kv_load_failure_policy!r}"
            )
        _port("sim", "port", self.port)
        _port("sim", "kv_events_port", self.kv_events_port)
        _positive(
            "sim",
            max_model_len=self.max_model_len,
            default_max_tokens=self.default_max_tokens,
            kv_lease_s=self.kv_lease_s,
        )
        if not self.model:
            raise ConfigError("sim.model must not be empty")


_CLUSTER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MIN_LEASE_TTL_S = 2  # etcd's shortest lease with its default election timeout (1 s): 3/2 of it, rounded up


@dataclass(frozen=True)
class ReplicaConfig:
    """This orchestrator as one replica of a replicated control plane (docs/operations.md, "Replicas").

    Replicas of one ``cluster`` find each other and elect their leader in etcd, under the key prefix
    ``/vllm-disagg/<cluster>/``. Without one (``OrchestratorConfig.replica`` None) the orchestrator is
    the single process it always was, and nothing here is read.
    """

    etcd: tuple[str, ...]  # etcd's client URLs (http://host:2379); any one of them will do
    cluster: str = "default"
    replica_id: str = ""  # unique in the cluster; "": <hostname>-<HTTP port>
    # The host other replicas reach this one at (its HTTP port, for forwarded admin writes, and its peer
    # link); "": the HTTP bind host, or this host's name when that is a wildcard.
    advertise_host: str = ""
    peer_port: int = 0  # the replica link's TCP port (ZeroMQ, CurveZMQ with the orchestrator's key); 0: any
    # The leader's etcd lease, in whole seconds (etcd's unit). A leader that cannot renew it steps down
    # before it can expire; a follower takes over once it has (at most this, plus an election).
    lease_ttl_s: int = 3

    def __post_init__(self) -> None:
        if not self.etcd:
            raise ConfigError("replica.etcd needs at least one etcd URL")
        for url in self.etcd:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"replica.etcd: {url!r} is not an http(s):// URL of an etcd client port")
        if not _CLUSTER_NAME.fullmatch(self.cluster):
            raise ConfigError(f"replica.cluster must match {_CLUSTER_NAME.pattern}, got {self.cluster!r}")
        if self.replica_id and not _CLUSTER_NAME.fullmatch(self.replica_id):
            raise ConfigError(
                f"replica.replica_id must match {_CLUSTER_NAME.pattern}, got {self.replica_id!r}"
            )
        _port("replica", "peer_port", self.peer_port)
        if not MIN_LEASE_TTL_S <= self.lease_ttl_s <= 60:
            raise ConfigError(
                f"replica.lease_ttl_s must be {MIN_LEASE_TTL_S}..60 whole seconds, got {self.lease_ttl_s}"
            )


TENANT_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a tenant's name (admission: header, weights)


@dataclass(frozen=True)
class AdmissionConfig:
    """The gateway's admission queue (docs/admission.md): which requests wait in the gateway rather
    than in an engine's queue, in what order, and which are refused at once, with why."""

    enabled: bool = True
    max_queue: int = 1024  # requests waiting per model; past it the worst-ranked one is refused
    max_wait_s: float = 30.0  # the longest any request waits; then 429 ``queue_timeout``
    # A request without a TTFT target is admitted while the prefill its pair would run is predicted to
    # start within this long (the prefill stage's saturation point for it); also its ordering deadline.
    ttft_s: float = 5.0
    # The share of a request's TTFT target (or of ``ttft_s``) that its prefill instance's queue and its
    # own prefill may take: a pair is saturated past it. The rest is left for waiting here, where order,
    # fairness and refusals are kept; an engine queue filled to the whole target gives every request
    # admitted a TTFT at the target, and half of them miss it.
    engine_share: float = 0.4
    # A tenant offering more than its weighted share of the recent load (the last arrivals) fills the
    # engines less deep, the more so the more of the load the tenants within their share offer, and
    # never below this fraction of ``engine_share``: the headroom left is theirs, so their requests go
    # in at once instead of queueing behind the flood (``admission.policy``, "Standing").
    over_share_fill: float = 0.25
    # A decode instance at or above this KV usage is saturated: below the scheduler's kv-usage-filter
    # ceiling (0.95), so that requests wait here before the scheduler has no instance left to offer.
    kv_usage_high: float = 0.9
    # Priorities are vLLM's: lower is sooner, 0 the default. At or above this one, a request is in the
    # sheddable class: refused (never queued) while its pair is saturated.
    sheddable_priority: int = 1
    priority_header: str = "x-priority"
    tenant_header: str = "x-tenant-id"
    # Weighted fair sharing between tenants: weight by tenant name (absent: 1.0).
    tenant_weights: tuple[tuple[str, float], ...] = ()
    # Send the body's ``priority`` on to engines: only for engines run with ``--scheduling-policy
    # priority`` (vLLM refuses a non-zero priority otherwise, so by default the gateway keeps it).
    forward_priority: bool = False
    max_tenant_labels: int = 32  # tenants named in metrics; the rest count as "other"

    def __post_init__(self) -> None:
        _positive(
            "admission",
            max_queue=self.max_queue,
            max_wait_s=self.max_wait_s,
            ttft_s=self.ttft_s,
            kv_usage_high=self.kv_usage_high,
            engine_share=self.engine_share,
            over_share_fill=self.over_share_fill,
        )
        if self.engine_share > 1:
            raise ConfigError(f"admission.engine_share must be <= 1, got {self.engine_share}")
        if self.over_share_fill > 1:
            raise ConfigError(f"admission.over_share_fill must be <= 1, got {self.over_share_fill}")
        _non_negative("admission", max_tenant_labels=self.max_tenant_labels)
        for tenant, weight in self.tenant_weights:
            if not TENANT_NAME.fullmatch(tenant):
                raise ConfigError(f"admission.tenant_weights: bad tenant name {tenant!r}")
            if not math.isfinite(weight):
                raise ConfigError(f"admission.tenant_weights[{tenant}] must be finite, got {weight}")
            _positive("admission", **{f"tenant_weights[{tenant}]": weight})
        for name in ("priority_header", "tenant_header"):
            if not re.fullmatch(r"[A-Za-z0-9-]+", getattr(self, name)):
                raise ConfigError(f"admission.{name} must be an HTTP header name")


TRACE_EXPORTERS = ("otlp", "console")
TRACE_PROTOCOLS = ("http/protobuf", "grpc")
TRACE_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces of the gateway's requests (docs/observability.md, Traces): where spans go.

    ``endpoint``: the OTLP traces URL (``http://collector:4318/v1/traces``; for grpc ``host:4317``);
    "" leaves it to the exporter (``OTEL_EXPORTER_OTLP_*`` or its default). ``sampler`` and
    ``sampler_arg`` are ``OTEL_TRACES_SAMPLER``'s and ``OTEL_TRACES_SAMPLER_ARG``'s values.
    """

    exporter: str = "otlp"
    endpoint: str = ""
    protocol: str = "http/protobuf"
    service_name: str = "vllm-disagg"
    sampler: str = "parentbased_always_on"
    sampler_arg: str = ""

    def __post_init__(self) -> None:
        if self.exporter not in TRACE_EXPORTERS:
            raise ConfigError(f"tracing.exporter must be one of {TRACE_EXPORTERS}, got {self.exporter!r}")
        if self.protocol not in TRACE_PROTOCOLS:
            raise ConfigError(f"tracing.protocol must be one of {TRACE_PROTOCOLS}, got {self.protocol!r}")
        if not self.service_name:
            raise ConfigError("tracing.service_name must not be empty")
        if self.sampler not in TRACE_SAMPLERS:
            raise ConfigError(f"tracing.sampler must be one of {TRACE_SAMPLERS}, got {self.sampler!r}")
        if self.sampler_arg:
            try:
                ratio = float(self.sampler_arg)
            except ValueError:
                ratio = -1.0
            if not 0.0 <= ratio <= 1.0:
                raise ConfigError(f"tracing.sampler_arg must be a ratio in [0, 1], got {self.sampler_arg!r}")


@dataclass(frozen=True)
class OrchestratorConfig:
    """The orchestrator: gateway, registry, agent endpoint."""

    host: str = "127.0.0.1"
    port: int = 8000
    zmq_endpoint: str = "tcp://127.0.0.1:5555"
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.0  # no heartbeat for this long: the instance is dead
    max_body_bytes: int = 16 << 20
    connect_timeout_s: float = 2.0  # to an engine
    # Moving KV between agents' pools (docs/kv-pool.md): how long a holder pins granted blocks, and
    # how long the gateway waits for the holder's grant and for the receiver's fetch to start.
    kv_grant_ttl_s: float = 30.0
    kv_grant_timeout_s: float = 1.0
    kv_fetch_timeout_s: float = 2.0
    # No byte from an engine for this long fails the leg (a prefill's or a non-streamed answer's whole
    # wait counts as one gap). Never a total: a healthy stream may run for hours.
    idle_timeout_s: float = 300.0
    max_frame_bytes: int = 1 << 20
    command_timeout_s: float = 5.0  # an admin command (drain, shutdown) waits this long for the agent's Ack
    # A role change that restarts the engine (docs/planner.md): requests on the instance get this long
    # to finish before it restarts (any left fail over), and the new engine this long to be ready.
    role_drain_timeout_s: float = 30.0
    role_restart_timeout_s: float = 600.0
    scheduler_config: str = ""  # YAML file of the scheduler (docs/scheduler.md); empty: the shipped default
    planner_config: str = ""  # YAML file of the planner (docs/planner.md); empty: advisory, defaults
    # --- recovery (docs/operations.md "Failures") ---
    # No heartbeat this long: stop routing (dead after heartbeat_timeout_s). None: not before death,
    # since agents starved of CPU for a moment send late heartbeats on busy hosts (opt in where hosts
    # are reliable: detection stays heartbeat_timeout_s, routing stops earlier).
    suspect_after_s: float | None = None
    prefill_attempts: int = 2  # prefill instances tried per request before running it colocated
    decode_attempts: int = 3  # decode instances tried per request before its first byte
    max_resumes: int = 3  # mid-stream resumes of one request on another instance
    breaker_failures: int = 3  # consecutive failed legs that open an instance's or a P→D link's breaker
    breaker_open_s: float = 1.0  # first open period before a half-open probe; doubles, up to 30 s
    # Import transformers (and the torch it pulls in) before serving: imported later, mid-traffic, its
    # native libraries load while holding the GIL and freeze the event loop for seconds.
    preload_tokenizer_libs: bool = True
    # Hugging Face tokenizations (cache misses) waiting for or running on the gateway's tokenize thread;
    # beyond that a request is scheduled on its length estimate rather than delayed.
    tokenize_queue: int = 64
    # Gateway processes on the port (SO_REUSEPORT): this one and N-1 workers that share its scheduler
    # state (docs/operations.md, "Gateway workers"). 1: the gateway runs in this process only.
    gateway_workers: int = 1
    # Latency targets of requests that bring none (``x-slo-ttft-ms``/``x-slo-tpot-ms``); None: no target.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Slow clients on the gateway's port (docs/operations.md, "Slow clients"; gateway/deadlines.py).
    client_head_timeout_s: float = 10.0
    client_body_timeout_s: float = 20.0  # plus 1 s per client_body_min_rate bytes received
    client_body_min_rate: float = 500.0  # bytes/s
    client_write_timeout_s: float = 30.0  # a client reading none of its answer this long is dropped
    max_client_connections: int = 4096  # per gateway process; past it, 503 and close
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # --- the admin API (docs/security.md) ---
    # The bearer token every /admin/v1 call must carry; "" closes the admin API. Read from a file or
    # the environment by ``main``, never from argv; kept out of the repr so it is never logged.
    admin_token: str = field(default="", repr=False)
    # Serve the admin API on its own listener (e.g. an operators' network) instead of the gateway's.
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    # --- agent authentication (docs/security.md): both set, or neither ---
    curve_secret_key_file: str = ""  # the orchestrator's .key_secret (vllm-disagg keys)
    agent_keys_dir: str = ""  # one <agent id>.key per agent admitted; an id is bound to its key
    # Without keys, an agent endpoint other hosts can reach lets any of them register an engine and
    # receive users' prompts: refused unless this says the network is trusted.
    insecure_agents: bool = False
    # --- what engines see of a client (docs/security.md) ---
    # The key engines were started with (vLLM's --api-key), sent as the gateway's own Authorization.
    engine_api_key: str = field(default="", repr=False)
    # Without an engine key: pass the client's Authorization header through (engines check clients'
    # keys themselves). Off: a client's credentials never reach an engine.
    forward_client_authorization: bool = False
    # --- where engines may be, and how much of their answers is read (docs/security.md) ---
    # Networks a Hello's engine URL may name beside the agent's own address (and loopback, for an
    # agent on this host): CIDRs separated by commas, or "any" (protocol/engine_urls.py).
    engine_networks: str = ""
    # An engine's whole answer (a prefill's, a non-streamed one's, an error's body), and one event of a
    # streamed answer: past these the leg fails as the engine's error instead of buffering on.
    max_engine_body_bytes: int = 64 << 20
    max_engine_event_bytes: int = 16 << 20
    # --- replicas (docs/operations.md): one replica of a cluster in etcd; None: a single orchestrator
    replica: ReplicaConfig | None = None
    # OpenTelemetry traces of requests (docs/observability.md); None: off, no span is made.
    tracing: TracingConfig | None = None

    def __post_init__(self) -> None:
        _port("orchestrator", "port", self.port)
        if self.admin_port is not None:
            _port("orchestrator", "admin_port", self.admin_port)
        if bool(self.curve_secret_key_file) != bool(self.agent_keys_dir):
            raise ConfigError(
                "orchestrator.curve_secret_key_file and agent_keys_dir go together: give both to admit "
                "only keyed agents, or neither"
            )
        _positive(
            "orchestrator",
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            max_body_bytes=self.max_body_bytes,
            connect_timeout_s=self.connect_timeout_s,
            kv_grant_ttl_s=self.kv_grant_ttl_s,
            kv_grant_timeout_s=self.kv_grant_timeout_s,
            kv_fetch_timeout_s=self.kv_fetch_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            max_frame_bytes=self.max_frame_bytes,
            command_timeout_s=self.command_timeout_s,
            role_drain_timeout_s=self.role_drain_timeout_s,
            role_restart_timeout_s=self.role_restart_timeout_s,
            prefill_attempts=self.prefill_attempts,
            decode_attempts=self.decode_attempts,
            breaker_failures=self.breaker_failures,
            breaker_open_s=self.breaker_open_s,
            tokenize_queue=self.tokenize_queue,
            gateway_workers=self.gateway_workers,
            client_head_timeout_s=self.client_head_timeout_s,
            client_body_timeout_s=self.client_body_timeout_s,
            client_body_min_rate=self.client_body_min_rate,
            client_write_timeout_s=self.client_write_timeout_s,
            max_client_connections=self.max_client_connections,
        )
        _non_negative("orchestrator", max_resumes=self.max_resumes)
        _positive(
            "orchestrator",
            max_engine_body_bytes=self.max_engine_body_bytes,
            max_engine_event_bytes=self.max_engine_event_bytes,
        )
        EngineNetworks.parse(self.engine_networks)  # a network that is none fails here, not at a Hello
        if self.suspect_after_s is not None:
            _positive("orchestrator", suspect_after_s=self.suspect_after_s)
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                "orchestrator.heartbeat_timeout_s must exceed heartbeat_interval_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )
        if not self.zmq_endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"orchestrator.zmq_endpoint must be a ZeroMQ endpoint, got {self.zmq_endpoint!r}"
            )
        if not (self.curve_secret_key_file or self.insecure_agents or host_local_endpoint(self.zmq_endpoint)):
            raise ConfigError(
                f"orchestrator.zmq_endpoint {self.zmq_endpoint} is reachable from other hosts and no agent "
                "keys are given: anyone who reaches it could register an engine and receive users' prompts. "
                "Give --curve-secret-key and --agent-keys (vllm-disagg keys; docs/security.md), or "
                "--insecure-agents on a network you trust"
            )


@dataclass(frozen=True)
class AgentConfig:
    """One agent and the engine it launches or attaches to."""

    agent_id: str
    role: Role
    # The orchestrator's ROUTER endpoint; replicas: a comma-separated list, one session with each.
    orchestrator: str = "tcp://127.0.0.1:5555"
    command_log: str = ""  # a file to append one JSON line per command received to; "": none
    engine: str = "sim"  # "sim" or "vllm"
    model: str = "sim-model"
    engine_host: str = "127.0.0.1"
    engine_port: int = 8100
    attach_url: str = ""  # follow an engine someone else started instead of launching one
    # Agent authentication (docs/security.md): this agent's .key_secret and the orchestrator's .key.
    curve_secret_key_file: str = ""
    orchestrator_key_file: str = ""
    kv_events_endpoint: str = ""  # attach mode: the engine's KV-events PUB to forward; "": none
    # Attach mode: bind here and let the engine's PUB connect (its endpoint names this host), so
    # nothing of the engine's listens beyond the host (a pod's loopback); this host only.
    kv_events_listen: str = ""
    scrape_interval_s: float = 0.25
    metrics_window_s: float = 10.0
    startup_timeout_s: float = 120.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL to the engine's process group after this
    # One /health check waits this long; 3 failed in a row and a ready engine is reported unhealthy.
    health_timeout_s: float = 5.0
    engine_nice: int = 0  # added niceness of the launched engine (keeps the control plane responsive)
    # How a launched engine takes a new role (docs/planner.md): "auto" by routing where it serves both
    # (the simulator, vLLM kv_both), else by restarting it with the role's kv_role; "restart": always.
    role_switch: str = "auto"
    sim: SimTiming = field(default_factory=SimTiming)
    # --- real vLLM (engine "vllm"); see docs/engine.md. --max-num-seqs is sim.max_num_seqs for both.
    model_path: str = ""  # weights directory (e.g. from `vllm-disagg model tiny`); required to launch vLLM
    served_model_name: str = ""  # the name clients ask for; empty: ``model``
    max_model_len: int = 512
    extra_engine_args: tuple[str, ...] = ()  # appended last, so they override the built-in flags
    engine_device: str = "auto"  # "cpu", "cuda", or "auto" (cuda when nvidia-smi is found)
    engine_python: str = ""  # interpreter whose venv holds vLLM; empty: the agent's own
    kv_connector: str = "NixlConnector"  # empty: no --kv-transfer-config (a plain colocated engine)
    kv_connector_config: str = ""  # JSON object: its kv_connector_extra_config (protocol/kv_connectors)
    # vLLM's kv_transfer_config.kv_load_failure_policy, for a decode engine whose KV pull fails: "fail"
    # answers an error, "recompute" computes the prompt itself (silently slower). Empty: vLLM's default
    # ("fail" in 0.32). Passed only with a connector.
    kv_load_failure_policy: str = ""
    # vLLM's kv_transfer_config kv_lease_duration: how long a prefill engine keeps a finished prompt's
    # blocks for a decode engine that never pulls them. 0: the engine's default (30 s). With a connector.
    kv_lease_s: int = 0
    nixl_side_channel_port: int = 0  # 0: engine_port + 1000
    # The node's prefix pool, with kv_connector "vllm-disagg" (docs/kv-pool.md): its size as blocks
    # ("4096"), bytes ("2GiB") or a share of the host's memory ("10%"), and the TCP port other agents
    # fetch its blocks on (0: engine_port + 3000).
    kv_pool_capacity: str = "2GiB"
    kv_pool_port: int = 0
    kv_pool_node: str = ""  # another agent of this host whose pool the engine shares; "": its own
    # Its disk tier: a directory where blocks evicted from memory go and outlive the agent, and its
    # size in bytes ("50GiB"); "": none (docs/kv-pool.md, The disk tier).
    kv_disk_dir: str = ""
    kv_disk_capacity: str = "10GiB"
    kv_events_port: int = 0  # ZMQ PUB port of KV cache events; 0: engine_port + 2000
    omp_threads_bind: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND on CPU, e.g. "0" or "0-3"
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    # The launched vLLM's OpenTelemetry spans (its --otlp-traces-endpoint), over this OTLP protocol;
    # "": it makes none (docs/observability.md, Traces).
    otlp_traces_endpoint: str = ""
    otlp_traces_protocol: str = "http/protobuf"
    # Topology labels said in the Hello (``InstanceInfo.labels``; ``agent/labels.py``), sorted by key.
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.agent_id:
            raise ConfigError("agent.agent_id must not be empty")
        if (problem := label_problem(dict(self.labels))) is not None:
            raise ConfigError(f"agent.labels: {problem}")
        if self.role not in ROLES:
            raise ConfigError(f"agent.role must be one of {list(ROLES)}, got {self.role!r}")
        if self.engine not in ("sim", "vllm"):
            raise ConfigError(f"agent.engine must be 'sim' or 'vllm', got {self.engine!r}")
        endpoints = self.orchestrators
        if not all("://" in e for e in endpoints) or len(set(endpoints)) != len(endpoints):
            raise ConfigError(
                "agent.orchestrator must be ZeroMQ endpoints (tcp://host:port), comma-separated, each "
                f"once; got {self.orchestrator!r}"
            )
        if bool(self.curve_secret_key_file) != bool(self.orchestrator_key_file):
            raise ConfigError(
                "agent.curve_secret_key_file and orchestrator_key_file go together: give both to "
                "authenticate with CurveZMQ keys, or neither"
            )
        _port("agent", "engine_port", self.engine_port)
        _positive(
            "agent",
            scrape_interval_s=self.scrape_interval_s,
            metrics_window_s=self.metrics_window_s,
            startup_timeout_s=self.startup_timeout_s,
            restart_backoff_s=self.restart_backoff_s,
            restart_backoff_max_s=self.restart_backoff_max_s,
            health_timeout_s=self.health_timeout_s,
        )
        _non_negative("agent", stop_grace_s=self.stop_grace_s)
        if self.role_switch not in ("auto", "restart"):
            raise ConfigError(f"agent.role_switch must be 'auto' or 'restart', got {self.role_switch!r}")
        if not 0 <= self.engine_nice <= 19:
            raise ConfigError(f"agent.engine_nice must be 0..19, got {self.engine_nice}")
        _port("agent", "nixl_side_channel_port", self.nixl_side_channel_port)
        _port("agent", "kv_events_port", self.kv_events_port)
        _port("agent", "kv_pool_port", self.kv_pool_port)
        _positive("agent", max_model_len=self.max_model_len, kv_cache_space_gib=self.kv_cache_space_gib)
        if self.otlp_traces_protocol not in TRACE_PROTOCOLS:
            raise ConfigError(
                f"agent.otlp_traces_protocol: one of {TRACE_PROTOCOLS}, got {self.otlp_traces_protocol!r}"
            )
        self._check_kv_events()
        if self.engine_device not in ("auto", "cpu", "cuda"):
            raise ConfigError(
                f"agent.engine_device must be 'auto', 'cpu' or 'cuda', got {self.engine_device!r}"
            )
        kv = (self.kv_connector, self.kv_connector_config, self.kv_load_failure_policy, self.kv_lease_s)
        check_kv_settings(self.role, *kv)

    def _check_kv_events(self) -> None:
        if self.kv_events_endpoint and not self.kv_events_endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                f"agent.kv_events_endpoint must be a ZeroMQ endpoint, got {self.kv_events_endpoint!r}"
            )
        if self.kv_events_listen and not host_local_endpoint(self.kv_events_listen):  # events are prompts
            raise ConfigError(
                f"agent.kv_events_listen must be ipc:// or loopback, got {self.kv_events_listen!r}"
            )

    @property
    def orchestrators(self) -> tuple[str, ...]:
        """The orchestrator replicas' endpoints (one: a single orchestrator)."""
        return tuple(e.strip() for e in self.orchestrator.split(","))

    @property
    def engine_url(self) -> str:
        """The base URL of the engine this agent follows."""
        return self.attach_url.rstrip("/") or f"http://{self.engine_host}:{self.engine_port}"
