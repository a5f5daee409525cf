"""Recorded engine shapes: what each engine version writes, and a test engine that replays it.

``tests/fixtures/engines/<dialect>.jsonl`` holds, per dialect, the exact response bytes of every case
(completions and chat; streamed with and without usage, and whole; plain, stopped by a stop string, and
with a token that ends inside a UTF-8 character; with and without ``return_token_ids``). vLLM 0.32's
are real recordings (scripts/record_engine_fixtures.py); the other dialects' are rendered from the same
generations by ``tests/engines/dialects.py``, which follows each version's source. ``ReplayEngine``
serves a dialect on a real port, as the gateway meets it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engines.dialects import (
    CHAT,
    CHAT_PROMPT_IDS,
    CHAT_TOKEN_IDS,
    COMPLETIONS,
    COMPLETIONS_TOKEN_IDS,
    DIALECTS,
    DONE,
    SSE,
    Generation,
    Step,
    compact,
)
from tests.engines.reading import read_answer
from tests.engines.replay import FIXTURES, ReplayEngine, continued, synthetic, truncated
from vllm_disagg.wire.kv_transfer import PREFILL_LEG, remote_prefill


def _fixtures() -> list[tuple[str, dict[str, Any]]]:
    lines = []
    for name in DIALECTS:
        text = (FIXTURES / f"{name}.jsonl").read_text(encoding="utf-8")
        lines += [(name, json.loads(line)) for line in text.splitlines() if line]
    return lines


LINES = _fixtures()
LINE_IDS = [f"{name}:{line['case']}" for name, line in LINES]
SERVED = [(name, line) for name, line in LINES if line["status"] == 200]
SERVED_IDS = [f"{name}:{line['case']}" for name, line in SERVED]


def generation(line: dict[str, Any]) -> Generation:
    return Generation.from_json(line["generation"])


def recorded(case: str) -> dict[str, Any]:
    """A vLLM 0.32 recording (every dialect's fixture shares its generation)."""
    return next(line for name, line in LINES if name == "vllm-0.32" and line["case"] == case)


def streamed(line: dict[str, Any]) -> bool:
    return bool(line["request"].get("stream"))


def test_every_dialect_has_every_case_once() -> None:
    cases = {name: sorted(line["case"] for n, line in LINES if n == name) for name in DIALECTS}
    assert len(cases["vllm-0.32"]) == 2 * 3 * 3 * 2 == len(set(cases["vllm-0.32"]))
    assert all(names == cases["vllm-0.32"] for names in cases.values())


# --- the fixtures -------------------------------------------------------------------------------


@pytest.mark.parametrize(("dialect", "line"), LINES, ids=LINE_IDS)
def test_a_fixture_rerenders_byte_for_byte_from_its_generation(dialect: str, line: dict[str, Any]) -> None:
    status, content_type, body = DIALECTS[dialect].render(
        line["path"], line["request"], generation(line), line["request_id"], line["created"]
    )
    assert (status, content_type) == (line["status"], line["content_type"])
    assert body.decode() == line["body"]


@pytest.mark.parametrize(("dialect", "line"), SERVED, ids=SERVED_IDS)
def test_a_fixture_reads_back_as_its_generation(dialect: str, line: dict[str, Any]) -> None:
    gen = generation(line)
    answer = read_answer(line["body"].encode(), stream=streamed(line), chat=line["path"] == CHAT)
    assert answer.text == gen.text, "the steps' texts, stop string already cut as vLLM cuts it"
    assert answer.finish_reasons == (gen.finish_reason,)
    assert answer.ids == {DIALECTS[dialect].response_id(line["path"], "fixture")}
    assert answer.errors == () and answer.done == streamed(line)
    with_usage = not streamed(line) or "stream_options" in line["request"]
    assert (answer.usage is not None) == with_usage
    if answer.usage is not None:
        assert answer.usage["prompt_tokens"] == len(gen.prompt_ids)
        assert answer.usage["completion_tokens"] == len(gen.token_ids)


@pytest.mark.parametrize(("dialect", "line"), LINES, ids=LINE_IDS)
def test_token_ids_come_back_exactly_where_the_dialect_returns_them(
    dialect: str, line: dict[str, Any]
) -> None:
    caps = DIALECTS[dialect].capabilities
    chat = line["path"] == CHAT
    asked = bool(line["request"].get("return_token_ids"))
    if streamed(line):
        able = CHAT_TOKEN_IDS in caps if chat else COMPLETIONS_TOKEN_IDS in caps
    else:
        able = COMPLETIONS_TOKEN_IDS in caps  # whole bodies carry them wherever streams of text do
    if dialect == "sglang" and chat and streamed(line) and asked:
        assert line["status"] == 400 and "return_token_ids is not supported" in line["body"]
        return
    gen = generation(line)
    answer = read_answer(line["body"].encode(), stream=streamed(line), chat=chat)
    assert answer.token_ids == (gen.token_ids if asked and able else None)
    if asked and able:
        assert answer.prompt_token_ids == gen.prompt_ids


def test_vllm_0_10_2_streams_the_prompt_ids_even_unasked() -> None:
    """0.10.2's completion_stream_generator reuses ``has_echoed`` for them whatever return_token_ids says
    (fixed by 0.32); its token_ids still need the parameter."""
    line = next(
        line for n, line in LINES if n == "vllm-0.10.2" and line["case"] == "completions-stream-plain"
    )
    answer = read_answer(line["body"].encode(), stream=True, chat=False)
    assert answer.prompt_token_ids == generation(line).prompt_ids and answer.token_ids is None


@pytest.mark.parametrize("case", ["completions-stream-multibyte-ids", "chat-stream-multibyte-ids"])
def test_a_multibyte_case_holds_bytes_back_then_releases_them(case: str) -> None:
    steps = generation(recorded(case)).steps
    held = [i for i, step in enumerate(steps[:-1]) if step.text == "" and steps[i + 1].text]
    assert held, "a token ended inside a UTF-8 character: its step's text is empty"
    assert all(steps[i + 1].text.startswith("\ufffd") for i in held), "the next carries the bytes"


@pytest.mark.parametrize("case", ["completions-stream-stop-ids", "chat-stream-stop-ids"])
def test_a_stop_case_stops_on_its_string_with_the_text_lagging(case: str) -> None:
    line = recorded(case)
    stop, gen = line["request"]["stop"], generation(line)
    plain = generation(recorded(case.replace("-stop", "-plain")))
    assert (gen.finish_reason, gen.stop_reason) == ("stop", stop)
    assert gen.token_ids == plain.token_ids[: len(gen.token_ids)], "the same tokens, fewer of them"
    assert plain.text.startswith(gen.text + stop), "the text ends where the stop string begins"
    lagging = [
        i
        for i, (s, p) in enumerate(zip(gen.steps, plain.steps[: len(gen.steps)], strict=True))
        if s.text != p.text
    ]
    assert lagging and lagging[0] == 0, "vLLM holds back text that may begin the stop string"


# --- the replay engine --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def replaying(
    dialect: str, **options: Any
) -> AsyncIterator[tuple[ReplayEngine, aiohttp.ClientSession]]:
    engine = await ReplayEngine(dialect, **options).start()
    try:
        async with aiohttp.ClientSession() as http:
            yield engine, http
    finally:
        await engine.close()


async def post(
    http: aiohttp.ClientSession,
    engine: ReplayEngine,
    path: str,
    body: dict[str, Any],
    request_id: str = "replayed",
) -> tuple[int, str, bytes]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    async with http.post(engine.url + path, data=json.dumps(body), headers=headers) as resp:
        return resp.status, resp.headers["Content-Type"], await resp.read()


@pytest.mark.parametrize(("dialect", "line"), LINES, ids=LINE_IDS)
async def test_the_replay_engine_answers_a_fixture_request_with_its_bytes(
    dialect: str, line: dict[str, Any]
) -> None:
    async with replaying(dialect) as (engine, http):
        engine.clock = lambda: line["created"]
        status, content_type, body = await post(http, engine, line["path"], line["request"])
    ids = [DIALECTS[dialect].response_id(line["path"], r) for r in ("fixture", "replayed")]
    assert (status, content_type) == (line["status"], line["content_type"])
    assert body.decode() == line["body"].replace(*ids), "the fixture's bytes, under this request's id"
    assert engine.requests == [(line["path"], line["request"])]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("source", ["completions-stream-plain-ids", "chat-stream-plain-ids"])
@pytest.mark.parametrize("k", [0, 1, 4, 5, 11])
async def test_a_prompt_of_ids_that_extends_a_recording_gets_the_rest_of_it(
    dialect: str, source: str, k: int
) -> None:
    gen = generation(recorded(source))  # a chat's prompt ids resume on /v1/completions too
    prompt = [*gen.prompt_ids, *gen.token_ids[:k]]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12 - k, "temperature": 0, "stream": True}
    body.update({"stream_options": {"include_usage": True}, "return_token_ids": True})
    async with replaying(dialect) as (engine, http):
        status, _, raw = await post(http, engine, COMPLETIONS, body)
    answer = read_answer(raw, stream=True, chat=False)
    assert status == 200 and answer.text == "".join(step.text for step in gen.steps[k:])
    assert answer.usage is not None
    assert (answer.usage["prompt_tokens"], answer.usage["completion_tokens"]) == (len(prompt), 12 - k)
    if COMPLETIONS_TOKEN_IDS in DIALECTS[dialect].capabilities:
        assert answer.token_ids == gen.token_ids[k:] and answer.prompt_token_ids == tuple(prompt)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_chat_resumes_from_kv_prompt_ids_only_where_the_dialect_runs_them(dialect: str) -> None:
    gen = generation(recorded("chat-whole-plain-ids"))
    context = [*gen.prompt_ids, *gen.token_ids[:3]]
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 9,
        "temperature": 0,
    }
    body["kv_transfer_params"] = {"prompt_token_ids": context}
    async with replaying(dialect) as (engine, http):
        status, _, raw = await post(http, engine, CHAT, body)
    answer = read_answer(raw, stream=False, chat=True)
    assert status == 200 and answer.usage is not None
    if CHAT_PROMPT_IDS in DIALECTS[dialect].capabilities:
        assert answer.text == "".join(step.text for step in gen.steps[3:])
        assert answer.usage["prompt_tokens"] == len(context)
    else:  # the messages are rendered again: the recorded answer from its start
        assert answer.text == "".join(step.text for step in gen.steps[:9])
        assert answer.usage["prompt_tokens"] == len(gen.prompt_ids)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_the_agent_probes_see_each_dialects_capabilities(dialect: str) -> None:
    caps = DIALECTS[dialect].capabilities
    probe = {"model": "tiny", "max_tokens": 1, "temperature": 0, "stream": True, "return_token_ids": True}
    hi = [{"role": "user", "content": "Hi"}]
    async with replaying(dialect) as (engine, http):
        a = await post(http, engine, COMPLETIONS, {**probe, "prompt": "Hi"})
        b = await post(http, engine, CHAT, {**probe, "messages": hi})
        read_a = read_answer(a[2], stream=True, chat=False)
        prompt_ids = list(read_a.prompt_token_ids or b"Hi")
        c_body = {"model": "tiny", "messages": hi, "max_tokens": 1, "temperature": 0}
        c = await post(http, engine, CHAT, {**c_body, "kv_transfer_params": {"prompt_token_ids": prompt_ids}})
    assert a[0] == 200 and (read_a.token_ids is not None) == (COMPLETIONS_TOKEN_IDS in caps)
    read_b = read_answer(b[2], stream=b[1] == SSE, chat=True)
    assert (b[0] == 200 and read_b.token_ids is not None) == (CHAT_TOKEN_IDS in caps)
    if CHAT_TOKEN_IDS in caps:
        assert read_b.prompt_token_ids is not None and read_b.prompt_token_ids != tuple(prompt_ids)
    usage = read_answer(c[2], stream=False, chat=True).usage
    assert c[0] == 200 and usage is not None
    assert (usage["prompt_tokens"] == len(prompt_ids)) == (CHAT_PROMPT_IDS in caps)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("cached_in_handle", [True, False])
async def test_a_prefill_leg_gets_one_token_and_a_producer_handle(
    dialect: str, cached_in_handle: bool
) -> None:
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 1, "temperature": 0, "stream": False}
    body["kv_transfer_params"] = dict(PREFILL_LEG)
    async with replaying(dialect, prefill_cache_in_handle=cached_in_handle) as (engine, http):
        status, _, raw = await post(http, engine, COMPLETIONS, body)
        params = json.loads(raw)["kv_transfer_params"]
        decode = {**body, "max_tokens": 12, "kv_transfer_params": params}
        _, _, decoded = await post(http, engine, COMPLETIONS, decode)
    answer = read_answer(raw, stream=False, chat=False)
    handle = remote_prefill(params)
    whole = recorded("completions-whole-plain")
    assert read_answer(decoded, stream=False, chat=False).text == generation(whole).text, (
        "the handle is ignored"
    )
    assert status == 200 and answer.usage is not None and answer.usage["completion_tokens"] == 1
    assert answer.text == generation(whole).steps[0].text
    assert handle.host == "127.0.0.1" and handle.block_ids == (0,)
    assert handle.prefill_cached_tokens == (0 if cached_in_handle else None)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_stream_cut_by_a_disconnect_ends_after_its_events_without_done(dialect: str) -> None:
    line = next(line for n, line in LINES if n == dialect and line["case"] == "completions-stream-plain")
    async with replaying(dialect) as (engine, http):
        engine.cut = lambda path, body: (2, "disconnect")
        headers = {"Content-Type": "application/json"}
        async with http.post(
            engine.url + COMPLETIONS, data=json.dumps(line["request"]), headers=headers
        ) as resp:
            got = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    got += chunk
    answer = read_answer(got, stream=True, chat=False)
    assert not answer.done and answer.text == "".join(step.text for step in generation(line).steps[:2])


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_stream_cut_by_the_engine_core_dying_ends_as_that_engine_ends_it(dialect: str) -> None:
    line = next(line for n, line in LINES if n == dialect and line["case"] == "chat-stream-plain")
    died = DIALECTS[dialect].died_event()
    async with replaying(dialect) as (engine, http):
        engine.cut = lambda path, body: (3, "engine-core-died")
        if died is None:  # SGLang's watchdog kills the whole server: the connection just ends
            with pytest.raises(aiohttp.ClientPayloadError):
                await post(http, engine, CHAT, line["request"])
            return
        status, _, raw = await post(http, engine, CHAT, line["request"])
    events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
    assert status == 200 and events[3:] == [died.encode(), DONE.encode()]
    answer = read_answer(raw, stream=True, chat=True)
    assert answer.done and len(answer.errors) == 1 and "EngineCore" in answer.errors[0]["message"]


async def test_an_unrecorded_prompt_gets_a_repeatable_synthetic_generation_that_resumes() -> None:
    body = {"model": "tiny", "prompt": "an unrecorded prompt", "max_tokens": 6, "stream": True}
    body["return_token_ids"] = True
    async with replaying("vllm-0.32") as (engine, http):
        first = read_answer((await post(http, engine, COMPLETIONS, body))[2], stream=True, chat=False)
        again = read_answer((await post(http, engine, COMPLETIONS, body))[2], stream=True, chat=False)
        assert first.token_ids is not None and first.prompt_token_ids is not None
        resumed_body = {**body, "prompt": [*first.prompt_token_ids, *first.token_ids[:2]], "max_tokens": 4}
        resumed = read_answer(
            (await post(http, engine, COMPLETIONS, resumed_body))[2], stream=True, chat=False
        )
    assert first == again and first.text.isascii() and all(t < 2048 for t in first.token_ids)
    assert resumed.token_ids == first.token_ids[2:]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_prompt_beyond_the_vocabulary_gets_the_dialects_error_body(dialect: str) -> None:
    body = {"model": "tiny", "prompt": [1, 99999], "max_tokens": 4}
    async with replaying(dialect) as (engine, http):
        status, content_type, raw = await post(http, engine, COMPLETIONS, body)
    answer = read_answer(raw, stream=False, chat=False)
    assert (status, content_type) == (400, "application/json")
    assert [e["message"] for e in answer.errors] == ["Token id 99999 is out of vocabulary"]


async def test_requests_are_kept_in_order_and_max_tokens_cuts_a_recording() -> None:
    plain = recorded("completions-whole-plain")
    short = {**plain["request"], "max_tokens": 3}
    async with replaying("vllm-0.10.2") as (engine, http):
        await post(http, engine, COMPLETIONS, plain["request"])
        _, _, raw = await post(http, engine, COMPLETIONS, short)
    answer = read_answer(raw, stream=False, chat=False)
    assert engine.requests == [(COMPLETIONS, plain["request"]), (COMPLETIONS, short)]
    assert answer.text == "".join(step.text for step in generation(plain).steps[:3])
    assert answer.finish_reasons == ("length",)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_the_other_routes_answer_as_the_engine_does(dialect: str) -> None:
    async with replaying(dialect) as (engine, http):
        async with http.get(engine.url + "/v1/models") as resp:
            models = await resp.json()
        async with http.get(engine.url + "/health") as resp:
            health = resp.status
        async with http.get(engine.url + "/version") as resp:
            version = resp.status, await resp.json()
        async with http.get(engine.url + "/metrics") as resp:
            families = {f.name for f in text_string_to_metric_families(await resp.text())}
        async with http.post(engine.url + "/v1/embeddings", json={}) as resp:
            missing = resp.status
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == "tiny" and card["max_model_len"] == 512
    assert health == 200 and missing == 404
    if dialect == "sglang":
        assert version[0] == 404 and {"sglang:num_running_reqs", "sglang:num_queue_reqs"} <= families
    else:
        assert version == (200, {"version": DIALECTS[dialect].version}) and "root" in card
        assert {"vllm:num_requests_running", "vllm:num_requests_waiting"} <= families


# --- pieces ---------------------------------------------------------------------------------------


def test_one_compact_encoder_writes_what_each_engines_encoder_writes() -> None:
    """pydantic (model_dump_json), Starlette's JSONResponse (json.dumps compact), orjson (SGLang's
    ORJSONResponse) and msgspec (SGLang's chat chunks) agree byte for byte on these values."""
    pydantic = pytest.importorskip("pydantic")
    msgspec = pytest.importorskip("msgspec")
    orjson = pytest.importorskip("orjson")
    text = "".join(map(chr, range(0x30))) + "\x7f\u2028\ufffd \u00e9\U0001f600<>&/\\"
    value = {"text": text, "ids": [1, 2047], "none": None, "empty": [], "nested": {"ok": True, "n": -3}}
    written = compact(value)
    assert pydantic.RootModel[dict[str, Any]](value).model_dump_json() == written
    assert orjson.dumps(value).decode() == written
    assert msgspec.json.encode(value).decode() == written


def test_truncation_and_continuation_work_on_whole_steps() -> None:
    gen = Generation((1, 2), (Step((10,), "a"), Step((11, 12), "bc"), Step((13,), "d")), "stop", "x")
    assert truncated(gen, 3) == Generation((1, 2), gen.steps[:2], "length")
    assert truncated(gen, 9) is gen
    assert continued(gen, (1, 2, 10)) == Generation((1, 2, 10), gen.steps[1:], "stop", "x")
    assert continued(gen, (1, 2, 10, 11)) is None, "not on a step boundary"
    assert continued(gen, (1, 2, 10, 11, 12, 13)) is None, "nothing left"
    assert synthetic((5, 6), 4).steps[2:] == synthetic((5, 6, *synthetic((5, 6), 2).token_ids), 2).steps


def test_reading_follows_the_event_stream_rules() -> None:
    body = (
        b": a comment\r\n"
        b'data: {"id":"x","choices":[{"index":0,\r\ndata: "text":"a\\u00e9","finish_reason":null}]}\r\n\r\n'
        b'event: other\ndata: {"id":"x","choices":[{"index":1,"text":"no"},{"index":0,"text":"b",'
        b'"finish_reason":"length","token_ids":[3]}],"usage":{"prompt_tokens":1}}\n\n'
        b'data: {"error": {"message": "boom", "code": 500}}\r\r'
        b"data: [DONE]\n\n"
        b'data: {"id":"cut before its blank line"}\n'
    )
    answer = read_answer(body, stream=True, chat=False)
    assert answer.text == "a\u00e9b" and answer.finish_reasons == ("length",)
    assert answer.token_ids == (3,) and answer.prompt_token_ids is None and answer.ids == {"x"}
    assert answer.usage == {"prompt_tokens": 1} and answer.done
    assert answer.errors == ({"message": "boom", "code": 500},)
