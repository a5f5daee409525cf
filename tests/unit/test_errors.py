"""One map from error to HTTP answer: an error's class gives its status, type and headers, and
``http_errors`` answers whatever a handler raises with them."""

from __future__ import annotations

import inspect

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from vllm_disagg import errors, jsonutil
from vllm_disagg.errors import (
    AgentTooOld,
    AgentUnknown,
    AgentUnreachable,
    BadRequest,
    CommandError,
    CommandTimeout,
    Conflict,
    EngineRejected,
    HeadersTooLarge,
    MethodNotAllowed,
    ModelNotFound,
    NoCapacity,
    NotFound,
    NotLeader,
    OrchestratorUnreachable,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    RequestTimeout,
    RolloutConflict,
    RolloutInvalid,
    RolloutNotFound,
    TimedOut,
    TooManyConnections,
    Unauthorized,
    Unprocessable,
    UpstreamError,
    UpstreamTimeout,
)
from vllm_disagg.http_errors import answering, error_response

# (error, status, type): what a client sees of each. The admin API's types are the ones it always
# answered with (a command error's is its class name; every rollout error's is "RolloutError").
ANSWERS = [
    pytest.param(BadRequest("x"), 400, "BadRequestError", id="a bad request is a 400"),
    pytest.param(Unauthorized("x"), 401, "AuthenticationError", id="no admin token is a 401"),
    pytest.param(NotFound("x"), 404, "NotFoundError", id="no such thing is a 404"),
    pytest.param(ModelNotFound("x"), 404, "NotFoundError", id="an unknown model is a 404 too"),
    pytest.param(MethodNotAllowed("x", ["POST"]), 405, "MethodNotAllowed", id="another method is a 405"),
    pytest.param(RequestTimeout("x"), 408, "RequestTimeoutError", id="a head or body too slow is a 408"),
    pytest.param(Conflict("x"), 409, "ConflictError", id="a state that forbids it is a 409"),
    pytest.param(PayloadTooLarge("x"), 413, "PayloadTooLargeError", id="a body over the limit is a 413"),
    pytest.param(Unprocessable("x"), 422, "UnprocessableEntityError", id="a failed attach is a 422"),
    pytest.param(HeadersTooLarge("x"), 431, "RequestHeaderFieldsTooLargeError", id="big headers: 431"),
    pytest.param(NoCapacity("x"), 503, "ServiceUnavailableError", id="no ready instance is a 503"),
    pytest.param(
        TooManyConnections("x"), 503, "ServiceUnavailableError", id="a connection past the cap: 503"
    ),
    pytest.param(
        Overloaded("x", reason="queue_full", retry_after_s=3), 429, "RateLimitError", id="refused: a 429"
    ),
    pytest.param(TimedOut("x"), 504, "TimeoutError", id="a restart not ready in time is a 504"),
    pytest.param(UpstreamError("x"), 502, "BadGatewayError", id="a failed engine is a 502"),
    pytest.param(UpstreamTimeout("x"), 504, "GatewayTimeoutError", id="a silent engine is a 504"),
    pytest.param(OrchestratorUnreachable("x"), 502, "UpstreamError", id="a worker without its orchestrator"),
    pytest.param(NotLeader("x"), 503, "ServiceUnavailableError", id="a replica that cannot reach a leader"),
    pytest.param(CommandError("x"), 502, "CommandError", id="an undelivered command is a 502"),
    pytest.param(AgentUnknown("x"), 404, "AgentUnknown", id="a command to an unknown agent is a 404"),
    pytest.param(AgentUnreachable("x"), 502, "AgentUnreachable", id="an unconnected agent is a 502"),
    pytest.param(CommandTimeout("x"), 504, "CommandTimeout", id="an unacknowledged command is a 504"),
    pytest.param(AgentTooOld("x"), 409, "AgentTooOld", id="an agent too old for the command is a 409"),
    pytest.param(RolloutInvalid("x"), 400, "RolloutError", id="a rollout naming no model is a 400"),
    pytest.param(RolloutNotFound("x"), 404, "RolloutError", id="nothing to roll is a 404"),
    pytest.param(RolloutConflict("x"), 409, "RolloutError", id="a rollout under way is a 409"),
    pytest.param(EngineRejected(422, "x"), 422, "BadRequestError", id="an engine's refusal keeps its status"),
]


@pytest.mark.parametrize(("error", "status", "type_"), ANSWERS)
def test_an_errors_class_gives_its_status_and_type(error: RequestError, status: int, type_: str) -> None:
    response = error_response(error, {})
    assert response.status == status
    assert response.body is not None and jsonutil.loads(bytes(response.body)) == {  # type: ignore[arg-type]
        "error": {"message": "x", "type": type_, "param": None, "code": status}
    }


def test_every_request_error_is_in_the_table() -> None:
    classes = {c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, RequestError)}
    tabled = {type(p.values[0]) for p in ANSWERS}
    assert classes - tabled == {RequestError, errors.RolloutError}, "the bases are never raised"


@pytest.mark.parametrize(
    ("error", "header", "value"),
    [
        pytest.param(Unauthorized("x"), "WWW-Authenticate", 'Bearer realm="vllm-disagg admin"', id="401"),
        pytest.param(MethodNotAllowed("x", ["GET", "POST"]), "Allow", "GET, POST", id="405 names methods"),
        pytest.param(Overloaded("x", reason="sheddable", retry_after_s=7), "Retry-After", "7", id="429 when"),
        pytest.param(
            Overloaded("x", reason="sheddable", retry_after_s=7),
            "X-Disagg-Shed-Reason",
            "sheddable",
            id="why",
        ),
        pytest.param(NoCapacity("x"), "X-Disagg-Shed-Reason", "no_capacity", id="503 says why"),
        pytest.param(NoCapacity("x"), "Retry-After", "1", id="503 says when"),
    ],
)
def test_an_error_that_needs_a_header_carries_it(error: RequestError, header: str, value: str) -> None:
    assert error_response(error, {"X-Request-Id": "r"}).headers[header] == value
    assert error_response(error, {"X-Request-Id": "r"}).headers["X-Request-Id"] == "r"


async def test_a_handler_raises_and_answering_answers() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        """Says why not."""
        raise Conflict("instance 'd0' is live")

    answered = answering(handler)
    response = await answered(make_mocked_request("POST", "/admin/v1/instances"))
    assert response.status == 409 and answered.__doc__ == "Says why not."
