"""Orchestrator flags that ``vllm-disagg orchestrator`` and ``up`` share, declared once.

Kept apart from ``main`` so that ``up`` reads them without importing the orchestrator itself.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

from vllm_disagg.config import (
    TRACE_PROTOCOLS,
    TRACE_SAMPLERS,
    AdmissionConfig,
    OrchestratorConfig,
    TracingConfig,
)
from vllm_disagg.errors import ConfigError

_DEFAULTS = OrchestratorConfig()
_ADMISSION = AdmissionConfig()

# Recovery, timeouts and gateway tuning: ``vllm-disagg orchestrator`` takes them, and ``up`` forwards
# each one given to its orchestrator (``add_shared_arguments(..., forwarded=True)``).
SHARED_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    (
        "--idle-timeout-s",
        "idle_timeout_s",
        float,
        "no byte from an engine for this long fails the leg (never a total: streams may run for hours)",
    ),
    (
        "--suspect-after-s",
        "suspect_after_s",
        float,
        "no heartbeat this long: stop routing to the instance before it is dead (default: off)",
    ),
    (
        "--role-drain-timeout-s",
        "role_drain_timeout_s",
        float,
        "a role change that restarts the engine waits this long for the requests on it (then they fail over)",
    ),
    (
        "--role-restart-timeout-s",
        "role_restart_timeout_s",
        float,
        "and this long for the restarted engine to be ready",
    ),
    (
        "--kv-grant-ttl-s",
        "kv_grant_ttl_s",
        float,
        "KV pools: a holder keeps blocks granted to another agent pinned this long if never fetched",
    ),
    ("--kv-grant-timeout-s", "kv_grant_timeout_s", float, "KV pools: wait this long for a holder's grant"),
    (
        "--kv-fetch-timeout-s",
        "kv_fetch_timeout_s",
        float,
        "KV pools: a receiver's fetch must start within this (else its engine computes the prompt)",
    ),
    ("--prefill-attempts", "prefill_attempts", int, "prefill instances tried before running colocated"),
    ("--decode-attempts", "decode_attempts", int, "decode instances tried before the first byte"),
    ("--max-resumes", "max_resumes", int, "mid-stream resumes of one request on another instance"),
    ("--breaker-failures", "breaker_failures", int, "consecutive failed legs that open a breaker"),
    ("--breaker-open-s", "breaker_open_s", float, "first open period of a breaker before its probe"),
    (
        "--tokenize-queue",
        "tokenize_queue",
        int,
        "prompts that may wait for the tokenize thread (vLLM models); beyond, requests are scheduled "
        "on a length estimate",
    ),
    (
        "--slo-ttft-ms",
        "slo_ttft_ms",
        float,
        "TTFT target of requests without an x-slo-ttft-ms header (default: none; docs/scheduler.md)",
    ),
    (
        "--slo-tpot-ms",
        "slo_tpot_ms",
        float,
        "TPOT target of requests without an x-slo-tpot-ms header (default: none)",
    ),
    (
        "--gateway-workers",
        "gateway_workers",
        int,
        "gateway processes on the port (SO_REUSEPORT), sharing one scheduler state; 1: this process only",
    ),
    (
        "--engine-networks",
        "engine_networks",
        str,
        "CIDRs (10.0.0.0/8,fd00::/8) an agent's engine URL may name beside the agent's own address and "
        "loopback, or 'any' (docs/security.md)",
    ),
    (
        "--max-engine-body-bytes",
        "max_engine_body_bytes",
        int,
        "an engine's whole answer (non-streamed, a prefill's) past this fails the leg",
    ),
    (
        "--max-engine-event-bytes",
        "max_engine_event_bytes",
        int,
        "one event of an engine's streamed answer past this fails the leg",
    ),
    (
        "--client-head-timeout-s",
        "client_head_timeout_s",
        float,
        "a client's request line and headers must arrive within this (else 408 and close)",
    ),
    (
        "--client-body-timeout-s",
        "client_body_timeout_s",
        float,
        "a request body must arrive within this, plus a second per --client-body-min-rate bytes received",
    ),
    (
        "--client-body-min-rate",
        "client_body_min_rate",
        float,
        "bytes/s: a body sent slower than this (after --client-body-timeout-s) is cut with 408",
    ),
    (
        "--client-write-timeout-s",
        "client_write_timeout_s",
        float,
        "a client that reads none of its answer for this long is dropped (its engine legs cancelled)",
    ),
    (
        "--max-client-connections",
        "max_client_connections",
        int,
        "open client connections per gateway process; past it a new one is answered 503 and closed",
    ),
)


# The admission queue (docs/admission.md): ``AdmissionConfig``'s fields, as ``admission_<field>``.
ADMISSION_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--admission-max-queue", "max_queue", int, "requests that may wait per model; past it one is refused"),
    ("--admission-max-wait-s", "max_wait_s", float, "the longest a request waits for admission (then 429)"),
    (
        "--admission-ttft-s",
        "ttft_s",
        float,
        "requests without a TTFT target are admitted while their prefill is predicted to start within this",
    ),
    (
        "--admission-engine-share",
        "engine_share",
        float,
        "the share (0..1] of a request's TTFT target its prefill instance's queue may take; the rest is "
        "for waiting in the gateway",
    ),
    (
        "--admission-over-share-fill",
        "over_share_fill",
        float,
        "a tenant offering more than its weighted share of the recent load fills the engines only to this "
        "fraction (0..1] of --admission-engine-share",
    ),
    (
        "--admission-kv-usage-high",
        "kv_usage_high",
        float,
        "a decode instance at or above this KV usage (0..1) takes no more requests from the queue",
    ),
    (
        "--sheddable-priority",
        "sheddable_priority",
        int,
        "requests of this priority or above (vLLM's: lower is sooner) are refused first, never queued",
    ),
    ("--priority-header", "priority_header", str, "the request header that sets a request's priority"),
    ("--tenant-header", "tenant_header", str, "the request header that names a request's tenant"),
)


def parse_tenant_weight(text: str) -> tuple[str, float]:
    """``TENANT=WEIGHT``, a finite weight > 0 (``--tenant-weight``; the simulator's too)."""
    name, sep, value = text.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = 0.0
    if not sep or not name or not 0 < weight < math.inf:
        raise argparse.ArgumentTypeError(f"expected TENANT=WEIGHT with a weight > 0, got {text!r}")
    return name, weight


def add_shared_arguments(group: Any, *, forwarded: bool = False) -> None:
    """The shared flags; ``forwarded`` (``up``): no defaults, so that only the flags given go to the
    orchestrator (``shared_argv``) and its own defaults hold otherwise."""
    for flag, name, kind, help_text in SHARED_FLAGS:
        default = None if forwarded else getattr(_DEFAULTS, name)
        group.add_argument(flag, dest=name, type=kind, default=default, help=help_text)
    group.add_argument(
        "--admission",
        choices=("on", "off"),
        default=None if forwarded else "on",
        help="the gateway's admission queue (docs/admission.md); off: every request goes to an engine",
    )
    for flag, name, kind, help_text in ADMISSION_FLAGS:
        default = None if forwarded else getattr(_ADMISSION, name)
        group.add_argument(flag, dest=f"admission_{name}", type=kind, default=default, help=help_text)
    group.add_argument(
        "--tenant-weight",
        dest="tenant_weights",
        type=parse_tenant_weight,
        action="append",
        default=None,
        metavar="TENANT=WEIGHT",
        help="a tenant's weight in the fair sharing of admission (repeatable; others weigh 1)",
    )
    group.add_argument(
        "--forward-priority",
        action="store_true",
        default=None if forwarded else False,
        help="send requests' priority on to engines (run with vLLM's --scheduling-policy priority)",
    )


def admission_from_args(args: argparse.Namespace) -> AdmissionConfig:
    """The admission section the flags describe (raises ``ConfigError``)."""
    weights = tuple(args.tenant_weights or ())
    if len({name for name, _ in weights}) != len(weights):
        raise ConfigError("--tenant-weight names a tenant twice")
    return AdmissionConfig(
        enabled=args.admission == "on",
        tenant_weights=weights,
        forward_priority=bool(args.forward_priority),
        **{name: getattr(args, f"admission_{name}") for _, name, _, _ in ADMISSION_FLAGS},
    )


def shared_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The shared flags given in ``args`` (parsed with ``forwarded=True``), as orchestrator flags."""
    argv = [
        part
        for flag, name, _, _ in SHARED_FLAGS
        if getattr(args, name, None) is not None
        for part in (flag, str(getattr(args, name)))
    ]
    argv += [
        part
        for flag, name, _, _ in ADMISSION_FLAGS
        if getattr(args, f"admission_{name}", None) is not None
        for part in (flag, str(getattr(args, f"admission_{name}")))
    ]
    if getattr(args, "admission", None) is not None:
        argv += ["--admission", args.admission]
    for name, weight in getattr(args, "tenant_weights", None) or ():
        argv += ["--tenant-weight", f"{name}={weight}"]
    if getattr(args, "forward_priority", None):
        argv.append("--forward-priority")
    return tuple(argv)


# OpenTelemetry traces (docs/observability.md, Traces): each flag stands for the standard variable named,
# which it overrides; tracing is on when an exporter or an endpoint is given either way.
TRACING_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    (
        "--otlp-traces-endpoint",
        "otlp_traces_endpoint",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "the OTLP traces URL",
    ),
    (
        "--otlp-protocol",
        "otlp_protocol",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        f"one of {', '.join(TRACE_PROTOCOLS)}",
    ),
    ("--otel-traces-exporter", "otel_traces_exporter", "OTEL_TRACES_EXPORTER", "otlp, console or none"),
    ("--otel-service-name", "otel_service_name", "OTEL_SERVICE_NAME", "the service name of the spans"),
    ("--otel-traces-sampler", "otel_traces_sampler", "OTEL_TRACES_SAMPLER", ", ".join(TRACE_SAMPLERS)),
    ("--otel-traces-sampler-arg", "otel_traces_sampler_arg", "OTEL_TRACES_SAMPLER_ARG", "a sampling ratio"),
)


def add_tracing_arguments(group: Any) -> None:
    """The tracing flags, on ``vllm-disagg orchestrator`` and ``up``."""
    for flag, dest, variable, meaning in TRACING_FLAGS:
        group.add_argument(flag, dest=dest, default=None, help=f"{meaning} (${variable})")


def tracing_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> TracingConfig | None:
    """The traces the flags and the standard variables ask for; None (off) unless an exporter or an
    endpoint is given, or when ``OTEL_SDK_DISABLED`` is true. Raises ``ConfigError``."""

    def value(dest: str, variable: str) -> str:
        given = getattr(args, dest, None)
        return str(given) if given is not None else environ.get(variable, "").strip()

    settings = {dest: value(dest, variable) for _, dest, variable, _ in TRACING_FLAGS}
    endpoint = settings["otlp_traces_endpoint"]
    # OTEL_EXPORTER_OTLP_ENDPOINT alone also asks for traces: the exporter derives their URL from it.
    configured = bool(endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
    exporter = settings["otel_traces_exporter"].lower()
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter == "none":
        return None
    config = TracingConfig(  # validated even when nothing turns tracing on: a bad value is refused
        exporter=exporter or "otlp",
        endpoint=endpoint,
        protocol=settings["otlp_protocol"] or "http/protobuf",
        service_name=settings["otel_service_name"] or "vllm-disagg",
        sampler=(settings["otel_traces_sampler"] or "parentbased_always_on").lower(),
        sampler_arg=settings["otel_traces_sampler_arg"],
    )
    return config if exporter or configured else None


def tracing_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The tracing flags given to ``up``, for its orchestrator."""
    out: list[str] = []
    for flag, dest, _, _ in TRACING_FLAGS:
        given = getattr(args, dest, None)
        if given is not None:
            out += [flag, str(given)]
    return tuple(out)
