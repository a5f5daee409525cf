"""``vllm-disagg status``, ``drain`` and ``requests``: the admin API from a terminal.

Blocking ``urllib`` on purpose: these commands run no event loop of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.admin.auth import ENV_ADMIN_TOKEN, admin_headers, load_admin_token
from vllm_disagg.protocol.messages import ROLES

DEFAULT_URL = "http://127.0.0.1:8000"
_TIMEOUT_S = 15.0
_ROLE_TIMEOUT_S = 1800.0  # above the orchestrator's default drain (30 s) and restart (600 s) timeouts
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
    if name in ("status", "requests"):
        parser.add_argument("--json", action="store_true", help="the admin API's JSON instead of a table")
    if name == "remove":
        parser.add_argument("agent_id", metavar="ID", help="the dead instance to forget")
    if name == "role":
        parser.add_argument("agent_id", metavar="ID", help="the instance's agent id")
        parser.add_argument(
            "role",
            choices=(*ROLES, "auto"),
            help="what it serves from now on (pinned: the planner leaves it); auto: lift the pin",
        )
    if name == "rollout":
        what = parser.add_mutually_exclusive_group(required=True)
        what.add_argument("--to", metavar="REVISION", help="start rolling the model to this revision")
        for action in ("pause", "resume", "rollback"):
            what.add_argument(f"--{action}", dest="action", action="store_const", const=action)
        what.add_argument("--status", dest="action", action="store_const", const="status")
        parser.add_argument("--model", default=None, help="the model (default: the only one served)")
    if name == "add":
        parser.add_argument(
            "engine_url", metavar="ENGINE_URL", help="the running engine, e.g. http://10.0.0.5:8000"
        )
        parser.add_argument("--role", choices=ROLES, help="prefill, decode or both (default: its kv_role)")
        parser.add_argument("--agent-id", default="", help="the instance's id (default: ROLE-HOST-PORT)")
        parser.add_argument(
            "--model", default="", help="served name to register (default: the engine's first)"
        )
    if name == "events":
        parser.add_argument("--follow", "-f", action="store_true", help="keep printing events as they happen")
        parser.add_argument("--since", type=int, default=0, help="only events after this sequence number")
        parser.add_argument("--json", action="store_true", help="one JSON object per line")
    if name == "requests":
        parser.add_argument("request_id", nargs="?", metavar="ID", help="one request's whole record")
        parser.add_argument("--limit", type=int, default=20, help="how many recent requests (newest first)")


def _call(
    method: str, url: str, token: str, body: Any = None, timeout_s: float = _TIMEOUT_S
) -> tuple[int, Any]:
    headers = admin_headers(token) if token else {}
    data = jsonutil.dumps(body) if body is not None else b"" if method == "POST" else None
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
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
    return _table([title for title, _ in _COLUMNS], [[_cell(i, key) for _, key in _COLUMNS] for i in items])


def format_requests(records: list[dict[str, Any]]) -> str:
    """Request records as an aligned text table."""
    rows = [
        [
            str(r.get("request_id", "")),
            str(r.get("status", "")),
            str(r.get("mode", "")),
            str(r.get("prefill") or "-"),
            str(r.get("decode") or "-"),
            f"{float(r.get('total_s') or 0.0):.3f}",
            str(len(r.get("attempts") or [])),
            str(r.get("error") or r.get("kv_check") or r.get("relay") or ""),
        ]
        for r in records
    ]
    return _table(["REQUEST", "STATUS", "MODE", "PREFILL", "DECODE", "TOTAL-S", "LEGS", "NOTE"], rows)


def _table(header: list[str], rows: list[list[str]]) -> str:
    rows = [header, *rows]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def format_event(event: dict[str, Any]) -> str:
    """One event as a line: when, what, where, and its details."""
    at = time.strftime("%H:%M:%S", time.localtime(float(event.get("at", 0.0))))
    rest = {k: v for k, v in event.items() if k not in ("seq", "at", "kind", "instance")}
    if "from" in rest and "to" in rest:
        rest["change"] = f"{rest.pop('from')} -> {rest.pop('to')}"
    details = " ".join(f"{k}={v}" for k, v in rest.items() if v not in ("", None, [], {}))
    head = f"{event.get('seq', '')}  {at}  {event.get('kind', '')}  {event.get('instance', '')}"
    return f"{head}  {details}".rstrip()


def _events(base: str, token: str, args: argparse.Namespace) -> int:
    """Print the event log, then (``--follow``) each event as it happens, until interrupted."""
    follow = "true" if args.follow else "false"
    url = f"{base}/admin/v1/events?since={max(0, args.since)}&follow={follow}"
    req = urllib.request.Request(url, headers=admin_headers(token) if token else {})
    try:
        resp = urllib.request.urlopen(req, timeout=None if args.follow else _TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        body = exc.read()
        with contextlib.suppress(ValueError):
            body = jsonutil.loads(body)
        print(f"error: HTTP {exc.code}: {_message(body)}", file=sys.stderr)
        return 1
    with resp:
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                event = jsonutil.loads(line[len("data: ") :])
                print(jsonutil.dumps(event).decode() if args.json else format_event(event), flush=True)
    return 0


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body)


class _Failed(Exception):
    """A command's one-line error: ``run`` prints it and exits 1."""


def _expect(status: int, body: Any, *ok: int) -> Any:
    """``body`` when ``status`` is one of ``ok`` (200 by default); else ``_Failed`` with the API's reason."""
    if status not in (ok or (200,)):
        raise _Failed(f"HTTP {status}: {_message(body)}")
    return body


def _status(base: str, token: str, args: argparse.Namespace) -> int:
    """``status``: the instance table, the replicas when the orchestrator is one of many, and the
    admission queue when it admits (``--json``: the API's documents)."""
    body = _expect(*_call("GET", f"{base}/admin/v1/instances", token))
    items = body.get("instances", []) if isinstance(body, dict) else []
    code, replicas = _call("GET", f"{base}/admin/v1/replicas", token)
    replicated = code == 200 and isinstance(replicas, dict)  # 404: a single orchestrator
    code, admission = _call("GET", f"{base}/admin/v1/admission", token)
    admits = code == 200 and isinstance(admission, dict)  # 404: an orchestrator from before admission
    if args.json:
        seen = {**body, "replicas": replicas} if replicated else dict(body)
        print(jsonutil.dumps({**seen, "admission": admission} if admits else seen).decode())
        return 0
    print(format_table(items) if items else "no instances registered")
    if replicated:
        print()
        print(format_replicas(replicas))
    if admits and admission.get("enabled"):  # --admission off: nothing to show
        print()
        print(format_admission(admission))
    return 0


def format_admission(seen: dict[str, Any]) -> str:
    """The admission queue per model: how many wait (by priority), the oldest wait, the saturated
    stage, and the outcomes so far, shed ones by reason."""
    models = seen.get("models") or {}
    weights = seen.get("tenants", {}).get("weights") or {}
    shares = ", ".join(f"{t}={w:g}" for t, w in weights.items()) or "all equal"
    head = f"admission: {sum(m.get('depth', 0) for m in models.values())} waiting; tenants' weights: {shares}"
    if not models:
        return head + " (no request yet)"
    rows = []
    for name, m in models.items():
        counts = m.get("counts") or {}
        shed = {r: n for r, n in (counts.get("shed") or {}).items() if n}
        rows.append(
            [
                name,
                str(m.get("depth", 0)),
                " ".join(f"{p}:{n}" for p, n in (m.get("by_priority") or {}).items()) or "-",
                f"{float(m.get('oldest_wait_s') or 0.0):.3f}",
                m.get("saturated") or "-",
                str(counts.get("admitted", 0)),
                str(counts.get("queued", 0)),
                " ".join(f"{r}={n}" for r, n in shed.items()) or "0",
            ]
        )
    header = ["MODEL", "WAITING", "BY-PRIORITY", "OLDEST-S", "SATURATED", "ADMITTED", "QUEUED", "SHED"]
    return head + "\n" + _table(header, rows)


def format_replicas(seen: dict[str, Any]) -> str:
    """The replicas as one of them sees them: which leads, since when, in which epoch, and each one."""
    since = seen.get("leader_since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(since))) if since else "unknown"
    etcd = seen.get("etcd") or {}
    head = (
        f"cluster {seen.get('cluster')}: leader {seen.get('leader') or 'none'} since {when} "
        f"(epoch {seen.get('epoch')}); etcd {'ok' if etcd.get('ok') else 'UNREACHABLE'}; "
        f"leader actions: {seen.get('leader_actions')}"
    )
    rows = [
        [
            str(r.get("id", "")) + (" (this one)" if r.get("id") == seen.get("self") else ""),
            "leader" if r.get("leader") else "follower",
            str(r.get("http", "")),
            "yes" if r.get("linked") else "no",
            "" if r.get("in_flight") is None else str(r.get("in_flight")),
        ]
        for r in seen.get("replicas") or []
    ]
    return head + "\n" + _table(["REPLICA", "ROLE", "HTTP", "LINKED", "IN-FLIGHT"], rows)


def _remove(base: str, token: str, args: argparse.Namespace) -> int:
    """``remove``: forget a dead instance."""
    _expect(*_call("DELETE", f"{base}/admin/v1/instances/{args.agent_id}", token))
    print(f"removed {args.agent_id}")
    return 0


def _add(base: str, token: str, args: argparse.Namespace) -> int:
    """``add``: the orchestrator attaches the engine at ``args.engine_url`` (``POST /admin/v1/instances``)."""
    request = {
        "url": args.engine_url,
        "role": args.role,
        "agent_id": args.agent_id or None,
        "model": args.model,
    }
    status, body = _call("POST", f"{base}/admin/v1/instances", token, {k: v for k, v in request.items() if v})
    _expect(status, body, 201, 202)
    if status == 202:
        print(
            f"add {body['agent_id']}: its agent is still starting (pid {body['pid']}); see vllm-disagg status"
        )
        return 0
    instance = body.get("instance") or {}
    print(
        f"add {body['agent_id']}: registered as {instance.get('role', '?')} {instance.get('model', '?')} "
        f"(block size {instance.get('block_size', '?')}, connector {instance.get('kv_connector') or 'none'})"
    )
    return 0


def _role(base: str, token: str, args: argparse.Namespace) -> int:
    """``role``: change what an instance serves (its agent may refuse: 409 with its reason), pinning
    it there; ``auto`` hands it back to the planner."""
    url = f"{base}/admin/v1/instances/{args.agent_id}/role"
    # An engine that restarts for its new role answers once it is ready: minutes, for a large model.
    body = _expect(*_call("POST", url, token, {"role": args.role}, timeout_s=_ROLE_TIMEOUT_S))
    pin = "pinned" if body.get("pinned") else "the planner may move it"
    restart = ""
    if body.get("how") == "restart":
        restart = f", its engine restarted: ready after {body['timeline'].get('ready', '?')} s"
    print(f"role {args.agent_id}: {body['from']} -> {body['role']} ({pin}{restart})")
    return 0


def _requests(base: str, token: str, args: argparse.Namespace) -> int:
    """``requests``: recent requests as a table, or one request's whole record."""
    path = f"requests/{args.request_id}" if args.request_id else f"requests?limit={max(0, args.limit)}"
    body = _expect(*_call("GET", f"{base}/admin/v1/{path}", token))
    if args.json or args.request_id:
        print(jsonutil.dumps(body).decode())
    else:
        records = body.get("requests", []) if isinstance(body, dict) else []
        print(format_requests(records) if records else "no requests recorded")
    return 0


def _debug(base: str, token: str, args: argparse.Namespace) -> int:
    """``debug``: what the scheduler and the planner work from now, as JSON (docs/observability.md)."""
    body = _expect(*_call("GET", f"{base}/admin/v1/debug/state", token))
    print(jsonutil.dumps(body).decode())
    return 0


def _drain(base: str, token: str, args: argparse.Namespace) -> int:
    """``drain`` (``--undo``: undrain) one instance; its agent acknowledges."""
    action = "undrain" if args.undo else "drain"
    body = _expect(*_call("POST", f"{base}/admin/v1/instances/{args.agent_id}/{action}", token))
    ack = body.get("ack", {})
    if not ack.get("ok", False):
        print(f"{action} {args.agent_id}: agent refused: {ack.get('error', '')}", file=sys.stderr)
        return 1
    state = (body.get("instance") or {}).get("state", "?")
    print(f"{action} {args.agent_id}: acknowledged (state: {state})")
    return 0


def _rollout(base: str, token: str, args: argparse.Namespace) -> int:
    """``rollout``: start one (``--to``), pause, resume or roll back one, or show them all."""
    if args.to is not None:
        body = {"to": args.to, **({"model": args.model} if args.model else {})}
        rollout = _expect(*_call("POST", f"{base}/admin/v1/rollouts", token, body), 201)
    elif args.action == "status":
        listed = _expect(*_call("GET", f"{base}/admin/v1/rollouts", token))
        for rollout in listed.get("rollouts", []):
            print(_describe_rollout(rollout))
        return 0
    else:
        model = args.model
        if model is None:
            listed = _expect(*_call("GET", f"{base}/admin/v1/rollouts", token)).get("rollouts", [])
            if len(listed) != 1:
                raise _Failed(f"name the model (--model): rollouts of {[r['model'] for r in listed]}")
            model = listed[0]["model"]
        path = f"{base}/admin/v1/rollouts/{urllib.parse.quote(model, safe='')}/{args.action}"
        rollout = _expect(*_call("POST", path, token))
    print(_describe_rollout(rollout))
    return 0


def _describe_rollout(rollout: dict[str, Any]) -> str:
    new = ", ".join(f"{i['agent_id']} ({i['state']})" for i in rollout.get("new", [])) or "none yet"
    return (
        f"rollout {rollout['model']}: {rollout['from']!r} -> {rollout['to']!r} {rollout['phase']}; "
        f"drained {', '.join(rollout.get('drained', [])) or 'none'}; new: {new}"
    )


_COMMANDS: dict[str, Callable[[str, str, argparse.Namespace], int]] = {
    "status": _status,
    "events": _events,
    "remove": _remove,
    "add": _add,
    "role": _role,
    "requests": _requests,
    "debug": _debug,
    "drain": _drain,
    "rollout": _rollout,
}


def run(args: argparse.Namespace) -> int:
    """Run one admin subcommand (``args._name``) against the orchestrator at ``args.url``."""
    base = args.url.rstrip("/")
    try:
        token = load_admin_token(args.admin_token_file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        return _COMMANDS[args._name](base, token, args)
    except _Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"error: cannot reach the orchestrator at {base}: {exc}", file=sys.stderr)
        return 1
