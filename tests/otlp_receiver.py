"""An OTLP/HTTP traces receiver for tests: what an OpenTelemetry collector would get, decoded.

``POST /v1/traces`` with an ``ExportTraceServiceRequest`` (protobuf, gzip or not), as the SDK's
exporters and vLLM's send them; each span kept as a ``Span`` with ids in hex.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: int  # 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    status: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    resource: dict[str, Any] = field(default_factory=dict)  # the process's: service.name and the rest


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(v)


class OtlpReceiver:
    """Started with ``start()``; ``url`` is the traces endpoint; ``spans`` every span received."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> OtlpReceiver:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        Span(
                            service=service,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status=s.status.code,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=tuple(e.name for e in s.events),
                            resource=resource,
                        )
                    )
        answer = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type="application/x-protobuf")

    def trace(self, trace_id: str) -> list[Span]:
        """The spans of one trace, by start time."""
        return sorted((s for s in self.spans if s.trace_id == trace_id), key=lambda s: s.start_ns)


class ThreadedReceiver:
    """An ``OtlpReceiver`` on its own thread's event loop, for synchronous fixtures (a whole ``up``)."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otlp-receiver", daemon=True)
        self._thread.start()
        self.receiver = asyncio.run_coroutine_threadsafe(OtlpReceiver().start(), self._loop).result(
            timeout=30
        )
        self.url = self.receiver.url

    @property
    def spans(self) -> list[Span]:
        return list(self.receiver.spans)  # a copy: the receiver's thread appends

    def trace(self, trace_id: str) -> list[Span]:
        return sorted((s for s in self.spans if s.trace_id == trace_id), key=lambda s: s.start_ns)

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.receiver.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
