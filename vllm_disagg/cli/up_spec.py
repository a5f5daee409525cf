"""What a local cluster is (``ClusterSpec``: its shape, ports and credentials) and the command line
of each of its processes: the orchestrator (or each replica of it) and one agent per instance.
``up`` (``up.py``) supervises those processes; the benchmarks and the chaos harness start them too.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from vllm_disagg.agent.kv.disk import disk_bytes
from vllm_disagg.cli.up_replicas import ReplicaSet
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import ENV_ADMIN_TOKEN
from vllm_disagg.protocol.messages import label_problem
from vllm_disagg.runtime import SELF_ARGV


@dataclass(frozen=True)
class InstancePlan:
    """One instance to start: its agent id, role and engine port."""

    agent_id: str
    role: str
    engine_port: int
    index: int  # position in the cluster; picks the CPU core a vLLM instance is bound to


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of a local cluster and the ports it uses."""

    engine: str = "vllm"
    prefill: int = 1
    decode: int = 1
    model: str = "tiny"  # the served name clients ask for
    model_path: str = ""  # vLLM weights directory
    engine_args: str = ""  # more vLLM flags for every instance
    kv_load_failure_policy: str = ""  # a decode engine's failed KV pull: "fail", "recompute"; "": default
    kv_lease_s: int = 0  # how long P keeps KV that no decode pulls (vLLM's kv_lease_duration); 0: default
    # The engines' KV connector: NIXL (vLLM's), or "vllm-disagg", the project's over each agent's
    # prefix pool (docs/kv-pool.md), with the pool's capacity.
    kv_connector: str = "NixlConnector"
    kv_connector_config: str = ""  # its settings, a JSON object (protocol/kv_connectors.py)
    kv_pool_capacity: str = ""  # "": the agent's default
    kv_disk_dir: str = ""  # the pools' disk tier: one directory per agent under it; "": none
    # "node": the engines share one pool, the first agent's (they run on this one host); "agent": one
    # pool per agent, blocks moved between them over loopback TCP.
    kv_pool_scope: str = "node"
    kv_disk_capacity: str = ""  # each agent's disk tier, in bytes; "": the agent's default
    engine_startup_timeout_s: float = 900.0
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int = 5555
    engine_base_port: int = 8100
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0  # the gateway's, to an engine
    health_timeout_s: float = 5.0  # each agent's /health check of its engine
    stop_grace_s: float = 10.0
    role_switch: str = "auto"  # how agents' engines take a new role: "auto" or "restart" (--role-switch)
    sim_timing: tuple[tuple[str, str], ...] = ()  # (flag name, value) passed to every sim agent
    extra_orchestrator_args: tuple[str, ...] = field(default=())
    # The admin API's bearer token; a fresh one unless given. The orchestrator reads it from
    # ``admin_token_file`` when set, else from its environment: never from its command line.
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    admin_token_file: str = ""
    # CurveZMQ keys (``with_keys``): the orchestrator admits only these agents. "": no agent auth.
    keys_dir: str = ""
    # Orchestrator replicas on etcd (``--replicas``, ``--etcd``); None: one orchestrator, no etcd.
    replicas: ReplicaSet | None = None
    # Topology labels (docs/scheduler.md, Topology): (key, value) for every instance, then (agent id,
    # key, value) for one, which wins over the former.
    labels: tuple[tuple[str, str], ...] = ()
    instance_labels: tuple[tuple[str, str, str], ...] = ()
    # Every child's logging (``--log-level``, ``--log-format``; docs/observability.md, Logs).
    log_level: str = "INFO"
    log_format: str = "text"
    # Where the vLLM engines send their spans (``--otlp-traces-endpoint``; the orchestrator's own go
    # there too, through ``extra_orchestrator_args``); "": no engine traces.
    otlp_traces_endpoint: str = ""
    otlp_traces_protocol: str = "http/protobuf"

    def pool_owner(self) -> str:
        """The agent whose KV pool every engine shares (they all run on this host); "" for none, or
        one pool per agent."""
        if self.engine != "vllm" or self.kv_connector != "vllm-disagg" or self.kv_pool_scope != "node":
            return ""
        return self.plans()[0].agent_id

    def labels_of(self, agent_id: str) -> dict[str, str]:
        """The labels instance ``agent_id`` gets."""
        labels = dict(self.labels)
        labels.update((key, value) for who, key, value in self.instance_labels if who == agent_id)
        return labels

    def orchestrator_env(self) -> dict[str, str]:
        """The orchestrator child's environment: ours, with the admin token unless a file holds it."""
        env = dict(os.environ)
        if not self.admin_token_file:
            env[ENV_ADMIN_TOKEN] = self.admin_token
        return env

    @property
    def base_url(self) -> str:
        """The gateway's base URL (the first replica's)."""
        return f"http://{self.host}:{self.port}"

    @property
    def replica_count(self) -> int:
        """How many orchestrators: 1 without replicas."""
        return self.replicas.count if self.replicas else 1

    def base_urls(self) -> list[str]:
        """Each orchestrator's gateway base URL, replica 0 first."""
        return [f"http://{self.host}:{self.port + i}" for i in range(self.replica_count)]

    def zmq_endpoints(self) -> list[str]:
        """Each orchestrator's agents' endpoint, replica 0 first."""
        return [f"tcp://127.0.0.1:{self.zmq_port + i}" for i in range(self.replica_count)]

    def plans(self) -> list[InstancePlan]:
        """Agent ids and engine ports (prefill first, then decode)."""
        if self.prefill < 0 or self.decode < 1:
            raise ConfigError(f"need --decode >= 1 and --prefill >= 0, got {self.prefill}P{self.decode}D")
        base = self.engine_base_port
        plans = [InstancePlan(f"prefill-{i}", "prefill", base + i, i) for i in range(self.prefill)]
        plans += [
            InstancePlan(f"decode-{i}", "decode", base + self.prefill + i, self.prefill + i)
            for i in range(self.decode)
        ]
        if plans[-1].engine_port > 65535:
            raise ConfigError(f"--engine-base-port {base} leaves no room for {len(plans)} engines")
        if self.kv_disk_capacity:
            disk_bytes(self.kv_disk_capacity)  # refused here, not by every agent once started
        if self.replicas:  # replicas take port ranges: none may overlap another's or an engine's
            self.replicas.check_ports(self.port, self.zmq_port, [p.engine_port for p in plans])
        self._check_labels([p.agent_id for p in plans])
        return plans

    def _check_labels(self, agent_ids: list[str]) -> None:
        for who, _, _ in self.instance_labels:
            if who not in agent_ids:
                known = ", ".join(agent_ids)
                raise ConfigError(f"--instance-label {who}:...: no instance {who!r} (instances: {known})")
        for agent_id in agent_ids:
            problem = label_problem(self.labels_of(agent_id))
            if problem is not None:
                raise ConfigError(f"labels of {agent_id}: {problem}")

    def orchestrator_argv(self, index: int = 0) -> list[str]:
        """The orchestrator child's command line (replica ``index``'s with replicas)."""
        replica = self.replicas.flags(index, self.host) if self.replicas else []
        return [
            *SELF_ARGV,
            "orchestrator",
            "--host", self.host,
            "--port", str(self.port + index),
            "--zmq-endpoint", self.zmq_endpoints()[index],
            *replica,
            "--heartbeat-interval-s", str(self.heartbeat_interval_s),
            "--heartbeat-timeout-s", str(self.heartbeat_timeout_s),
            "--connect-timeout-s", str(self.connect_timeout_s),
            # Simulated engines tokenize as bytes: the orchestrator needs no transformers.
            *(("--no-preload-tokenizer-libs",) if self.engine == "sim" else ()),
            *(("--admin-token-file", self.admin_token_file) if self.admin_token_file else ()),
            *self._orchestrator_keys(),
            *self._log_flags(),
            *self.extra_orchestrator_args,
        ]  # fmt: skip

    def _log_flags(self) -> tuple[str, ...]:
        if (self.log_level, self.log_format) == ("INFO", "text"):
            return ()  # the children's defaults
        return ("--log-level", self.log_level, "--log-format", self.log_format)

    def _orchestrator_keys(self) -> tuple[str, ...]:
        if not self.keys_dir:
            return ()
        keys = Path(self.keys_dir)
        return (
            "--curve-secret-key",
            str(keys / "orchestrator.key_secret"),
            "--agent-keys",
            str(keys / "agents"),
        )

    def agent_argv(self, plan: InstancePlan) -> list[str]:
        """One agent child's command line."""
        argv = [
            *SELF_ARGV,
            "agent",
            "--engine", self.engine,
            "--role", plan.role,
            "--agent-id", plan.agent_id,
            "--orchestrator", ",".join(self.zmq_endpoints()),
            "--model", self.model,
            "--engine-port", str(plan.engine_port),
            "--health-timeout-s", str(self.health_timeout_s),
            *self._log_flags(),
        ]  # fmt: skip
        if self.kv_load_failure_policy:
            argv += ["--kv-load-failure-policy", self.kv_load_failure_policy]
        if self.kv_lease_s:
            argv += ["--kv-lease-s", str(self.kv_lease_s)]
        if self.engine == "vllm" and self.kv_connector != ClusterSpec.kv_connector:
            argv += ["--kv-connector", self.kv_connector]
        if self.engine == "vllm" and self.kv_connector_config:
            argv += ["--kv-connector-config", self.kv_connector_config]
        owner = self.pool_owner()
        if owner and owner != plan.agent_id:  # its engine uses the host's pool, run by another agent
            argv += ["--kv-pool-node", owner]
        elif self.kv_pool_capacity:
            argv += ["--kv-pool-capacity", self.kv_pool_capacity]
        if self.kv_disk_dir and owner in ("", plan.agent_id):  # one tier per pool, and outlives this run
            argv += ["--kv-disk-dir", str(Path(self.kv_disk_dir) / plan.agent_id)]
        if self.kv_disk_capacity:
            argv += ["--kv-disk-capacity", self.kv_disk_capacity]
        if self.role_switch != "auto":
            argv += ["--role-switch", self.role_switch]
        if self.keys_dir:
            keys = Path(self.keys_dir)
            argv += [
                "--curve-secret-key", str(keys / "agents" / f"{plan.agent_id}.key_secret"),
                "--orchestrator-key", str(keys / "orchestrator.key"),
            ]  # fmt: skip
        if self.engine == "vllm":
            cores = os.cpu_count() or 1
            argv += [
                "--model-path", self.model_path,
                "--omp-threads-bind", str(plan.index % cores),  # one core each while cores last
                "--startup-timeout-s", str(self.engine_startup_timeout_s),
                # The engines can saturate every core; the agents' heartbeats must still get through.
                "--engine-nice", "10",
            ]  # fmt: skip
            if self.otlp_traces_endpoint:
                argv += ["--otlp-traces-endpoint", self.otlp_traces_endpoint]
                argv += ["--otlp-traces-protocol", self.otlp_traces_protocol]
            if self.engine_args:
                argv += ["--engine-args", self.engine_args]
        for name, value in self.sim_timing:
            argv += ["--" + name.replace("_", "-"), value]
        for key, value in sorted(self.labels_of(plan.agent_id).items()):
            argv += ["--label", f"{key}={value}"]
        return argv
