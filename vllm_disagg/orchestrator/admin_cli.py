"""``vllm-disagg status`` and ``vllm-disagg drain``: the admin API from a terminal.

Blocking ``urllib`` on purpose: these commands run no event loop of their own.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.auth import ENV_ADMIN_TOKEN, admin_headers, load_admin_token

DEFAULT_URL = "http://127.0.0.1:8000"
_TIMEOUT_S = 15.0
_COLUMNS = (
    ("AGENT", "agent_id"),
    ("STATE", "state"),
    ("ROLE", "role"),
    ("MODEL", "model"),
    ("URL", "url"),
    ("IN-FLIGHT", "in_flight"),
    ("RUN", "num_running"),
    ("WAIT", "num_waiting"),
    ("KV%", "kv"),
    ("HB-AGO", "seconds_since_heartbeat"),
)


def add_arguments_for(name: str, parser: argparse.ArgumentParser) -> None:
    """Flags of ``status`` and ``drain``."""
    parser.add_argument(
        "--url",
        default=os.environ.get("VLLM_DISAGG_URL", DEFAULT_URL),
        help="orchestrator base URL (default: $VLLM_DISAGG_URL or %(default)s)",
    )
    parser.add_argument(
        "--admin-token-file",
        default="",
        metavar="FILE",
        help=f"file holding the admin token (default: ${ENV_ADMIN_TOKEN})",
    )
    if name == "drain":
        parser.add_argument("agent_id", metavar="ID", help="the instance's agent id")
        parser.add_argument("--undo", action="store_true", help="undrain instead")


def _call(method: str, url: str, token: str) -> tuple[int, Any]:
    headers = admin_headers(token) if token else {}
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=_TIMEOUT_S) as resp:
            return resp.status, jsonutil.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, jsonutil.loads(body)
        except ValueError:
            return exc.code, {"error": {"message": body.decode(errors="replace")}}


def _cell(item: dict[str, Any], key: str) -> str:
    metrics = item.get("metrics") or {}
    if key in ("num_running", "num_waiting"):
        return str(metrics.get(key, ""))
    if key == "kv":
        return f"{100 * float(metrics.get('kv_cache_usage', 0.0)):.0f}"
    return str(item.get(key, ""))


def format_table(items: list[dict[str, Any]]) -> str:
    """Instances as an aligned text table."""
    rows = [[title for title, _ in _COLUMNS]] + [[_cell(i, key) for _, key in _COLUMNS] for i in items]
    widths = [max(len(r[c]) for r in rows) for c in range(len(_COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body)


def run(args: argparse.Namespace) -> int:
    """``status``: print the instance table. ``drain``: drain (or undrain) one instance."""
    base = args.url.rstrip("/")
    try:
        token = load_admin_token(args.admin_token_file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if args._name == "status":
            status, body = _call("GET", f"{base}/admin/v1/instances", token)
            if status != 200:
                print(f"error: HTTP {status}: {_message(body)}", file=sys.stderr)
                return 1
            items = body.get("instances", []) if isinstance(body, dict) else []
            print(format_table(items) if items else "no instances registered")
            return 0
        action = "undrain" if args.undo else "drain"
        status, body = _call("POST", f"{base}/admin/v1/instances/{args.agent_id}/{action}", token)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"error: cannot reach the orchestrator at {base}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"error: HTTP {status}: {_message(body)}", file=sys.stderr)
        return 1
    ack = body.get("ack", {})
    if not ack.get("ok", False):
        print(f"{action} {args.agent_id}: agent refused: {ack.get('error', '')}", file=sys.stderr)
        return 1
    state = (body.get("instance") or {}).get("state", "?")
    print(f"{action} {args.agent_id}: acknowledged (state: {state})")
    return 0
