"""W3C Trace Context (https://www.w3.org/TR/trace-context/): the trace id of a ``traceparent`` header.

A client that traces its calls sends ``traceparent: 00-<trace id>-<parent span id>-<flags>``; the
request's log lines then carry that trace id, so the client's trace and the gateway's lines join. A
header that does not follow the specification (a wrong length, upper-case or non-hex digits, an
all-zero id, version ``ff``) is no error: the request gets a new trace id, as the specification says
a receiver must do.
"""

from __future__ import annotations

import os
import re

# version 00 is exactly these 55 characters; a later version may append "-..." after them.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def parse_trace_id(traceparent: str | None) -> str | None:
    """The trace id of a valid ``traceparent`` header value; None when absent or invalid."""
    if not traceparent:
        return None
    found = _TRACEPARENT.fullmatch(traceparent.strip(" \t"))
    if found is None:
        return None
    version, trace_id, span_id, _, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return trace_id


def new_trace_id() -> str:
    """A random trace id (32 lower-case hex digits, never all zero)."""
    while True:
        trace_id = os.urandom(16).hex()
        if trace_id != _ZERO_TRACE:
            return trace_id


def trace_id_of(traceparent: str | None) -> str:
    """The request's trace id: the client's where its header is valid, else a new one."""
    return parse_trace_id(traceparent) or new_trace_id()
