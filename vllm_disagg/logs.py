"""Logging for every process of the project: text lines or JSON lines, with the request's ids.

``--log-format json`` makes each record one JSON object on one line (time, level, logger, process
name, message, and an exception's traceback), for a log pipeline to index. A line logged while a
request is being served (``bind``, by the gateway, for the request's whole task and the tasks it
starts) also carries the request's id and its W3C trace id, so that every line about a request can be
found from either. The trace id is the one of the client's ``traceparent`` header where it is valid,
else a new one (``trace_context``); it is worked out only when a line is written, so that serving a
request costs one context variable set and reset, whatever the format.

What is logged is the callers' choice and never a prompt, a completion or a credential:
tests/integration/orchestrator/gateway/test_json_logs.py serves requests with a known prompt and keys
at DEBUG and looks for them in every line.
"""

from __future__ import annotations

import logging
import sys
import time
from argparse import ArgumentParser
from contextvars import ContextVar, Token
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.trace_context import trace_id_of

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_configured = ("INFO", "text")  # what ``configure`` last set: children are started with the same


class RequestIds:
    """The ids of the request being served: its request id, and its trace id worked out on first use
    (the client's, from ``traceparent``, or a new one, then the same for every line)."""

    __slots__ = ("_trace_id", "_traceparent", "request_id")

    def __init__(self, request_id: str, traceparent: str | None) -> None:
        self.request_id = request_id
        self._traceparent = traceparent
        self._trace_id: str | None = None

    @property
    def trace_id(self) -> str:
        if self._trace_id is None:
            self._trace_id = trace_id_of(self._traceparent)
        return self._trace_id


_CURRENT: ContextVar[RequestIds | None] = ContextVar("vllm_disagg_request", default=None)


def bind(request_id: str, traceparent: str | None) -> Token[RequestIds | None]:
    """From now on, in this task and the tasks it starts, log lines are about this request."""
    return _CURRENT.set(RequestIds(request_id, traceparent))


def unbind(token: Token[RequestIds | None]) -> None:
    """The request is over: lines are about no request again (``bind``'s token)."""
    _CURRENT.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, process: str = "") -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self._process:
            line["process"] = self._process
        ids = _CURRENT.get()
        if ids is not None:
            line["request_id"] = ids.request_id
            line["trace_id"] = ids.trace_id
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = record.stack_info
        # Non-ASCII stays as it is and a newline in a message stays escaped: one record, one line.
        return jsonutil.dumps(line).decode()


def _iso(created: float) -> str:
    """RFC 3339 in UTC with milliseconds: what log pipelines parse without being told a format."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def add_arguments(parser: ArgumentParser, level: str = "INFO") -> None:
    """``--log-level`` and ``--log-format``, as every command of the project takes them."""
    parser.add_argument("--log-level", default=level, type=str.upper, choices=LEVELS, help="logging level")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=FORMATS,
        help="text lines, or JSON lines with the request and trace ids on lines about a request",
    )


def configure(level: str = "INFO", fmt: str = "text", process: str = "") -> None:
    """Send the root logger's records to stderr in ``fmt``; ``process`` names the process on each line
    (``agent decode-0``, ``worker-1``). Replaces handlers an earlier call installed."""
    global _configured
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    _configured = (level.upper(), fmt)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        who = f"{process} " if process else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {who}%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def child_argv() -> list[str]:
    """The flags that give a child process (a gateway worker) this process's level and format."""
    level, fmt = _configured
    return ["--log-level", level, "--log-format", fmt]
