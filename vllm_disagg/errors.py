"""Every error vllm-disagg raises on purpose, and the one map from error to HTTP answer.

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
    └── RequestError                a request (a client's or an operator's) that cannot be served
        ├── BadRequest          400 malformed JSON, missing prompt/messages, bad field
        ├── Unauthorized        401 the admin API without its token
        ├── NotFound            404 no such instance, route, record or rollout action
        │   └── ModelNotFound   404 no instance serves the model
        ├── MethodNotAllowed    405 an admin route that takes other methods (``Allow`` names them)
        ├── RequestTimeout      408 a client sent its request's head or body too slowly
        ├── Conflict            409 what the cluster is doing forbids it now
        ├── PayloadTooLarge     413 body over the gateway limit
        ├── Unprocessable       422 understood and tried, and it failed (connect's reason)
        ├── HeadersTooLarge     431 request line and headers over the gateway limit
        ├── Overloaded          429 admission refused the request (``X-Disagg-Shed-Reason``, ``Retry-After``)
        ├── NoCapacity          503 no ready instance can take the request
        ├── TooManyConnections  503 the gateway process holds its most client connections
        ├── TimedOut            504 an operation did not finish in time (an engine's restart)
        ├── UpstreamError       502 an engine failed or answered garbage (``cause`` says how)
        │   └── UpstreamTimeout 504 an engine did not answer in time
        ├── OrchestratorUnreachable 502 a gateway worker could not reach its orchestrator
        ├── NotLeader           503 a replica that does not lead was asked for a leader's action, and
        │                       no leader is known to forward it to (etcd unreachable, an election)
        ├── CommandError        502 an agent command was not delivered or not acknowledged
        │   ├── AgentUnknown        404 no instance with this agent id was ever registered
        │   ├── AgentUnreachable    502 no live session, or its socket is not connected
        │   ├── CommandTimeout      504 the agent did not acknowledge in time
        │   └── AgentTooOld         409 the agent's protocol minor does not know the command
        ├── RolloutError            a rollout that cannot be done
        │   ├── RolloutInvalid      400 the request does not say what to roll
        │   ├── RolloutNotFound     404 nothing to roll, or no such rollout
        │   └── RolloutConflict     409 a rollout under way, or nothing would change
        └── EngineRejected      4xx an engine refused the request itself (its status, its reason)

A ``RequestError``'s class is its HTTP answer: ``status``, the error's ``type`` and any ``headers``;
nothing else decides them. Handlers raise; ``http_errors`` turns what they raise into the OpenAI-style
JSON every error of ours carries: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType


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


class RequestError(DisaggError):
    """A request that cannot be served; the class gives its HTTP ``status``, ``type`` and ``headers``."""

    status = 500
    type = "InternalServerError"
    headers: Mapping[str, str] = MappingProxyType({})

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_json(self) -> dict[str, object]:
        """The OpenAI-style error object every HTTP error of ours carries (vLLM's shape too)."""
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


class BadRequest(RequestError):
    """Malformed JSON, a missing ``prompt``/``messages``, or a field of the wrong type."""

    status = 400
    type = "BadRequestError"


class Unauthorized(RequestError):
    """The admin API asked without its bearer token, or with another."""

    status = 401
    type = "AuthenticationError"
    headers = MappingProxyType({"WWW-Authenticate": 'Bearer realm="vllm-disagg admin"'})


class NotFound(RequestError):
    """No such instance, admin route, request record, or rollout action."""

    status = 404
    type = "NotFoundError"


class ModelNotFound(NotFound):
    """No registered instance serves the requested model."""


class MethodNotAllowed(RequestError):
    """An admin route that exists for other methods; ``Allow`` names them."""

    status = 405
    type = "MethodNotAllowed"

    def __init__(self, message: str, allowed: list[str]) -> None:
        super().__init__(message)
        self.headers = MappingProxyType({"Allow": ", ".join(allowed)})


class RequestTimeout(RequestError):
    """A client sent its request's line and headers, or its body, too slowly (the gateway's deadlines)."""

    status = 408
    type = "RequestTimeoutError"


class Conflict(RequestError):
    """What the cluster is doing forbids it now: the instance is live, a change is under way."""

    status = 409
    type = "ConflictError"


class Unprocessable(RequestError):
    """Understood and tried, and it failed: ``vllm-disagg connect`` could not attach the engine."""

    status = 422
    type = "UnprocessableEntityError"


class PayloadTooLarge(RequestError):
    """A request body over the gateway's limit."""

    status = 413
    type = "PayloadTooLargeError"


class HeadersTooLarge(RequestError):
    """A request line and headers over the gateway's limit."""

    status = 431
    type = "RequestHeaderFieldsTooLargeError"


SHED_REASON_HEADER = "X-Disagg-Shed-Reason"


class Overloaded(RequestError):
    """Admission refused the request (docs/admission.md): ``reason`` says why, in the
    ``X-Disagg-Shed-Reason`` header too, and ``Retry-After`` when to come back."""

    status = 429
    type = "RateLimitError"

    def __init__(self, message: str, *, reason: str, retry_after_s: int, stage: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.stage = stage
        self.headers = MappingProxyType({"Retry-After": str(retry_after_s), SHED_REASON_HEADER: reason})


class NoCapacity(RequestError):
    """No ready instance can take the request now (the cluster is down for its model)."""

    status = 503
    type = "ServiceUnavailableError"
    headers: Mapping[str, str] = MappingProxyType({"Retry-After": "1", SHED_REASON_HEADER: "no_capacity"})


class TooManyConnections(RequestError):
    """A connection past the gateway process's cap: answered at once and closed."""

    status = 503
    type = "ServiceUnavailableError"
    headers: Mapping[str, str] = MappingProxyType({"Retry-After": "1"})


class TimedOut(RequestError):
    """An operation the admin API started did not finish in time (an engine restarting in a new role)."""

    status = 504
    type = "TimeoutError"


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


class OrchestratorUnreachable(RequestError):
    """A gateway worker could not reach its orchestrator to relay an admin or dashboard request."""

    status = 502
    type = "UpstreamError"


class NotLeader(RequestError):
    """A replica was asked for what only the leader does (an agent command, an admin write) and cannot
    hand it to one: it does not lead, and no leader is known now (an election, or etcd unreachable)."""

    status = 503
    type = "ServiceUnavailableError"


class CommandError(RequestError):
    """An agent command could not be delivered or was not acknowledged."""

    status = 502
    type = "CommandError"


class AgentUnknown(CommandError):
    """No instance with this agent id was ever registered."""

    status = 404
    type = "AgentUnknown"


class AgentUnreachable(CommandError):
    """The agent has no live session or its socket is not connected."""

    status = 502
    type = "AgentUnreachable"


class CommandTimeout(CommandError):
    """The agent did not acknowledge in time."""

    status = 504
    type = "CommandTimeout"


class AgentTooOld(CommandError):
    """The agent's protocol minor does not know this command kind (it would refuse the frame)."""

    status = 409
    type = "AgentTooOld"


class RolloutError(RequestError):
    """A rollout request that cannot be done; its type is ``RolloutError`` whatever its status."""

    type = "RolloutError"


class RolloutInvalid(RolloutError):
    """The request does not say what to roll (several models are served and it names none)."""

    status = 400


class RolloutNotFound(RolloutError):
    """No live instance serves the model, or it has no rollout to act on."""

    status = 404


class RolloutConflict(RolloutError):
    """A rollout of the model is under way, or in a phase the action does not apply to, or the model
    is served by the target revision (or several) already."""

    status = 409


class EngineRejected(RequestError):
    """An engine answered 4xx: the request itself is at fault, so no other engine would take it."""

    type = "BadRequestError"

    def __init__(self, status: int, message: str, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body  # the engine's own error body, relayed to the client as it is
