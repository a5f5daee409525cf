"""The live dashboard at ``/dashboard``: plain HTML, JavaScript and CSS, shipped as package data.

No build step and no data in the page: the script asks the operator for the admin token, keeps it in
the tab's ``sessionStorage``, and reads the admin API (``/admin/v1/...``) with it, so the page itself
needs no token and the API stays the one place that checks it. That is why the dashboard is served
beside the admin routes, on the admin listener when there is one: same origin, so the browser sends
the token to nothing else. ``Cache-Control: no-cache`` makes a browser revalidate after an upgrade
instead of running a stale script against a newer API. The files are read once, when the routes are
added, so serving them never touches the disk from the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

# (path, file under static/, content type)
_FILES = (
    ("/dashboard", "dashboard.html", "text/html"),
    ("/dashboard/dashboard.js", "dashboard.js", "text/javascript"),
    ("/dashboard/dashboard.css", "dashboard.css", "text/css"),
)
# The page runs only its own script and talks only to its own origin; no framing, so its buttons
# cannot be clicked through another site's page.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _static(body: bytes, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    headers = {
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": _CSP,
    }

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=headers)

    return serve


async def _to_page(request: web.Request) -> web.Response:
    raise web.HTTPPermanentRedirect("/dashboard")


def add_dashboard_routes(app: web.Application) -> None:
    """Serve ``/dashboard`` and its script and style sheet (``/dashboard/<file>``) on ``app``."""
    for path, file_name, content_type in _FILES:
        app.router.add_get(path, _static(_read(file_name), content_type))
    app.router.add_get("/dashboard/", _to_page)  # a trailing slash typed by hand still finds the page
