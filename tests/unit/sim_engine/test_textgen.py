"""The simulated model (tokenizer, chat template, autoregressive output) and vLLM 0.32's response bytes."""

from __future__ import annotations

from functools import reduce
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg import jsonutil
from vllm_disagg.sim_engine import textgen
from vllm_disagg.sim_engine.openai_api import DONE, ResponseEncoder
from vllm_disagg.sim_engine.prompts import PromptTable


@pytest.mark.parametrize(
    ("text", "ids"),
    [("", []), ("ab", [97, 98]), ("é", [0xC3, 0xA9]), ("a\n", [97, 10])],
    ids=["empty text has no tokens", "ascii is one token per char", "utf-8 is one token per byte", "newline"],
)
def test_tokenize_is_one_token_per_utf8_byte(text: str, ids: list[int]) -> None:
    assert textgen.tokenize(text) == ids


@pytest.mark.parametrize(
    ("messages", "templated"),
    [
        ([{"role": "user", "content": "hi"}], "<|user|>\nhi\n<|assistant|>\n"),
        (
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "<|user|>\nab\n<|assistant|>\n",
        ),
        ([{"content": "x"}], "<|user|>\nx\n<|assistant|>\n"),
    ],
    ids=["one user turn", "system then user", "content parts keep their text", "role defaults to user"],
)
def test_chat_template(messages: list[dict[str, object]], templated: str) -> None:
    assert textgen.apply_chat_template(messages) == templated


# -- output ----------------------------------------------------------------------------------------


def test_output_is_a_pure_function_of_prompt_and_length() -> None:
    a = textgen.expected_text("The quick brown fox", 20)
    assert a == textgen.expected_text("The quick brown fox", 20)
    words = a.split(" ")[1:]
    assert len(words) == 20 and all(w in textgen.WORDS for w in words)
    assert textgen.expected_text("The quick brown fox", 5) == "".join(" " + w for w in words[:5])


def test_text_prompt_and_its_token_ids_give_the_same_output() -> None:
    prompt = "hello, world"
    assert textgen.expected_text(prompt, 8) == textgen.expected_text(textgen.tokenize(prompt), 8)


def test_different_prompts_give_different_outputs() -> None:
    outputs = {textgen.expected_text(f"prompt {i}", 8) for i in range(50)}
    assert len(outputs) == 50


def test_output_tokens_are_words_and_the_text_is_theirs() -> None:
    ids = textgen.output_token_ids("abc", 32)
    assert all(textgen.FIRST_WORD_ID <= t < textgen.VOCAB_SIZE for t in ids)
    assert len(set(ids)) > 8, "the words vary"
    assert textgen.expected_text("abc", 32) == "".join(textgen.token_text(t) for t in ids)
    with pytest.raises(ValueError, match="not an output word"):
        textgen.token_text(97)


@pytest.mark.parametrize(
    "ids",
    [[], [0], [0, 0, 7], [97, 98, 99], [300, 1, 319], [2**64 + 5, 2**70]],
    ids=["empty context", "a zero token", "leading zeros", "bytes", "word ids", "ids beyond 64 bits"],
)
def test_the_state_of_a_context_is_advance_folded_over_its_tokens(ids: list[int]) -> None:
    assert textgen.context_state(ids) == reduce(textgen.advance, ids, textgen.context_state([]))


@pytest.mark.parametrize(
    ("a", "b"),
    [([5], [0, 5]), ([1, 2], [2, 1]), ([97], [97, 97])],
    ids=["a leading zero counts", "order counts", "length counts"],
)
def test_different_contexts_have_different_states(a: list[int], b: list[int]) -> None:
    assert textgen.context_state(a) != textgen.context_state(b)


PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(0, textgen.VOCAB_SIZE - 1), min_size=1, max_size=40),  # output ids allowed too
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(prompt=PROMPTS, n=st.integers(1, 24), data=st.data())
def test_resuming_from_the_prompt_plus_k_output_ids_gives_exactly_the_rest(
    prompt: str | list[int], n: int, data: st.DataObject
) -> None:
    k = data.draw(st.integers(0, n), label="k")
    ids = textgen.tokenize(prompt) if isinstance(prompt, str) else prompt
    out = textgen.output_token_ids(prompt, n)
    assert textgen.output_token_ids(ids + out[:k], n - k) == out[k:]
    text = textgen.expected_text(prompt, n)
    assert textgen.expected_text(ids + out[:k], n - k) == text[len(textgen.expected_text(prompt, k)) :]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=30)), min_size=1
    ),
    n=st.integers(1, 16),
    data=st.data(),
)
def test_resuming_a_chat_from_its_templated_ids_gives_exactly_the_rest(
    turns: list[tuple[str, str]], n: int, data: st.DataObject
) -> None:
    k = data.draw(st.integers(0, n), label="k")
    messages = [{"role": role, "content": content} for role, content in turns]
    ids = textgen.tokenize(textgen.apply_chat_template(messages))
    out = textgen.output_token_ids(ids, n)
    resumed = textgen.output_token_ids(ids + out[:k], n - k)
    assert resumed == out[k:]
    assert textgen.expected_chat_text(messages, n) == textgen.expected_chat_text(messages, k) + "".join(
        textgen.token_text(t) for t in resumed
    )


@pytest.mark.parametrize("prompt", ["hello world", (1, 2, 3, 4, 5)], ids=["text prompt", "token-id prompt"])
def test_engine_prompt_table_agrees_with_textgen(prompt: str | tuple[int, ...]) -> None:
    table = PromptTable(block_size=4)
    info = table.resolve(prompt)
    assert info is table.resolve(prompt), "a repeated prompt is a lookup"
    ids = textgen.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    assert list(info.token_ids) == ids
    assert info.state == textgen.context_state(ids)
    assert len(info.block_hashes) == len(ids) // 4
    assert table.text(info, 3) == textgen.expected_text(prompt, 3)
    assert table.text(info, 12) == textgen.expected_text(prompt, 12), "growing past what was cached"
    assert table.text(info, 2) == textgen.expected_text(prompt, 2)
    assert table.output_ids(info, 12) == textgen.output_token_ids(prompt, 12)
    assert table.json_words(info, 12) == [
        jsonutil.dumps(textgen.token_text(t)) for t in table.output_ids(info, 12)
    ]


def test_prompt_table_stays_bounded() -> None:
    table = PromptTable(block_size=4, capacity=3)
    infos = [table.resolve(f"p{i}") for i in range(10)]
    assert table.resolve("p9") is infos[9]
    assert table.resolve("p0") is not infos[0], "the oldest entries were evicted"
    assert table.text(infos[0], 4) == textgen.expected_text("p0", 4)


# -- response bytes: captured from vLLM 0.32 (CPU build, tiny model), see docs/vllm-resume-facts.md --

FINGERPRINT = "vllm-0.32.0-747c5ef7"
DEF_MAIN = (449, 523, 265, 10)  # "def main(" in the tiny model's tokenizer
HI_CHAT = (30, 94, 1529, 94, 32, 201, 1769, 201, 30, 94, 67, 323, 634, 869, 94, 32, 201)  # templated "hi"
# Captured with --enable-prompt-tokens-details, which the simulated engine does not play: without the
# flag vLLM leaves these out of stream usage chunks and writes null in bodies (the other captures).
_DETAILS = (
    (b',"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":0}}', b"}"),
    (b'{"cached_tokens":0,"created_cache_tokens":null,"multimodal_tokens":null}', b"null"),
    (b'{"cached_tokens":0,"created_cache_tokens":0,"multimodal_tokens":null}', b"null"),
)
CAPTURED: dict[str, bytes] = {
    "completion stream, return_token_ids": (
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny","choic'
        b'es":[{"index":0,"text":" wh","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_tok'
        b'en_ids":[449,523,265,10],"token_ids":[573]}]}\n\n'
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny","choic'
        b'es":[{"index":0,"text":" contain","logprobs":null,"finish_reason":null,"stop_reason":null,"promp'
        b't_token_ids":null,"token_ids":[1191]}]}\n\n'
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny","choic'
        b'es":[{"index":0,"text":"rgument","logprobs":null,"finish_reason":"length","stop_reason":null,"pr'
        b'ompt_token_ids":null,"token_ids":[1682]}],"system_fingerprint":"vllm-0.32.0-747c5ef7"}\n\n'
        b"data: [DONE]\n\n"
    ),
    "completion stream": (
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny","choic'
        b'es":[{"index":0,"text":" wh","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_tok'
        b'en_ids":null,"token_ids":null}]}\n\n'
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny","choic'
        b'es":[{"index":0,"text":" contain","logprobs":null,"finish_reason":null,"stop_reason":null,"promp'
        b't_token_ids":null,"token_ids":null}]}\n\n'
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795437855,"model":"tiny","choic'
        b'es":[{"index":0,"text":"rgument","logprobs":null,"finish_reason":"length","stop_reason":null,"pr'
        b'ompt_token_ids":null,"token_ids":null}],"system_fingerprint":"vllm-0.32.0-747c5ef7"}\n\n'
        b"data: [DONE]\n\n"
    ),
    "completion stream, return_token_ids, continuous usage": (
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795438009,"model":"tiny","choic'
        b'es":[{"index":0,"text":" wh","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_tok'
        b'en_ids":[449,523,265,10],"token_ids":[573]}],"usage":{"prompt_tokens":4,"total_tokens":5,"comple'
        b'tion_tokens":1}}\n\n'
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795438009,"model":"tiny","choic'
        b'es":[{"index":0,"text":" contain","logprobs":null,"finish_reason":"length","stop_reason":null,"p'
        b'rompt_token_ids":null,"token_ids":[1191]}],"usage":{"prompt_tokens":4,"total_tokens":6,"completi'
        b'on_tokens":2}}\n\n'
        b'data: {"id":"cmpl-req-abc","object":"text_completion","created":1795438009,"model":"tiny","choic'
        b'es":[],"usage":{"prompt_tokens":4,"total_tokens":6,"completion_tokens":2},"system_fingerprint":"'
        b'vllm-0.32.0-747c5ef7"}\n\n'
        b"data: [DONE]\n\n"
    ),
    "chat stream, return_token_ids, continuous usage": (
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795437886,"model":"ti'
        b'ny","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reas'
        b'on":null}],"usage":{"prompt_tokens":17,"total_tokens":17,"completion_tokens":0,"completion_token'
        b's_details":null},"prompt_token_ids":[30,94,1529,94,32,201,1769,201,30,94,67,323,634,869,94,32,20'
        b'1],"prompt_text":null}\n\n'
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795437886,"model":"ti'
        b'ny","choices":[{"index":0,"delta":{"content":"gth"},"logprobs":null,"finish_reason":null,"token_'
        b'ids":[1119]}],"usage":{"prompt_tokens":17,"total_tokens":18,"completion_tokens":1,"completion_to'
        b'kens_details":null}}\n\n'
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795437886,"model":"ti'
        b'ny","choices":[{"index":0,"delta":{"content":" 2"},"logprobs":null,"finish_reason":"length","sto'
        b'p_reason":null,"token_ids":[585]}],"usage":{"prompt_tokens":17,"total_tokens":19,"completion_tok'
        b'ens":2,"completion_tokens_details":null}}\n\n'
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795437886,"model":"ti'
        b'ny","choices":[],"usage":{"prompt_tokens":17,"total_tokens":19,"completion_tokens":2,"prompt_tok'
        b'ens_details":{"cached_tokens":0,"created_cache_tokens":0}},"system_fingerprint":"vllm-0.32.0-747'
        b'c5ef7"}\n\n'
        b"data: [DONE]\n\n"
    ),
    "chat stream, usage": (
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795438009,"model":"ti'
        b'ny","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reas'
        b'on":null}],"prompt_token_ids":null,"prompt_text":null}\n\n'
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795438009,"model":"ti'
        b'ny","choices":[{"index":0,"delta":{"content":"gth"},"logprobs":null,"finish_reason":null,"token_'
        b'ids":null}]}\n\n'
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795438009,"model":"ti'
        b'ny","choices":[{"index":0,"delta":{"content":" 2"},"logprobs":null,"finish_reason":"length","sto'
        b'p_reason":null,"token_ids":null}]}\n\n'
        b'data: {"id":"chatcmpl-req-abc","object":"chat.completion.chunk","created":1795438009,"model":"ti'
        b'ny","choices":[],"usage":{"prompt_tokens":17,"total_tokens":19,"completion_tokens":2},"system_fi'
        b'ngerprint":"vllm-0.32.0-747c5ef7"}\n\n'
        b"data: [DONE]\n\n"
    ),
    "completion body, return_token_ids": (
        b'{"id":"cmpl-req-abc","object":"text_completion","created":1795437865,"model":"tiny","choices":[{'
        b'"index":0,"text":" wh containrgument","logprobs":null,"finish_reason":"length","stop_reason":nul'
        b'l,"token_ids":[573,1191,1682],"prompt_logprobs":null,"prompt_token_ids":[449,523,265,10],"routed'
        b'_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0-747c5ef7","usage":{"promp'
        b't_tokens":4,"total_tokens":7,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":0,"c'
        b'reated_cache_tokens":null,"multimodal_tokens":null},"completion_tokens_details":null},"kv_transf'
        b'er_params":null,"ec_transfer_params":null,"metrics":null}'
    ),
    "chat body, return_token_ids": (
        b'{"id":"chatcmpl-req-abc","object":"chat.completion","created":1795437865,"model":"tiny","choices'
        b'":[{"index":0,"message":{"role":"assistant","content":"gth 2can","refusal":null,"annotations":nu'
        b'll,"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"length",'
        b'"stop_reason":null,"token_ids":[1119,585,1373],"routed_experts":null}],"service_tier":null,"syst'
        b'em_fingerprint":"vllm-0.32.0-747c5ef7","usage":{"prompt_tokens":17,"total_tokens":20,"completion'
        b'_tokens":3,"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":0,"multimodal_token'
        b's":null},"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_ids":[30,94,1529'
        b',94,32,201,1769,201,30,94,67,323,634,869,94,32,201],"prompt_text":null,"kv_transfer_params":null'
        b',"ec_transfer_params":null,"metrics":null}'
    ),
    "chat body": (
        b'{"id":"chatcmpl-req-abc","object":"chat.completion","created":1795438009,"model":"tiny","choices'
        b'":[{"index":0,"message":{"role":"assistant","content":"gth 2","refusal":null,"annotations":null,'
        b'"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"length","st'
        b'op_reason":null,"token_ids":null,"routed_experts":null}],"service_tier":null,"system_fingerprint'
        b'":"vllm-0.32.0-747c5ef7","usage":{"prompt_tokens":17,"total_tokens":19,"completion_tokens":2,"pr'
        b'ompt_tokens_details":null,"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token'
        b'_ids":null,"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null'
        b"}"
    ),
}


def _captured(name: str) -> bytes:
    raw = CAPTURED[name]
    for flagged, plain in _DETAILS:
        raw = raw.replace(flagged, plain)
    return raw


def _encoder(
    kind: Any, created: int, prompt: tuple[int, ...], fingerprint: str | None, **options: bool
) -> ResponseEncoder:
    return ResponseEncoder(
        kind, "req-abc", "tiny", created, prompt_token_ids=prompt, fingerprint=fingerprint, **options
    )


RTI = {"return_token_ids": True}
USAGE = {"include_usage": True}
RUNNING = {"include_usage": True, "continuous_usage": True}
STREAMS = [
    (
        "completion stream",
        "completion",
        {},
        1795437855,
        DEF_MAIN,
        [" wh", " contain", "rgument"],
        [573, 1191, 1682],
    ),
    (
        "completion stream, return_token_ids",
        "completion",
        RTI,
        1795437855,
        DEF_MAIN,
        [" wh", " contain", "rgument"],
        [573, 1191, 1682],
    ),
    (
        "completion stream, return_token_ids, continuous usage",
        "completion",
        {**RTI, **RUNNING},
        1795438009,
        DEF_MAIN,
        [" wh", " contain"],
        [573, 1191],
    ),
    ("chat stream, usage", "chat", USAGE, 1795438009, HI_CHAT, ["gth", " 2"], [1119, 585]),
    (
        "chat stream, return_token_ids, continuous usage",
        "chat",
        {**RTI, **RUNNING},
        1795437886,
        HI_CHAT,
        ["gth", " 2"],
        [1119, 585],
    ),
]


@pytest.mark.parametrize(
    ("name", "kind", "options", "created", "prompt", "texts", "ids"),
    STREAMS,
    ids=[
        "completion: nulls for the ids, fingerprint on the last chunk",
        "completion with return_token_ids: prompt ids in the first chunk, each chunk's token ids",
        "completion with running usage: usage on every chunk, fingerprint on the usage chunk",
        "chat with include_usage: role chunk, stop_reason only on the finish, a usage chunk",
        "chat with return_token_ids and running usage: prompt ids in the role chunk",
    ],
)
def test_streams_are_byte_for_byte_those_of_vllm(
    name: str,
    kind: str,
    options: dict[str, bool],
    created: int,
    prompt: tuple[int, ...],
    texts: list[str],
    ids: list[int],
) -> None:
    enc = _encoder(kind, created, prompt, FINGERPRINT, **options)
    words = [jsonutil.dumps(t) for t in texts]
    usage = [enc.usage_chunk(len(prompt), len(ids))] if enc.include_usage else []
    last = len(ids) - 1
    one_by_one = [
        enc.token_chunk(w, i == last, i, t) for i, (w, t) in enumerate(zip(words, ids, strict=True))
    ]
    assert b"".join([enc.role_chunk(), *one_by_one, *usage, DONE]) == _captured(name)
    assert b"".join([enc.role_chunk(), enc.chunks(words, ids), *usage, DONE]) == _captured(name), "at once"


BODIES = [
    (
        "completion body, return_token_ids",
        "completion",
        RTI,
        1795437865,
        DEF_MAIN,
        " wh containrgument",
        [573, 1191, 1682],
    ),
    ("chat body, return_token_ids", "chat", RTI, 1795437865, HI_CHAT, "gth 2can", [1119, 585, 1373]),
    ("chat body", "chat", {}, 1795438009, HI_CHAT, "gth 2", [1119, 585]),
]


@pytest.mark.parametrize(
    ("name", "kind", "options", "created", "prompt", "text", "ids"),
    BODIES,
    ids=[
        "completion body with return_token_ids: ids inside the choice",
        "chat body with return_token_ids: output ids in the choice, prompt ids at the top",
        "chat body: the message's null fields, no tool_calls",
    ],
)
def test_bodies_are_byte_for_byte_those_of_vllm(
    name: str,
    kind: str,
    options: dict[str, bool],
    created: int,
    prompt: tuple[int, ...],
    text: str,
    ids: list[int],
) -> None:
    enc = _encoder(kind, created, prompt, FINGERPRINT, **options)
    assert enc.full(text, len(prompt), len(ids), None, token_ids=ids) == _captured(name)


@pytest.mark.parametrize(
    ("name", "kind", "options", "created", "prompt", "texts", "ids"),
    [STREAMS[0], STREAMS[3]],
    ids=["on the last chunk it is left out", "on the usage chunk it is left out"],
)
def test_without_a_fingerprint_the_stream_is_vllms_with_fingerprint_mode_none(
    name: str,
    kind: str,
    options: dict[str, bool],
    created: int,
    prompt: tuple[int, ...],
    texts: list[str],
    ids: list[int],
) -> None:
    enc = _encoder(kind, created, prompt, None, **options)
    usage = [enc.usage_chunk(len(prompt), len(ids))] if enc.include_usage else []
    got = b"".join([enc.role_chunk(), enc.chunks([jsonutil.dumps(t) for t in texts], ids), *usage, DONE])
    assert got == _captured(name).replace(b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"', b"")


def test_without_a_fingerprint_a_body_says_null() -> None:
    name, kind, options, created, prompt, text, ids = BODIES[2]
    got = _encoder(kind, created, prompt, None, **options).full(
        text, len(prompt), len(ids), None, token_ids=ids
    )
    assert got == _captured(name).replace(b'"' + FINGERPRINT.encode() + b'"', b"null")
