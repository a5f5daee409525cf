"""OpenTelemetry traces of the gateway's requests: one trace per request, joined with the engines' own.

A request's span (``POST /v1/completions``, kind server) continues the client's ``traceparent`` where
it sends a valid one, and has a child span for each stage the gateway waited on: ``tokenize``,
``admission`` (its queue), ``schedule`` (the decision: mode, pair, each pick's score), then one
client span per engine leg (``prefill``, ``kv_fetch``, ``decode``, ``resume``), retries included, each
with its instance and outcome. A leg's request carries the leg span's ``traceparent``, so a vLLM run
with ``--otlp-traces-endpoint`` makes its own spans children of it. Fallbacks and resumes are events
on the request's span.

Off (``OrchestratorConfig.tracing`` None), every request gets ``NO_TRACE``, whose methods do nothing:
no SDK is imported and no span made. On, the SDK (the ``otel`` extra) exports in batches from its own
thread. Stage times are the gateway clock's (monotonic), placed on the wall clock by one offset per
request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from vllm_disagg.config import TracingConfig
from vllm_disagg.orchestrator.scheduling.framework import Decision

RequestHeaders = Mapping[str, str]


class NoTrace:
    """A request's trace when tracing is off: nothing is made or sent."""

    __slots__ = ()
    traceparent: str | None = None  # the request span's, for the log lines (None: tracing is off)
    recording = False  # whether its spans are sampled: what only they show is worked out only then

    def stage(self, name: str, start: float, end: float, **attributes: Any) -> None:
        """A finished stage of the request, from ``start`` to ``end`` (gateway clock seconds)."""

    def leg_headers(self, leg: str, instance: str, started: float, headers: dict[str, str]) -> dict[str, str]:
        """The headers of an engine leg starting at ``started`` (its span opened, its ``traceparent``
        added)."""
        return headers

    def attempt(
        self, leg: str, instance: str, started: float, ended: float, outcome: str, error: str
    ) -> None:
        """An engine leg ended (or a step that failed before one started)."""

    def event(self, name: str, **attributes: Any) -> None:
        """Something that happened to the request (a fallback, a resume)."""

    def end(self, status: int, error: str, at: float) -> None:
        """The request is over, answered with ``status``."""


NO_TRACE = NoTrace()


class Tracing:
    """The SDK's tracer provider of one gateway process, from its config."""

    def __init__(self, config: TracingConfig) -> None:
        try:
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:  # pragma: no cover - the test install has the extra
            raise RuntimeError(
                f"tracing needs the OpenTelemetry SDK: pip install 'vllm-disagg[otel]' ({exc})"
            ) from exc
        self._provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: config.service_name}), sampler=_sampler(config)
        )
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
        self._tracer = self._provider.get_tracer("vllm_disagg.gateway")
        self._propagator = TraceContextTextMapPropagator()

    def request(
        self, method: str, path: str, headers: RequestHeaders, request_id: str, now: float
    ) -> RequestTrace:
        """The trace of a request arriving now (``now``: the gateway clock)."""
        return RequestTrace(self, method, path, headers, request_id, now)

    def shutdown(self) -> None:
        """Export what is left, then stop (the orchestrator's or worker's close)."""
        self._provider.shutdown()


class RequestTrace(NoTrace):
    """The spans of one request."""

    __slots__ = ("_leg", "_mono0", "_propagator", "_span", "_tracer", "_wall0", "recording", "traceparent")

    def __init__(
        self, tracing: Tracing, method: str, path: str, headers: RequestHeaders, request_id: str, now: float
    ) -> None:
        from opentelemetry.trace import SpanKind

        self._tracer, self._propagator = tracing._tracer, tracing._propagator
        self._mono0, self._wall0 = now, time.time_ns()
        parent = self._propagator.extract(headers)  # a malformed traceparent: a new trace
        self._span = self._tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,
                "vllm_disagg.request_id": request_id,
            },
            start_time=self._wall0,
        )
        self.recording = self._span.is_recording()
        c = self._span.get_span_context()
        self.traceparent = f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"
        self._leg: tuple[str, str, Any] | None = None  # (leg, instance, its open span)

    def _ns(self, t: float) -> int:
        return self._wall0 + int((t - self._mono0) * 1e9)

    def _child(self, name: str, start: float, client: bool, attributes: dict[str, Any]) -> Any:
        from opentelemetry.trace import SpanKind, set_span_in_context

        kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
        context = set_span_in_context(self._span)
        return self._tracer.start_span(
            name, context=context, kind=kind, attributes=attributes, start_time=self._ns(start)
        )

    def stage(self, name: str, start: float, end: float, **attributes: Any) -> None:
        self._child(name, start, False, attributes).end(end_time=self._ns(end))

    def leg_headers(self, leg: str, instance: str, started: float, headers: dict[str, str]) -> dict[str, str]:
        from opentelemetry.trace import set_span_in_context

        span = self._child(leg, started, True, {"vllm_disagg.instance": instance})
        self._leg = (leg, instance, span)
        out = dict(headers)
        self._propagator.inject(out, context=set_span_in_context(span))
        return out

    def attempt(
        self, leg: str, instance: str, started: float, ended: float, outcome: str, error: str
    ) -> None:
        from opentelemetry.trace import Status, StatusCode

        open_leg = self._leg
        if open_leg is not None and open_leg[:2] == (leg, instance):
            span, self._leg = open_leg[2], None
        else:  # a step that ended before any request went out (a KV move refused, say)
            span = self._child(leg, started, True, {"vllm_disagg.instance": instance})
        span.set_attribute("vllm_disagg.outcome", outcome)
        if outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, f"{outcome}: {error}" if error else outcome))
        span.end(end_time=self._ns(ended))

    def event(self, name: str, **attributes: Any) -> None:
        self._span.add_event(name, attributes)

    def end(self, status: int, error: str, at: float) -> None:
        from opentelemetry.trace import Status, StatusCode

        if self._leg is not None:  # a leg the client's leaving cut short
            self._leg[2].end(end_time=self._ns(at))
            self._leg = None
        self._span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self._span.set_status(Status(StatusCode.ERROR, error or str(status)))
        self._span.end(end_time=self._ns(at))


def trace_decision(trace: NoTrace, start: float, end: float, decision: Decision) -> None:
    """The ``schedule`` stage of a sampled trace: the pair chosen, each profile's pick with its score
    and the number of candidates scored. Every candidate's scores are in the request's record
    (``GET /admin/v1/requests/{id}``): rendered into every span, they cost as much as the rest of
    the trace (docs/observability.md, What it costs)."""
    if not trace.recording:
        return
    attributes: dict[str, Any] = {"vllm_disagg.mode": decision.mode, "vllm_disagg.decode": decision.decode}
    if decision.prefill is not None:
        attributes["vllm_disagg.prefill"] = decision.prefill
    if decision.explanation is not None:
        for key, value in decision.explanation.summary().items():
            attributes[f"vllm_disagg.decision.{key}"] = value
    trace.stage("schedule", start, end, **attributes)


def _sampler(config: TracingConfig) -> Any:
    """``OTEL_TRACES_SAMPLER``'s sampler of that name (the specification's six)."""
    from opentelemetry.sdk.trace import sampling

    ratio = float(config.sampler_arg) if config.sampler_arg else 1.0
    samplers = {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
    }
    return samplers[config.sampler]


def _exporter(config: TracingConfig) -> Any:
    endpoint = config.endpoint or None  # None: the exporter reads OTEL_EXPORTER_OTLP_* itself
    if config.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if config.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ImportError as exc:  # vLLM brings it; the otel extra does not (HTTP is the default)
            raise RuntimeError(
                f"OTLP over grpc needs opentelemetry-exporter-otlp-proto-grpc installed ({exc})"
            ) from exc
        return Grpc(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)
