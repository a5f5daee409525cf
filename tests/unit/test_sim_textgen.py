"""The simulated model's tokenizer, chat template and deterministic output."""

from __future__ import annotations

import pytest

from vllm_disagg.sim import textgen
from vllm_disagg.sim.prompts import PromptTable


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


def test_expected_text_is_the_concatenation_of_token_texts() -> None:
    ids = textgen.tokenize("abc")
    seed = textgen.prompt_seed(ids)
    assert textgen.expected_text(ids, 4) == "".join(textgen.token_text(seed, i) for i in range(4))
    assert all(256 <= textgen.output_token_id(seed, i) < 256 + len(textgen.WORDS) for i in range(32))


def test_chat_output_is_the_output_of_the_templated_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert textgen.expected_chat_text(messages, 6) == textgen.expected_text(
        textgen.apply_chat_template(messages), 6
    )


@pytest.mark.parametrize("prompt", ["hello world", (1, 2, 3, 4, 5)], ids=["text prompt", "token-id prompt"])
def test_engine_prompt_table_agrees_with_textgen(prompt: str | tuple[int, ...]) -> None:
    table = PromptTable(block_size=4)
    info = table.resolve(prompt)
    assert info is table.resolve(prompt), "a repeated prompt is a lookup"
    ids = textgen.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    assert list(info.token_ids) == ids
    assert info.seed == textgen.prompt_seed(ids)
    assert len(info.block_hashes) == len(ids) // 4
    assert table.text(info, 3) == textgen.expected_text(prompt, 3)
    assert table.text(info, 12) == textgen.expected_text(prompt, 12), "growing past what was cached"
    assert table.text(info, 2) == textgen.expected_text(prompt, 2)


def test_prompt_table_stays_bounded() -> None:
    table = PromptTable(block_size=4, capacity=3)
    infos = [table.resolve(f"p{i}") for i in range(10)]
    assert table.resolve("p9") is infos[9]
    assert table.resolve("p0") is not infos[0], "the oldest entries were evicted"
    assert table.text(infos[0], 4) == textgen.expected_text("p0", 4)
