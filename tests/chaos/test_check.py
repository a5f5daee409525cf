"""The chaos checker against a real simulated engine: the exact bytes it sends are judged completed, and
every way a response can go wrong (garbled text, a cut, a missing [DONE], an error event, a bad status)
is caught and classified."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from vllm_disagg import jsonutil
from vllm_disagg.chaos.check import Checker, RequestSpec, error_event, split_tokens
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.sim_engine.engine import SimServer, start_engine
from vllm_disagg.sim_engine.openai_api import DONE

MODEL = "sim-model"
ZERO = SimTiming()
STEPPED = SimTiming(decode_step_s=0.001, prefill_s_per_token=0.00001)
SYSTEM = "Context 1: cache block decode prefill token stream engine agent gateway router batch queue."

SPECS = {
    "completion-stream": RequestSpec("r-cs", "completion", True, 24, prompt=SYSTEM + " Question 1?"),
    "completion-stream-usage": RequestSpec(
        "r-csu", "completion", True, 17, prompt=SYSTEM + " Question 2?", include_usage=True
    ),
    "completion-whole": RequestSpec("r-cw", "completion", False, 33, prompt="Ünïcödé prompt ✓ and more"),
    "chat-stream": RequestSpec("r-hs", "chat", True, 20, messages=(("system", SYSTEM), ("user", "Q3?"))),
    "chat-stream-usage-three-turns": RequestSpec(
        "r-hsu",
        "chat",
        True,
        9,
        messages=(("system", SYSTEM), ("user", "hi"), ("assistant", "hello"), ("user", "Q4?")),
        include_usage=True,
    ),
    "chat-whole": RequestSpec("r-hw", "chat", False, 40, messages=(("user", "Q5, no system prompt"),)),
}


@pytest.fixture(params=[ZERO, STEPPED], ids=["zero-delay-engine", "stepped-engine"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[SimServer]:
    server = await start_engine(SimEngineConfig(port=0, model=MODEL, timing=request.param))
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def answer(http: aiohttp.ClientSession, server: SimServer, spec: RequestSpec) -> tuple[int, bytes]:
    """The engine's status and exact bytes for ``spec``, sent as the chaos load sends it."""
    headers = {"Content-Type": "application/json", "X-Request-Id": spec.request_id}
    async with http.post(server.url + spec.path, data=spec.body(MODEL), headers=headers) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("name", list(SPECS))
async def test_the_engines_exact_answer_is_completed(
    engine: SimServer, http: aiohttp.ClientSession, name: str
) -> None:
    spec = SPECS[name]
    status, body = await answer(http, engine, spec)
    assert status == 200, body
    assert Checker(MODEL).check(spec, status, body).outcome == "completed"


def _events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


def change_a_letter(body: bytes) -> bytes:
    """One output letter upper-cased: still valid JSON and SSE, but not what the engine said."""
    match = re.search(rb'"(?:text|content)":" ([a-z])', body)
    assert match, body[:200]
    i = match.start(1)
    return body[:i] + body[i : i + 1].upper() + body[i + 1 :]


def swap_two_tokens(body: bytes) -> bytes:
    events = _events(body)
    tokens = [i for i, e in enumerate(events) if b'"finish_reason":null' in e and b'"role"' not in e]
    a, b = tokens[0], tokens[1]
    events[a], events[b] = events[b], events[a]
    return b"".join(events)


def another_created_later(body: bytes) -> bytes:
    events = _events(body)
    created = jsonutil.loads(events[0][6:])["created"]
    events[2] = events[2].replace(f'"created":{created}'.encode(), f'"created":{created + 1}'.encode())
    return b"".join(events)


def another_id_later(body: bytes) -> bytes:
    """A later event with another request's id: the checker reads the id from the first event only
    (the gateway's own, ``gateway/request_ids.py``) and holds every event to it."""
    events = _events(body)
    events[2] = events[2].replace(b"r-hs", b"r-xx")
    return b"".join(events)


def error_then_done(body: bytes) -> bytes:
    events = _events(body)
    error = {"error": {"message": "engine went away", "type": "BadGatewayError", "param": None, "code": 502}}
    return b"".join(events[:3]) + b"data: " + jsonutil.dumps(error) + b"\n\n" + DONE


def drop_usage(body: bytes) -> bytes:
    return b"".join(e for e in _events(body) if b'"usage"' not in e)


# (spec, mutation of the engine's bytes, status, transport error, outcome, words of the reason)
Mutation = Callable[[bytes], bytes]
CASES: list[tuple[str, Mutation, int | None, str, str, str]] = [
    ("completion-stream", change_a_letter, 200, "", "garbled", "differs at byte"),
    ("chat-stream", change_a_letter, 200, "", "garbled", "differs at byte"),
    ("completion-whole", change_a_letter, 200, "", "garbled", "differs at byte"),
    ("chat-whole", change_a_letter, 200, "", "garbled", "differs at byte"),
    ("completion-stream", swap_two_tokens, 200, "", "garbled", "differs at byte"),
    ("chat-stream", another_id_later, 200, "", "garbled", "differs"),
    ("completion-stream", another_created_later, 200, "", "garbled", "differs"),
    ("completion-stream-usage", drop_usage, 200, "", "garbled", "differs"),
    ("completion-whole", lambda b: b[:-5], 200, "", "garbled", "not a completion object"),
    ("completion-stream", lambda b: b[: len(b) // 2], 200, "", "failed", "without data: [DONE]"),
    ("chat-stream", lambda b: b.removesuffix(DONE), 200, "", "failed", "without data: [DONE]"),
    ("chat-stream", error_then_done, 200, "", "failed", "engine went away"),
    ("completion-whole", lambda b: b'{"error":{"message":"no"}}', 503, "", "failed", "HTTP 503"),
    ("completion-stream", lambda b: b"", None, "ServerDisconnectedError", "failed", "ServerDisconnected"),
    ("chat-stream", lambda b: b[:100], 200, "ClientPayloadError: cut", "failed", "ClientPayloadError"),
]


@pytest.mark.parametrize(
    ("name", "mutate", "status", "error", "outcome", "reason"),
    CASES,
    ids=[
        "a-changed-letter-in-a-stream-is-garbled",
        "a-changed-letter-in-a-chat-stream-is-garbled",
        "a-changed-letter-in-a-body-is-garbled",
        "a-changed-letter-in-a-chat-body-is-garbled",
        "two-chunks-swapped-is-garbled",
        "a-later-chunk-with-another-requests-id-is-garbled",
        "a-later-chunk-with-another-created-is-garbled",
        "a-missing-usage-chunk-is-garbled",
        "a-clean-200-with-a-truncated-body-is-garbled",
        "a-stream-cut-in-the-middle-is-failed",
        "a-stream-without-done-is-failed",
        "an-error-event-then-done-is-failed",
        "a-non-200-status-is-failed",
        "no-response-at-all-is-failed",
        "a-transport-error-after-some-bytes-is-failed",
    ],
)
async def test_the_checker_catches_each_way_a_response_goes_wrong(
    http: aiohttp.ClientSession,
    name: str,
    mutate: Mutation,
    status: int | None,
    error: str,
    outcome: str,
    reason: str,
) -> None:
    server = await start_engine(SimEngineConfig(port=0, model=MODEL, timing=STEPPED))
    try:
        spec = SPECS[name]
        good_status, good = await answer(http, server, spec)
    finally:
        await server.close()
    assert good_status == 200
    bad = mutate(good)
    assert bad != good or error
    verdict = Checker(MODEL).check(spec, status, bad, error)
    assert (verdict.outcome, reason in verdict.reason) == (outcome, True), verdict


@pytest.mark.parametrize(
    ("text", "n", "tokens"),
    [
        (" alpha bravo charlie", 3, [" alpha", " bravo", " charlie"]),
        ("", 0, []),
        # Tokens without a leading space: the boundaries come from the prefixes instead.
        ("abcdef", 3, ["ab", "cd", "ef"]),
        (" a b", 1, [" a b"]),
    ],
    ids=[
        "words-split-on-spaces",
        "no-tokens",
        "tokens-without-spaces-use-prefixes",
        "one-token-with-a-space",
    ],
)
def test_split_tokens_finds_each_output_tokens_text(text: str, n: int, tokens: list[str]) -> None:
    assert split_tokens(text, n, lambda i: "".join(tokens[:i])) == tokens


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'data: {"id":"x","choices":[]}\n\ndata: [DONE]\n\n', None),
        (b'data: {"error":{"message":"boom","code":502}}\n\ndata: [DONE]\n\n', "boom"),
        (b'data: {"id":"x","choices":[{"text":" \\"error\\""}]}\n\n', None),
        (b'data: {"error":"plain"}\n\n', "plain"),
    ],
    ids=["no-error", "error-object", "the-word-error-in-text-is-not-an-event", "error-string"],
)
def test_error_event_finds_vllm_error_events(body: bytes, message: str | None) -> None:
    assert error_event(body) == message
