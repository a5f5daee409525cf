"""Every error vllm-disagg raises on purpose, and the one map from error to HTTP status.

Hierarchy::

    DisaggError
    ├── ConfigError                 invalid configuration, found before anything starts
    ├── ProtocolError               messages between processes (orchestrator, agents, connectors)
    │   ├── CodecError              a frame that cannot become a message
    │   │   ├── FrameTooLarge       over the size limit, refused before decoding
    │   │   ├── MalformedFrame      not msgpack, or not the [tag, fields] envelope
    │   │   ├── UnknownMessageType  a tag no message class carries
    │   │   ├── FieldTypeError      a missing, unknown or wrongly typed field
    │   │   └── UnsupportedVersion  a link version this side cannot read (KV frames, the local link)
    │   ├── VersionMismatch         an agent speaking another PROTOCOL_VERSION
    │   └── KvEventsError           a vLLM KV-cache event frame that cannot be decoded or applied
    └── RequestError                one client request; carries an HTTP status
        ├── BadRequest          400 malformed JSON, missing prompt/messages, bad field
        ├── ModelNotFound       404 no instance serves the model
        ├── PayloadTooLarge     413 body over the gateway limit
        ├── HeadersTooLarge     431 request line and headers over the gateway limit
        ├── NoCapacity          503 no ready instance can take the request
        ├── UpstreamError       502 an engine failed or answered garbage (``cause`` says how)
        │   └── UpstreamTimeout 504 an engine did not answer in time
        └── EngineRejected      4xx an engine refused the request itself (its status, its reason)

Errors leave the gateway as OpenAI-style JSON: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations


class DisaggError(Exception):
    """Base of every error vllm-disagg raises on purpose."""


class ConfigError(DisaggError):
    """Configuration that cannot work; raised before anything starts."""


class ProtocolError(DisaggError):
    """A problem with a message between processes: orchestrator <-> agent, agent <-> agent, connector."""

    code = "protocol_error"


class CodecError(ProtocolError):
    """A frame that cannot be decoded into a message (or a message that cannot be encoded)."""

    code = "codec_error"


class FrameTooLarge(CodecError):
    """A frame over the configured size limit; refused before any decoding."""

    code = "frame_too_large"


class MalformedFrame(CodecError):
    """Bytes that are not msgpack, or not the ``[tag, fields]`` envelope."""

    code = "malformed_frame"


class UnknownMessageType(CodecError):
    """A type tag that no message class carries."""

    code = "unknown_message_type"


class FieldTypeError(CodecError):
    """A field that is missing, unknown, or of the wrong type."""

    code = "field_type_error"


class UnsupportedVersion(CodecError):
    """A frame of a later version of its link than this side reads (agent <-> agent KV frames, the
    connector's local link); the reason names both versions. The orchestrator's protocol has its own
    rule (``VersionMismatch``: the major must match, minors may differ)."""

    code = "unsupported_version"


class VersionMismatch(ProtocolError):
    """An agent speaking a protocol version the orchestrator does not."""

    code = "version_mismatch"


class KvEventsError(ProtocolError):
    """A vLLM KV-cache event frame that cannot be decoded, or an event the prefix index cannot use."""

    code = "kv_events_error"


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, object]:
    """The OpenAI-style error object every HTTP error of ours carries (vLLM's shape too)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class RequestError(DisaggError):
    """A client request that cannot be served; ``status`` is its HTTP status."""

    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_json(self) -> dict[str, object]:
        """The OpenAI-style error object."""
        return error_body(self.message, self.type, self.status, self.param)


class BadRequest(RequestError):
    """Malformed JSON, a missing ``prompt``/``messages``, or a field of the wrong type."""

    status = 400
    type = "BadRequestError"


class ModelNotFound(RequestError):
    """No registered instance serves the requested model."""

    status = 404
    type = "NotFoundError"


class PayloadTooLarge(RequestError):
    """A request body over the gateway's limit."""

    status = 413
    type = "PayloadTooLargeError"


class HeadersTooLarge(RequestError):
    """A request line and headers over the gateway's limit."""

    status = 431
    type = "RequestHeaderFieldsTooLargeError"


class NoCapacity(RequestError):
    """No ready instance can take the request now."""

    status = 503
    type = "ServiceUnavailableError"


# How an engine leg failed: the label of the retry, fallback and resume metrics.
UPSTREAM_CAUSES = ("connect", "timeout", "status", "invalid_response", "disconnect", "lost")


class UpstreamError(RequestError):
    """An engine failed, or answered something the gateway cannot use; the gateway may retry elsewhere.

    ``cause`` is one of ``UPSTREAM_CAUSES``: ``connect`` (refused, unreachable), ``timeout`` (connect or
    idle read), ``status`` (a 5xx, 408 or 429), ``invalid_response`` (not JSON, no ``kv_transfer_params``),
    ``disconnect`` (the connection broke), ``lost`` (the orchestrator declared the instance lost).
    """

    status = 502
    type = "BadGatewayError"

    def __init__(self, message: str, *, cause: str = "status", param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.cause = cause


class UpstreamTimeout(UpstreamError):
    """An engine did not answer within the configured time."""

    status = 504
    type = "GatewayTimeoutError"

    def __init__(self, message: str, *, cause: str = "timeout", param: str | None = None) -> None:
        super().__init__(message, cause=cause, param=param)


class EngineRejected(RequestError):
    """An engine answered 4xx: the request itself is at fault, so no other engine would take it."""

    type = "BadRequestError"

    def __init__(self, status: int, message: str, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body  # the engine's own error body, relayed to the client as it is


def http_status(error: BaseException) -> int:
    """The one map from an error to the HTTP status a client sees."""
    if isinstance(error, RequestError):
        return error.status
    return 500
