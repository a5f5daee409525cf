"""The admin API's bearer token: where it comes from, and the check in front of every admin route.

The token comes from a file (``--admin-token-file``) or the environment (``VLLM_DISAGG_ADMIN_TOKEN``),
never from the command line, where any local user could read it in ``ps``. Every ``/admin/v1`` route
wants ``Authorization: Bearer <token>``, compared in constant time; anything else is a 401 with a
JSON reason. An orchestrator started without a token refuses every admin call, saying how to set one:
no state changes on an unauthenticated request, ever.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from aiohttp import web

from vllm_disagg.errors import ConfigError, Unauthorized
from vllm_disagg.private_files import private_dir, write_private

ENV_ADMIN_TOKEN = "VLLM_DISAGG_ADMIN_TOKEN"
ENV_ENGINE_API_KEY = "VLLM_DISAGG_ENGINE_API_KEY"
_MIN_TOKEN_CHARS = 16
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_admin_token(path: str = "", env: Mapping[str, str] | None = None) -> str:
    """The token from ``path`` if given, else from the environment; "" when neither has one.

    ``ConfigError`` for a file that cannot be read, is empty, or holds a token too short to be safe.
    """
    return load_secret(path, ENV_ADMIN_TOKEN, "admin token", env)


def load_secret(path: str, variable: str, what: str, env: Mapping[str, str] | None = None) -> str:
    """A secret from the file ``path`` if given, else from the environment ``variable``; "" for none."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
        source = f"the {what} file {path}"
    else:
        token = (os.environ if env is None else env).get(variable, "").strip()
        source = variable
        if not token:
            return ""
    if len(token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(
            f"{source} must hold one token of at least {_MIN_TOKEN_CHARS} characters without spaces"
        )
    return token


def write_admin_token(path: Path) -> str:
    """Make a new random token in ``path``, readable by its owner only; returns it."""
    token = secrets.token_urlsafe(32)
    # O_TRUNC on a file already there would keep its old (maybe looser) mode: a new file, in a 0700
    # directory of this user's.
    write_private(private_dir(path.parent) / path.name, (token + "\n").encode())
    return token


def admin_headers(token: str) -> dict[str, str]:
    """The header an admin client sends."""
    return {"Authorization": f"Bearer {token}"}


def bearer_matches(header: str | None, token: str) -> bool:
    """Does an ``Authorization`` header carry ``token`` (constant time in the token's contents)?"""
    if not token or header is None:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def guarded(handler: Handler, token: str) -> Handler:
    """``handler`` behind the admin token; ``Unauthorized`` without it (``http_errors.answering``
    answers that)."""

    async def check(request: web.Request) -> web.StreamResponse:
        if not token:
            raise Unauthorized(
                "the admin API is closed: no admin token is configured (start the orchestrator with "
                f"--admin-token-file FILE or {ENV_ADMIN_TOKEN})"
            )
        header = request.headers.get("Authorization")
        if header is None:
            raise Unauthorized("missing 'Authorization: Bearer <admin token>'")
        if not bearer_matches(header, token):
            raise Unauthorized("wrong admin token")
        return await handler(request)

    check.__doc__ = handler.__doc__
    return check
