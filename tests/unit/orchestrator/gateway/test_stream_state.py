"""The resumable relay on vLLM 0.32's exact bytes (docs/vllm-resume-facts.md): what the client sees."""

from __future__ import annotations

import pytest

from tests.unit.orchestrator.gateway.stream_support import Out, chunks
from vllm_disagg.errors import UpstreamError
from vllm_disagg.orchestrator.gateway.resume import StreamState, resumable

HEAD = (
    b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny",'
    b'"choices":[{"index":0,'
)
FP = b',"system_fingerprint":"vllm-0.32.0-747c5ef7"'


def chunk(
    text: bytes, token: int, *, first: bool = False, last: bool = False, ids: bool = True, tail: bytes = b""
) -> bytes:
    """One completion chunk as vLLM 0.32 sends it (``tail``: what follows ``choices``)."""
    prompt = b"[449,523,265,10]" if first and ids else b"null"
    token_ids = b"[%d]" % token if ids else b"null"
    finish = b'"length"' if last else b"null"
    return (
        HEAD
        + b'"text":"'
        + text
        + b'","logprobs":null,"finish_reason":'
        + finish
        + b',"stop_reason":null,"prompt_token_ids":'
        + prompt
        + b',"token_ids":'
        + token_ids
        + b"}]"
        + tail
        + b"}"
    )


USAGE = (
    b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny","choices":[],'
    b'"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}'
)
DONE = b"data: [DONE]\n\n"


def sse(*events: bytes) -> bytes:
    return b"".join(e + b"\n\n" for e in events)


async def test_asked_for_ids_and_usage_the_client_gets_exactly_what_it_would_have_without_them() -> None:
    engine = (
        sse(
            chunk(b" wh", 573, first=True),
            chunk(b" contain", 1191),
            chunk(b"rgument", 1682, last=True),
            USAGE + FP + b"}",
        )
        + DONE
    )
    client = (
        sse(
            chunk(b" wh", 573, first=True, ids=False),
            chunk(b" contain", 1191, ids=False),
            chunk(b"rgument", 1682, last=True, ids=False, tail=FP),
        )
        + DONE
    )
    state = StreamState(chat=False, client_ids=False, max_tokens=3, forced_usage=True)
    out = Out()
    # Split at awkward places: events are reassembled whatever the chunking.
    assert await state.relay(out, engine[:50], chunks(engine[50:51], engine[51:400], engine[400:]))
    assert out.data == client
    assert (
        state.cached_tokens == 4
        and state.ids == [573, 1191, 1682]
        and state.prompt_ids == [449, 523, 265, 10]
    )


async def test_a_cut_leaves_the_state_a_resume_starts_from() -> None:
    engine = sse(chunk(b" wh", 573, first=True), chunk(b"", 244), chunk(b"x", 9))[:-30]
    state = StreamState(chat=False, client_ids=False, max_tokens=12)
    with pytest.raises(UpstreamError):
        await state.relay(Out(), engine, chunks())
    assert state.ids == [573, 244], "the partial third event never reached the client"
    assert state.safe == 1, "a resume starts after the last token with text"
    body = state.resume_body({"model": "tiny", "prompt": "def main(", "max_tokens": 12, "stream": True})
    assert body is not None
    assert body["prompt"] == [449, 523, 265, 10, 573] and body["max_tokens"] == 11
    assert body["return_token_ids"] is True


@pytest.mark.parametrize(
    ("body", "chat", "ok"),
    [
        pytest.param({"prompt": "x"}, False, True, id="a-text-prompt"),
        pytest.param({"prompt": [1, 2, 3]}, False, True, id="a-token-id-prompt"),
        pytest.param({"prompt": ["a", "b"]}, False, False, id="a-batch-of-prompts"),
        pytest.param({"prompt": "x", "n": 2}, False, False, id="several-choices"),
        pytest.param({"prompt": "x", "logprobs": 2}, False, False, id="logprobs-offsets-would-restart"),
        pytest.param({"prompt": "x", "echo": True}, False, False, id="an-echoed-prompt"),
        pytest.param({"messages": []}, True, True, id="a-chat"),
        pytest.param({"messages": [], "tools": [{"type": "function"}]}, True, False, id="a-chat-with-tools"),
    ],
)
def test_which_streams_can_be_resumed(body: dict[str, object], chat: bool, ok: bool) -> None:
    assert resumable(body, chat) is ok
