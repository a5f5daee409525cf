"""Bad clients: whatever body reaches ``/v1/completions`` or ``/v1/chat/completions`` of a real orchestrator
in front of real simulated engines, the answer is a 4xx with an OpenAI-style error that says why, or a
valid completion when the body is valid: never a 5xx, never a hang, and valid requests still succeed.

The service (orchestrator, a simulated prefill and decode engine, their agents) runs on its own event
loop in a thread; the test sends each fuzzed request over a fresh blocking HTTP connection with a
timeout, so a hang fails the example instead of the run.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.fuzz.support import FUZZ, LoopThread, http_get
from tests.helpers import eventually, metric_sum, parse_prometheus
from tests.integration.orchestrator_support import MODEL, FakeAgent, orch_config
from vllm_disagg.config import SimEngineConfig
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.orchestrator.state.metrics_check import checked
from vllm_disagg.protocol.messages import Heartbeat, MetricsSnapshot
from vllm_disagg.sim_engine.engine import SimServer, start_engine
from vllm_disagg.sim_engine.textgen import expected_chat_text, expected_text

MAX_BODY = 64 * 1024  # the gateway's limit here: small, so oversized bodies are cheap to make
MAX_MODEL_LEN = 512  # the engines' context: a long generation is refused rather than run
REQUEST_TIMEOUT_S = 30.0  # far above any answer on a loaded box: reaching it means a hang
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# --- the service under test ---


@dataclass
class Service:
    """A real orchestrator with one simulated prefill and one decode engine, registered by their agents."""

    loop: LoopThread
    server: OrchestratorServer
    engines: list[SimServer]
    agents: list[FakeAgent]

    def post(
        self, path: str, body: bytes, content_type: str | None = "application/json", chunked: bool = False
    ) -> tuple[int, str, bytes]:
        """POST over a fresh connection: status, content type, body."""
        host, port = self.server.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
        headers = {"Content-Type": content_type} if content_type is not None else {}
        try:
            if chunked:  # no Content-Length: the gateway learns the size only while reading
                chunks = [body[i : i + 8192] for i in range(0, len(body), 8192)]
                conn.request("POST", path, body=iter(chunks), headers=headers, encode_chunked=True)
            else:
                conn.request("POST", path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type") or "", resp.read()
        finally:
            conn.close()

    def report(self, metrics: MetricsSnapshot) -> None:
        """Both agents heartbeat these engine metrics (as a buggy or hostile agent might), and only these;
        back once the registry holds them (in range: ``state.metrics_check``)."""

        async def beat() -> None:
            for agent in self.agents:
                agent.stop_heartbeats()  # its own heartbeats would overwrite them
                agent.transport.send(Heartbeat(seq=1_000_000, engine_state="ready", metrics=metrics))

            kept = checked(metrics)[0]  # the registry keeps them brought into range

            def applied() -> bool:
                views = self.server.registry.snapshot().by_id
                return all(views[a.agent_id].metrics == kept for a in self.agents)

            await eventually(applied, what="the reported metrics in the registry")

        self.loop.run(beat())


async def _start(loop: LoopThread) -> Service:
    # Sessions and suspicion far above a starved tick: the main thread's hypothesis work shares the GIL.
    config = orch_config(max_body_bytes=MAX_BODY, heartbeat_timeout_s=60.0, suspect_after_s=30.0)
    server = await start_orchestrator(config, shutdown_timeout_s=2.0)
    engines = [
        await start_engine(SimEngineConfig(port=0, model=MODEL, max_model_len=MAX_MODEL_LEN))
        for _ in range(2)
    ]
    agents = [
        FakeAgent(server.zmq_endpoint, "p0", engines[0].url, "prefill"),
        FakeAgent(server.zmq_endpoint, "d0", engines[1].url, "decode"),
    ]
    for agent in agents:
        await agent.join()

    def ready() -> bool:
        snap = server.registry.snapshot()
        return len(snap.ready_prefill.get(MODEL, ())) == 1 and len(snap.ready_decode.get(MODEL, ())) == 1

    await eventually(ready, what="1P1D ready")
    return Service(loop, server, engines, agents)


@pytest.fixture
def service() -> Iterator[Service]:
    """The service on a loop in a thread; closed after the test."""
    loop = LoopThread()
    svc = loop.run(_start(loop))
    try:
        yield svc
    finally:

        async def stop() -> None:
            for agent in svc.agents:
                await agent.close()
            for engine in svc.engines:
                await engine.close()
            await svc.server.close()

        loop.run(stop())
        loop.close()


# --- the oracle ---


def check_error(status: int, content_type: str, data: bytes) -> dict[str, Any]:
    """A 4xx with ``{"error": {"message", "type", "param", "code"}}`` whose message says something."""
    assert 400 <= status < 500, (status, data[:300])
    assert content_type.startswith("application/json"), content_type
    error = json.loads(data)["error"]
    assert {"message", "type", "param", "code"} <= error.keys(), error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    return dict(error)


def completion_text(route: str, content_type: str, data: bytes) -> str:
    """The generated text of a 200, which must be a well-formed completion, streamed or whole."""
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", events[-3:]
        parts = []
        for event in events[:-1]:
            for choice in json.loads(event)["choices"]:
                delta = choice.get("delta") or {}
                parts.append(choice.get("text", "") if route == "completions" else delta.get("content") or "")
        return "".join(parts)
    body = json.loads(data)
    assert body["object"] == ("text_completion" if route == "completions" else "chat.completion"), body
    choice = body["choices"][0]
    text = choice["text"] if route == "completions" else choice["message"]["content"]
    assert isinstance(text, str) and isinstance(body["usage"]["completion_tokens"], int), body
    return text


def check_answer(route: str, answer: tuple[int, str, bytes]) -> int:
    """Never a 5xx: a 4xx error with a reason, or a valid completion. Returns the status."""
    status, content_type, data = answer
    assert status < 500, f"a bad request got {status}: {data[:500]!r}"
    if status == 200:
        completion_text(route, content_type, data)
    else:
        check_error(status, content_type, data)
    return status


def still_serving(svc: Service, *, no_5xx: bool = True) -> None:
    """A valid request of each route gets the simulated model's exact text; no 5xx was ever counted."""
    for route, field, value in (("completions", "prompt", "still there?"), ("chat", "messages", MESSAGES)):
        body = {"model": MODEL, field: value, "max_tokens": 5}
        status, content_type, data = svc.post(PATHS[route], json.dumps(body).encode())
        assert status == 200, data[:500]
        want = expected_text("still there?", 5) if route == "completions" else expected_chat_text(MESSAGES, 5)
        assert completion_text(route, content_type, data) == want
    assert http_get(f"{svc.server.url}/health")[0] == 200
    samples = parse_prometheus(http_get(f"{svc.server.url}/metrics")[1].decode())
    server_errors = {
        labels: v
        for (name, labels), v in samples.items()
        if name == "vllm_disagg_requests_total" and dict(labels).get("status", "").startswith("5")
    }
    assert not (no_5xx and server_errors), f"the gateway answered 5xx: {server_errors}"
    assert metric_sum(samples, "vllm_disagg_requests_total") > 0


# --- request bodies ---

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
# Token ids below 256 are bytes, in every simulated engine's vocabulary.
prompts = st.text(min_size=1, max_size=200) | st.lists(st.integers(0, 255), min_size=1, max_size=64)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=100)}
    ),
    min_size=1,
    max_size=4,
)
OPTIONAL = {
    "max_tokens": st.integers(1, 32),
    "stream": st.booleans(),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "seed": st.integers(0, 2**31),
    "stop": st.lists(st.text(max_size=5), max_size=3),
    "user": st.text(max_size=20),
}
valid_bodies = {
    "completions": st.fixed_dictionaries({"model": st.just(MODEL), "prompt": prompts}, optional=OPTIONAL),
    "chat": st.fixed_dictionaries({"model": st.just(MODEL), "messages": messages}, optional=OPTIONAL),
}
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**63, 2**64, 10**30, -(10**30), 1.5, -0.0, 1e308, "", " ", "x" * 3000,
    "é😀\u2028\u0000\ufeff", [], [None], [[1]], [""], [{}], {}, {"a": 1}, {"content": [1]},
]  # fmt: skip
odd_values = st.sampled_from(ODD_VALUES) | json_values
NEST = "\u0000fuzz-nest\u0000"  # dumped in place of a deep value, then replaced by its text
NEST_DEPTHS = st.integers(1, 1200)  # orjson reads 1,024 levels and writes 255: both edges inside


def nested(depth: int, leaf: str = "1") -> str:
    """JSON text of a list nested ``depth`` levels deep."""
    return "[" * depth + leaf + "]" * depth


def nested_map(depth: int) -> str:
    """JSON text of a map nested ``depth`` levels deep."""
    return '{"a":' * depth + "1" + "}" * depth


def slots(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a JSON value, at any depth."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out: list[tuple[Any, Any]] = []
    for key, value in list(items):
        out.append((node, key))
        out.extend(slots(value))
    return out


@st.composite
def mutated_bodies(draw: st.DrawFn, route: str) -> bytes:
    """A valid body of ``route``, then one mutation of its structure or of its bytes."""
    body = draw(valid_bodies[route])
    op = draw(st.sampled_from(["replace", "drop", "add", "model", "shape", "nest", "text", "flip", "cut"]))
    if op in ("replace", "nest"):
        container, key = draw(st.sampled_from(slots(body)))
        container[key] = NEST if op == "nest" else draw(odd_values)
        text = json.dumps(body)
        if op == "nest":
            depth = draw(NEST_DEPTHS)
            kind = draw(st.sampled_from(["list", "map"]))
            text = text.replace(json.dumps(NEST), nested(depth) if kind == "list" else nested_map(depth))
        return text.encode()
    if op == "drop":
        maps = [body] + [c[k] for c, k in slots(body) if isinstance(c[k], dict)]
        target = draw(st.sampled_from([m for m in maps if m] or [body]))
        target.pop(draw(st.sampled_from(sorted(target))), None)
    elif op == "add":
        body[draw(st.text(max_size=12))] = draw(odd_values)
    elif op == "model":
        body["model"] = draw(st.text(max_size=30).filter(lambda m: m != MODEL) | odd_values)
    elif op == "shape":
        return json.dumps(
            draw(st.sampled_from([[body], body.get("prompt"), None, 7, "text", [], {}]))
        ).encode()
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    if op == "text":  # JSON that only Python writes: NaN and Infinity literals
        text = text.replace(
            "}", ', "temperature": ' + draw(st.sampled_from(["NaN", "Infinity", "-Infinity"])) + "}"
        )
    raw = bytearray(text.encode())
    if op == "flip":
        for bit in draw(st.lists(st.integers(0, len(raw) * 8 - 1), min_size=1, max_size=4)):
            raw[bit // 8] ^= 1 << (bit % 8)
    elif op == "cut":
        del raw[draw(st.integers(0, len(raw) - 1)) :]
    return bytes(raw)


CONTENT_TYPES = [
    "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    "application/json; charset=latin-1", None,
]  # fmt: skip
routes = st.sampled_from(sorted(PATHS))


# --- the tests ---


def test_fuzzed_bodies_get_a_4xx_with_a_reason_or_a_valid_completion_and_never_a_5xx(
    service: Service,
) -> None:
    requests = routes.flatmap(lambda r: st.tuples(st.just(r), st.binary(max_size=512) | mutated_bodies(r)))

    @settings(FUZZ, max_examples=400)
    @given(request=requests, content_type=st.sampled_from(CONTENT_TYPES), chunked=st.booleans())
    @example(request=("completions", b""), content_type=None, chunked=False)
    @example(request=("chat", b"{}"), content_type="application/json", chunked=True)
    def one(request: tuple[str, bytes], content_type: str | None, chunked: bool) -> None:
        route, body = request
        check_answer(route, service.post(PATHS[route], body, content_type, chunked))

    one()
    still_serving(service)


def test_valid_bodies_with_any_text_get_the_models_exact_completion(service: Service) -> None:
    @settings(FUZZ, max_examples=100)
    @given(data=st.data(), route=routes)
    def one(data: st.DataObject, route: str) -> None:
        body: dict[str, Any] = data.draw(valid_bodies[route], label="body")
        status, content_type, raw = service.post(PATHS[route], json.dumps(body).encode())
        if status != 200:  # the engine may refuse what does not fit its context: a 400 that says so
            assert status == 400 and "context length" in check_error(status, content_type, raw)["message"]
            return
        max_tokens: int = body.get("max_tokens", 16)
        want = (
            expected_text(body["prompt"], max_tokens)
            if route == "completions"
            else expected_chat_text(body["messages"], max_tokens)
        )
        assert completion_text(route, content_type, raw) == want

    one()
    still_serving(service)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("route", sorted(PATHS))
def test_a_body_over_the_limit_is_refused_with_413_however_it_is_sent(
    service: Service, route: str, chunked: bool
) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY, "messages": MESSAGES}).encode()
    status, content_type, data = service.post(PATHS[route], body, chunked=chunked)
    assert status == 413
    assert "limit" in check_error(status, content_type, data)["message"]
    still_serving(service)


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        pytest.param("completions", {"model": "nope", "prompt": "x"}, 404, "model", id="unknown-model-404"),
        pytest.param("chat", {"model": MODEL, "messages": []}, 400, "messages", id="no-messages-400"),
        pytest.param(
            "completions",
            {"model": MODEL, "prompt": "x", "max_tokens": True},
            400,
            "max_tokens",
            id="bool-max-tokens-400",
        ),
        pytest.param(
            "completions",
            {"model": MODEL, "prompt": "x", "max_tokens": 10**6},
            400,
            "max_tokens",
            id="max-tokens-beyond-the-context-400",
        ),
        # Refused by the prefill engine; the gateway's 400 names the leg, without the engine's param.
        pytest.param(
            "completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, None, id="n-2-refused-by-the-engine"
        ),
    ],
)
def test_named_bad_bodies_get_the_status_and_param_that_name_the_problem(
    service: Service, route: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    got, content_type, data = service.post(PATHS[route], json.dumps(body).encode())
    assert got == status, data[:300]
    error = check_error(got, content_type, data)
    if param is not None:
        assert error["param"] == param


metric_values = st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e308])


def test_agents_reporting_nan_inf_or_negative_metrics_do_not_break_scheduling(service: Service) -> None:
    @settings(FUZZ, max_examples=60)
    @given(
        metrics=st.builds(
            MetricsSnapshot,
            num_running=st.integers(-(2**63), 2**64 - 1),
            num_waiting=st.integers(-(2**63), 2**64 - 1),
            kv_cache_usage=metric_values,
            ttft_s=st.none() | metric_values,
            tpot_s=st.none() | metric_values,
            prefix_cache_hit_rate=st.none() | metric_values,
            queue_s=st.none() | metric_values,
            prefill_tokens_per_s=st.none() | metric_values,
            mean_prompt_tokens=st.none() | metric_values,
        )
    )
    def one(metrics: MetricsSnapshot) -> None:
        service.report(metrics)
        prompt = "the scheduler reads these"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
        status, content_type, data = service.post(PATHS["completions"], json.dumps(body).encode())
        # Metrics that say "full" may make every instance ineligible: a 503 that says so is honest.
        if status == 503:
            assert json.loads(data)["error"]["message"]
        else:
            assert status == 200, data[:500]
            assert completion_text("completions", content_type, data) == expected_text(prompt, 3)

    one()
    service.report(MetricsSnapshot())
    still_serving(service, no_5xx=False)  # its 503s were checked one by one


# --- found by the fuzzing: deep nesting (orjson reads 1,024 levels and writes 255; Python recurses 1,000) ---


def with_deep(route: str, field: str, deep_json: str) -> str:
    """A valid body of ``route`` whose ``field`` holds this deeply nested JSON text."""
    base: dict[str, Any] = {
        "model": MODEL,
        **({"prompt": "x"} if route == "completions" else {"messages": MESSAGES}),
    }
    return json.dumps({**base, field: NEST}).replace(json.dumps(NEST), deep_json)


DEEP_BODIES = [
    pytest.param("completions", "prompt", nested(600, '"x"'), id="a-prompt-nested-600-deep"),
    pytest.param(
        "chat",
        "messages",
        '[{"role": "user", "content": ' + nested(600, '"x"') + "}]",
        id="a-message-content-nested-600-deep",
    ),
    pytest.param("completions", "user", nested(300), id="any-field-nested-300-deep"),
    pytest.param("completions", "stream", nested_map(1010), id="a-stream-flag-nested-1010-deep"),
    pytest.param("completions", "max_tokens", nested(1010), id="max-tokens-nested-1010-deep"),
    pytest.param("completions", "user", nested(1100), id="a-body-nested-deeper-than-the-json-parser-reads"),
]


@pytest.mark.parametrize(("route", "field", "deep_json"), DEEP_BODIES)
def test_a_deeply_nested_body_gets_a_400_that_says_why(
    service: Service, route: str, field: str, deep_json: str
) -> None:
    status, content_type, data = service.post(PATHS[route], with_deep(route, field, deep_json).encode())
    assert status == 400, data[:300]
    check_error(status, content_type, data)
