"""An OTLP/HTTP traces endpoint that takes what it is sent and keeps only counts: where ``bench gateway
--tracing`` has the orchestrator export its spans, so that the benchmark pays for an exporter that
really sends, and no collector competes for the machine's cores."""

from __future__ import annotations

from aiohttp import web


class OtlpSink:
    """``POST /v1/traces``: 200 with an empty ``ExportTraceServiceResponse`` (zero bytes encode it)."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> OtlpSink:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1/traces"
        return self

    async def _export(self, request: web.Request) -> web.Response:
        self.bytes += len(await request.read())
        self.exports += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
