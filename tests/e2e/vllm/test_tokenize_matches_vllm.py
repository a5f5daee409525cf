"""The gateway's token ids are the ones real vLLM 0.32 computes, for completions and chat.

One plain vLLM (no KV connector) serves the tiny model, with a tokenizer that adds a BOS token so that
getting ``add_special_tokens`` wrong cannot pass (completions add it, chat does not). Its ``POST
/tokenize`` is the reference, and generation requests with ``return_token_ids`` show the ids the engine
itself ran on. ``--trust-request-chat-template`` lets one case send a template that loops over content
parts (vLLM's "openai" content format); our side loads a copy of the tokenizer with that template.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm.support import free_engine_ports, running_vllm
from tests.helpers import eventually_sync, http_json
from vllm_disagg import jsonutil
from vllm_disagg.config import AgentConfig
from vllm_disagg.orchestrator.gateway.tokenize import Route, Tokenizers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]
MODEL = "tiny"
OPENAI_MODEL = "tiny-openai"  # our name for the same tokenizer with OPENAI_TEMPLATE
BOS_ID = 0
OPENAI_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TURNS = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is a KV cache?"},
    {"role": "assistant", "content": "Memory."},
    {"role": "user", "content": "And a prefix cache?"},
]
PARTS = [
    {"type": "text", "text": "first part"},
    {"type": "text", "text": ""},
    {"type": "text", "text": "second"},
]
UNICODE = "naïve café — 日本語のテキスト, ελληνικά, emoji 🚀🧪 and\ttabs\r\nnewlines"


def _long_text() -> str:
    words = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text().split()
    return " ".join(words[:200])  # about 700 tokens: more than four 128-token blocks


@dataclass(frozen=True)
class Case:
    """One /tokenize body; ``ours`` is the model our side tokenizes it as, ``extra`` fields only vLLM sees."""

    name: str
    route: Route
    body: dict[str, Any]
    ours: str = MODEL
    extra: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("completion-short", "completions", {"prompt": "Hello, world!"}),
    Case("completion-long", "completions", {"prompt": _long_text()}),
    Case("completion-unicode", "completions", {"prompt": UNICODE}),
    Case("completion-no-special-tokens", "completions", {"prompt": "Hello", "add_special_tokens": False}),
    Case("chat-one-turn", "chat_completions", {"messages": [{"role": "user", "content": "Hi there"}]}),
    Case("chat-system-multi-turn", "chat_completions", {"messages": TURNS}),
    Case("chat-unicode", "chat_completions", {"messages": [{"role": "user", "content": UNICODE}]}),
    Case("chat-content-parts", "chat_completions", {"messages": [{"role": "user", "content": PARTS}]}),
    Case(
        "chat-no-generation-prompt", "chat_completions", {"messages": TURNS, "add_generation_prompt": False}
    ),
    Case(
        "chat-continue-final-message",
        "chat_completions",
        {"messages": TURNS[:3], "add_generation_prompt": False, "continue_final_message": True},
    ),
    Case("chat-add-special-tokens", "chat_completions", {"messages": TURNS, "add_special_tokens": True}),
    Case(
        "chat-name-and-unused-kwargs",
        "chat_completions",
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}], "chat_template_kwargs": {"x": 1}},
    ),
    Case(
        "chat-openai-content-format",
        "chat_completions",
        {"messages": [{"role": "system", "content": "short"}, {"role": "user", "content": PARTS}]},
        ours=OPENAI_MODEL,
        extra={"chat_template": OPENAI_TEMPLATE},
    ),
]


@dataclass(frozen=True)
class Dirs:
    model: Path  # the tiny model with a BOS-adding tokenizer: what vLLM serves
    openai: Path  # its tokenizer with OPENAI_TEMPLATE


@pytest.fixture(scope="module")
def dirs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Dirs:
    from tokenizers import Tokenizer, processors

    tiny = tiny_model
    root = tmp_path_factory.mktemp("tokenize-models")
    model = root / "tiny-bos"
    shutil.copytree(tiny, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    tok.save(str(model / "tokenizer.json"))
    openai = root / "tiny-openai"
    openai.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, openai / name)
    (openai / "chat_template.jinja").write_text(OPENAI_TEMPLATE)
    return Dirs(model, openai)


@pytest.fixture(scope="module")
def ours(dirs: Dirs) -> Iterator[Tokenizers]:
    tokenizers = Tokenizers()
    tokenizers.register(MODEL, "vllm", str(dirs.model))
    tokenizers.register(OPENAI_MODEL, "vllm", str(dirs.openai))
    try:
        eventually_sync(
            lambda: set(tokenizers.status().values()) == {"ready"}, timeout=120, what="tokenizers loaded"
        )
        yield tokenizers
    finally:
        tokenizers.close()


@pytest.fixture(scope="module")
def vllm(dirs: Dirs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of one colocated vLLM; its process group is gone after the module."""
    port = free_engine_ports(1)
    cfg = AgentConfig(
        agent_id="tokenize", role="both", engine="vllm", model=MODEL, model_path=str(dirs.model),
        engine_port=port, kv_connector="", max_model_len=1024,
        extra_engine_args=("--trust-request-chat-template",),
    )  # fmt: skip
    log = tmp_path_factory.mktemp("tokenize-vllm") / "vllm.log"
    with running_vllm(cfg, log) as base:
        yield base


def _post(url: str, body: dict[str, Any]) -> Any:
    status, answer = http_json(url, method="POST", body=jsonutil.dumps(body), timeout=60)
    assert status == 200, answer
    return answer


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ids_equal_vllm_tokenize(case: Case, vllm: str, ours: Tokenizers) -> None:
    theirs = _post(f"{vllm}/tokenize", {"model": MODEL, **case.body, **case.extra})["tokens"]
    assert ours.tokenize(case.ours, case.route, case.body) == theirs


def test_bos_makes_the_cases_discriminating(ours: Tokenizers) -> None:
    completion = ours.tokenize(MODEL, "completions", {"prompt": "Hello"})
    chat = ours.tokenize(MODEL, "chat_completions", {"messages": TURNS})
    assert completion is not None and completion[0] == BOS_ID
    assert chat is not None and chat[0] != BOS_ID


def test_completion_runs_on_our_ids(vllm: str, ours: Tokenizers) -> None:
    body = {"prompt": _long_text(), "max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
    answer = _post(f"{vllm}/v1/completions", {"model": MODEL, **body})
    expected = ours.tokenize(MODEL, "completions", body)
    assert expected is not None and len(expected) > 4 * 128
    assert answer["choices"][0]["prompt_token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == len(expected)


def test_chat_completion_runs_on_our_ids(vllm: str, ours: Tokenizers) -> None:
    body = {"messages": TURNS, "max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
    answer = _post(f"{vllm}/v1/chat/completions", {"model": MODEL, **body})
    expected = ours.tokenize(MODEL, "chat_completions", body)
    assert expected is not None
    assert answer["prompt_token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == len(expected)
