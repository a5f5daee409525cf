"""The resumable relay takes runs of ordinary events at once: exactly what it does event by event.

An engine's chunk may hold many events (a fast engine, a busy gateway); ``StreamState`` then relays
the ordinary ones in a few scans of the whole run instead of one pass per event. Whatever the events
and wherever the chunks break, the client's bytes, the state a resume starts from and the errors must
equal those of the same stream fed one event per chunk (which never takes that path).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.orchestrator.gateway.stream_support import Out, chunks
from vllm_disagg.errors import UpstreamError
from vllm_disagg.orchestrator.gateway.resume import StreamState

HEAD_COMPLETION = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1795437855,"model":"tiny","choices":['
)
HEAD_CHAT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1795437855,"model":"tiny",'
    b'"choices":['
)
PROMPT_IDS = b"[449,523,265,10]"
# Texts as JSON writes them: empty, plain, and ones spelling the relay's own markers (escaped, so
# never the markers themselves).
TEXTS = [
    b"",
    b" grove",
    b"x",
    b'\\"finish_reason\\":\\"stop',
    b'\\"token_ids\\":[1,2]',
    b"data: [DONE]\\n\\n",
    b'\\"text\\":\\"\\",',
    b"caf\\u00e9",
]


@dataclass(frozen=True)
class Token:
    text: bytes
    ids: tuple[int, ...]
    finish: bool = False
    usage: bool = False  # continuous usage stats in the event
    odd: str = ""  # "bare": no finish_reason key; "prompt": prompt ids on a later event (not vLLM's)


def _odd(token: Token) -> Token:
    """A token made odd as ``token.odd`` says: no text, usage in the event, no ids."""
    if token.odd == "empty":
        return Token(b"", token.ids)
    if token.odd == "usage":
        return Token(token.text, token.ids, usage=True)
    if token.odd == "no-ids":
        return Token(token.text, ())
    return token


def completion_event(token: Token, first: bool) -> bytes:
    finish = b'"length"' if token.finish else b"null"
    ids = b"[" + b",".join(b"%d" % i for i in token.ids) + b"]"
    usage = b',"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}' if token.usage else b""
    return (
        HEAD_COMPLETION
        + b'{"index":0,"text":"'
        + token.text
        + b'","logprobs":null'
        + (b"" if token.odd == "bare" else b',"finish_reason":' + finish)
        + b',"stop_reason":null,"prompt_token_ids":'
        + (PROMPT_IDS if first or token.odd == "prompt" else b"null")
        + b',"token_ids":'
        + ids
        + b"}]"
        + usage
        + b"}"
    )


def chat_events(token: Token, first: bool) -> list[bytes]:
    events = []
    if first:
        events.append(
            HEAD_CHAT
            + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
            + b'"prompt_token_ids":'
            + PROMPT_IDS
            + b',"prompt_text":null}'
        )
    ids = b"[" + b",".join(b"%d" % i for i in token.ids) + b"]"
    delta = b'{"content":"' + token.text + b'"}' if token.text else b"{}"
    finish = b'"length","stop_reason":null' if token.finish else b"null"
    usage = b',"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}' if token.usage else b""
    events.append(
        HEAD_CHAT
        + b'{"index":0,"delta":'
        + delta
        + b',"logprobs":null'
        + (b"" if token.odd == "bare" else b',"finish_reason":' + finish)
        + b',"token_ids":'
        + ids
        + b"}]"
        + (b',"prompt_token_ids":' + PROMPT_IDS if token.odd == "prompt" else b"")
        + usage
        + b"}"
    )
    return events


def usage_event(head: bytes) -> bytes:
    return (
        head
        + b'],"usage":{"prompt_tokens":4,"total_tokens":9,"completion_tokens":5,'
        + b'"prompt_tokens_details":{"cached_tokens":4}}}'
    )


@st.composite
def streams(draw: st.DrawFn) -> tuple[bool, bytes]:
    """(chat, the engine's whole stream): tokens, maybe a finish, usage, [DONE], or an error."""
    chat = draw(st.booleans())
    # Per stream, how many of 40 tokens are odd: none (long runs of ordinary events), a few, many.
    odd_share = draw(st.sampled_from([0, 2, 12]))
    odd = st.sampled_from(["empty", "usage", "bare", "prompt", "no-ids"] + [""] * (40 - odd_share))
    token = st.builds(
        Token,
        text=st.sampled_from(TEXTS[1:]),
        ids=st.lists(st.integers(0, 50_000), min_size=1, max_size=3).map(tuple),
        odd=odd,
    ).map(_odd)
    body = draw(st.lists(token, min_size=1, max_size=40))
    ending = draw(st.sampled_from(["finish", "finish+usage", "error", "cut", "finish-no-done"]))
    if ending.startswith("finish"):
        body[-1] = Token(body[-1].text, body[-1].ids, finish=True, usage=body[-1].usage)
    head = HEAD_CHAT if chat else HEAD_COMPLETION
    events: list[bytes] = []
    for i, drawn in enumerate(body):
        events += chat_events(drawn, i == 0) if chat else [completion_event(drawn, i == 0)]
    if ending == "error":
        events.insert(draw(st.integers(1, len(events))), b'data: {"error":{"message":"engine core died"}}')
    if ending == "finish+usage":
        events.append(usage_event(head))
    if ending in ("finish", "finish+usage", "error"):
        events.append(b"data: [DONE]")
    data = b"".join(e + b"\n\n" for e in events)
    if ending == "cut":
        data = data[: draw(st.integers(1, len(data) - 1))]
    return chat, data


async def relay(
    chat: bool, client_ids: bool, parts: list[bytes]
) -> tuple[bytes, bool, object, list[int], int, int, bool, bool, int | None]:
    """Everything observable after relaying ``parts``: bytes, outcome and the resume state."""
    state = StreamState(chat=chat, client_ids=client_ids, max_tokens=None)
    out = Out()
    try:
        outcome: object = await state.relay(out, parts[0], chunks(*parts[1:]))
    except UpstreamError as exc:
        outcome = (type(exc).__name__, exc.message, exc.cause)
    return (
        out.data,
        out.ended,
        outcome,
        state.ids,
        state.n_ids,
        state.safe,
        state.finished,
        state.done,
        state.cached_tokens,
    )


def one_per_event(data: bytes) -> list[bytes]:
    events = data.split(b"\n\n")
    parts = [e + b"\n\n" for e in events[:-1]]
    return [*parts, events[-1]] if events[-1] else parts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.booleans(), st.lists(st.integers(0, 1 << 20), max_size=6))
def test_any_chunking_relays_the_same_bytes_and_state_as_one_event_per_chunk(
    stream: tuple[bool, bytes], client_ids: bool, cuts: list[int]
) -> None:
    chat, data = stream
    points = sorted({c % len(data) for c in cuts} - {0})
    parts = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    # a synchronous test running its own loop: hypothesis drives plain functions
    got = asyncio.run(relay(chat, client_ids, parts))
    assert got == asyncio.run(relay(chat, client_ids, one_per_event(data)))


async def test_a_whole_stream_in_one_chunk_nulls_the_ids_and_keeps_them_for_a_resume() -> None:
    tokens = [Token(b" a", (5,)), Token(b" b", (6, 7)), Token(b" c", (8,)), Token(b" d", (9,), finish=True)]
    data = b"".join(completion_event(t, i == 0) + b"\n\n" for i, t in enumerate(tokens)) + b"data: [DONE]\n\n"
    sent, ended, outcome, ids, n_ids, safe, finished, done, _ = await relay(False, False, [data])
    assert outcome is True and finished and done and ended
    assert ids == [5, 6, 7, 8, 9] and n_ids == 5 and safe == 5
    assert b'"token_ids":[' not in sent and b'"prompt_token_ids":[' not in sent
    assert sent.count(b'"token_ids":null') == 4 and sent.endswith(b"data: [DONE]\n\n")


async def test_a_run_with_a_token_without_text_resumes_after_the_last_token_with_text() -> None:
    tokens = [Token(b" a", (5,)), Token(b" b", (6,)), Token(b"", (7,)), Token(b"", (8,))]
    data = b"".join(completion_event(t, i == 0) + b"\n\n" for i, t in enumerate(tokens))
    _, ended, outcome, ids, n_ids, safe, finished, done, _ = await relay(False, False, [data])
    assert outcome == ("StreamBroken", "ended its stream without [DONE]", "disconnect")
    assert ids == [5, 6, 7, 8] and n_ids == 4
    assert safe == 2  # the client has tokens 7 and 8 but no text for them: a resume regenerates them
    assert not finished and not done and not ended


@pytest.mark.parametrize("odd", ["empty", "usage", "bare", "prompt", "no-ids"])
@pytest.mark.parametrize("chat", [False, True])
async def test_a_run_with_each_odd_event_in_it_relays_as_event_by_event(odd: str, chat: bool) -> None:
    body = [Token(b" a", (i,)) for i in range(6)]
    body[3] = _odd(Token(b" odd", (3,), odd=odd))
    events = [
        e
        for i, t in enumerate(body)
        for e in (chat_events(t, i == 0) if chat else [completion_event(t, i == 0)])
    ]
    data = b"".join(e + b"\n\n" for e in events)  # cut before any finish: the run reaches the end
    for client_ids in (False, True):
        assert await relay(chat, client_ids, [data]) == await relay(chat, client_ids, one_per_event(data))
