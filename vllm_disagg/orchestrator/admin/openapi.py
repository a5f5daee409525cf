"""The admin API's OpenAPI document, generated from the route table the app registers.

Each route's summary is the first line of its handler's docstring; path parameters come from the path,
query parameters from the route's declaration. Every route wants the bearer token (docs/security.md)
and answers errors in one JSON shape, which the document says once as components.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_disagg import __version__

_PARAM = re.compile(r"\{([^}]+)\}")
_LEAD = re.compile(r"^``[A-Z]+ [^`]+``:?\s*")  # "``GET /admin/v1/...``: " at the start of a docstring


@dataclass(frozen=True, slots=True)
class AdminRoute:
    """One admin route: the table both the router and the OpenAPI document are built from."""

    method: str
    path: str
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    query: tuple[tuple[str, str, str], ...] = ()  # (name, JSON schema type, description)


def path_regex(path: str) -> str:
    """A regex matching the concrete paths of a route path (each ``{name}`` one segment)."""
    return "".join(
        "[^/]+" if part.startswith("{") else re.escape(part) for part in re.split(r"(\{[^}]+\})", path)
    )


def summary(route: AdminRoute) -> str:
    """The handler docstring's first line, without the leading ``METHOD path``."""
    doc = (route.handler.__doc__ or "").strip().splitlines()
    text = _LEAD.sub("", doc[0]) if doc else ""
    return text or f"{route.method} {route.path}"


def operation_id(route: AdminRoute) -> str:
    """``get_admin_v1_requests_request_id`` for ``GET /admin/v1/requests/{request_id}``."""
    words = _PARAM.sub(lambda m: m.group(1), route.path).strip("/").replace("/", "_").replace(".", "_")
    return f"{route.method.lower()}_{words}"


def document(routes: Iterable[AdminRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes``."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in _PARAM.findall(route.path)
        ]
        parameters += [
            {"name": name, "in": "query", "required": False, "schema": {"type": kind}, "description": text}
            for name, kind, text in route.query
        ]
        operation: dict[str, Any] = {
            "summary": summary(route),
            "operationId": operation_id(route),
            "security": [{"bearer": []}],
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {}}},
                "401": {"$ref": "#/components/responses/Unauthorized"},
                "4XX": {"$ref": "#/components/responses/Error"},
                "5XX": {"$ref": "#/components/responses/Error"},
            },
        }
        if parameters:
            operation["parameters"] = parameters
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "vllm-disagg admin API", "version": __version__},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": "integer"},
                            },
                        }
                    },
                }
            },
            "responses": {
                "Unauthorized": {"description": "no or a wrong admin token", **error},
                "Error": {"description": "the one JSON error shape", **error},
            },
        },
    }
