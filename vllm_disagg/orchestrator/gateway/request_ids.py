"""A request's ids: the gateway's own, for engines and records, and the client's, only echoed back.

The gateway gives every request an id of its own (``new_request_id``: 128 random bits, so no client
can guess or repeat it). That id is the engine legs' ``X-Request-Id`` (vLLM's request id, the
response's ``cmpl-<id>``), the key of its record (``records.py``) and of its KV audit, and the
``X-Disagg-Request-Id`` response header. A client's ``X-Request-Id`` is only a label: echoed in the
response's ``X-Request-Id`` and kept in the record, where ``/admin/v1/requests/<id>`` finds the newest
request that carried it. Two clients sending the same id get two requests, two records and two engine
ids; neither can overwrite the other's record nor name an engine request.

A client id is at most ``MAX_CLIENT_ID`` characters of printable ASCII (space to ``~``); any other is
refused with a 400 that says why, rather than cut: a cut id would be a different id the client never
sent, and two long ids could become one.
"""

from __future__ import annotations

import uuid

from vllm_disagg.errors import BadRequest

MAX_CLIENT_ID = 128  # a UUID is 36, a W3C trace id 32: room for any proxy's ids, never for a prompt
HEADER = "X-Request-Id"  # the client's id, echoed; the gateway's own when the client sent none
OWN_HEADER = "X-Disagg-Request-Id"  # the gateway's id of the request: its engine id and record key


def new_request_id() -> str:
    """A fresh id of the gateway's own: 32 hex digits from the OS's random source."""
    return uuid.uuid4().hex


def client_request_id(value: str | None) -> str:
    """The client's ``X-Request-Id``, checked ("" when it sent none); ``BadRequest`` when it is longer
    than ``MAX_CLIENT_ID`` or has a character outside printable ASCII."""
    if not value:
        return ""
    if len(value) > MAX_CLIENT_ID:
        raise BadRequest(f"the {HEADER} header is {len(value)} characters long; at most {MAX_CLIENT_ID}")
    if not (value.isascii() and value.isprintable()):
        raise BadRequest(f"the {HEADER} header may hold printable ASCII only (space to '~')")
    return value
