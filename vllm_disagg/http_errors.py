"""The one place an error becomes an HTTP answer, for every server of ours (the gateway, the admin
API, gateway workers, the simulated engine).

Handlers raise ``errors.RequestError``s, whose class gives the status, the error's type and any
headers (``vllm_disagg.errors``); ``answering`` wraps a handler so that what it raises goes out as
``error_response`` builds it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from vllm_disagg import jsonutil
from vllm_disagg.errors import EngineRejected, RequestError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: RequestError, headers: dict[str, str]) -> web.Response:
    """An OpenAI-style JSON error (the one builder); an engine's own refusal goes back as it came."""
    if error.headers:
        headers = {**headers, **error.headers}
    if isinstance(error, EngineRejected) and error.body:
        return web.Response(
            status=error.status, body=error.body, content_type="application/json", headers=headers
        )
    return web.Response(
        status=error.status,
        body=jsonutil.dumps(error.to_json()),
        content_type="application/json",
        headers=headers,
    )


def answering(handler: Handler) -> Handler:
    """``handler``, with the ``RequestError`` it raises answered by ``error_response``."""

    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as exc:
            return error_response(exc, {})

    answer.__doc__ = handler.__doc__  # the OpenAPI document reads the handlers' docstrings
    return answer
