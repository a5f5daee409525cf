"""The gateway's tokenizer: the simulated engine's ids exactly, HF ids as vLLM computes them, or None."""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import eventually_sync
from vllm_disagg import jsonutil
from vllm_disagg.orchestrator.gateway.content_format import content_format
from vllm_disagg.orchestrator.gateway.tokenize import Route, Tokenizers
from vllm_disagg.sim_engine.openai_api import Kind, parse_request
from vllm_disagg.sim_engine.prompts import PromptTable

SIM = "sim-model"
BOS = 0  # the tiny tokenizer's <|bos|>


class ManualExecutor(concurrent.futures.Executor):
    """Holds submitted loads until the test runs them: every status transition is observable."""

    def __init__(self) -> None:
        self.pending: list[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.pending.append((future, fn, args))
        return future

    def run(self, index: int = 0) -> None:
        future, fn, args = self.pending.pop(index)
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)


def sim_engine_ids(route: Route, body: dict[str, Any]) -> list[int]:
    """What the simulated engine computes for this body: its own parsing and prompt table."""
    kind: Kind = "completion" if route == "completions" else "chat"
    req = parse_request(
        kind, jsonutil.dumps(body), request_id="r", served_model=SIM, default_max_tokens=16
    )  # fmt: skip
    return list(PromptTable(block_size=16).resolve(req.prompt).token_ids)


@pytest.fixture
def sim() -> Iterator[Tokenizers]:
    tokenizers = Tokenizers()
    tokenizers.register(SIM, "sim", "")
    yield tokenizers
    tokenizers.close()


# --- the simulated engine ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("completions", {"prompt": "The quick brown fox"}),
        ("completions", {"prompt": "naïve café 日本語 🚀"}),
        ("completions", {"prompt": [5, 17, 300, 0]}),
        ("completions", {"prompt": ["a batch of one"]}),
        ("completions", {"prompt": [[1, 2, 3]]}),
        ("chat_completions", {"messages": [{"role": "user", "content": "hi"}]}),
        (
            "chat_completions",
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "more é"},
                ]
            },
        ),
        (
            "chat_completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ]
            },
        ),
    ],
    ids=[
        "text prompt",
        "unicode prompt is utf-8 bytes",
        "token ids are taken as they are",
        "a batch of one text is that text",
        "a batch of one token list is that list",
        "one user turn",
        "system and several turns",
        "content parts",
    ],
)
def test_sim_ids_equal_what_the_simulated_engine_computes(
    sim: Tokenizers, route: Route, body: dict[str, Any]
) -> None:
    body = {"model": SIM, "max_tokens": 4, **body}
    ours = sim.tokenize(SIM, route, body)
    assert ours is not None and ours == sim_engine_ids(route, body)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("completions", {"prompt": ["two", "prompts"]}),
        ("completions", {"prompt": ""}),
        ("completions", {"prompt": []}),
        ("completions", {}),
        ("completions", {"prompt": [1, -2]}),
        ("chat_completions", {"messages": []}),
        ("chat_completions", {"messages": "hi"}),
        ("chat_completions", {"messages": [{"content": "no role"}]}),
    ],
    ids=[
        "a batch of several prompts",
        "an empty prompt",
        "an empty token list",
        "no prompt",
        "a negative token id",
        "no messages",
        "messages not a list",
        "a message without a role",
    ],
)
def test_sim_bodies_the_engine_would_refuse_are_not_tokenized(
    sim: Tokenizers, route: Route, body: dict[str, Any]
) -> None:
    assert sim.tokenize(SIM, route, {"model": SIM, **body}) is None


def test_an_unknown_model_is_not_tokenized(sim: Tokenizers) -> None:
    assert sim.tokenize("other", "completions", {"prompt": "hi"}) is None
    assert "other" not in sim.status()


def test_register_rejects_an_unknown_engine() -> None:
    with pytest.raises(ValueError, match="engine"):
        Tokenizers().register("m", "tgi", "")


# --- status and loading -------------------------------------------------------------------------


def test_status_goes_from_loading_to_ready_and_tokenize_waits_for_it(tiny_tokenizer_dir: Path) -> None:
    executor = ManualExecutor()
    tokenizers = Tokenizers(executor=executor)
    tokenizers.register(SIM, "sim", "")
    tokenizers.register("unknown", "vllm", "")
    tokenizers.register("tiny", "vllm", str(tiny_tokenizer_dir))
    assert tokenizers.status() == {SIM: "bytes", "unknown": "none", "tiny": "loading"}
    assert tokenizers.tokenize("tiny", "completions", {"prompt": "hello"}) is None
    assert tokenizers.tokenize("unknown", "completions", {"prompt": "hello"}) is None
    executor.run()
    assert tokenizers.status()["tiny"] == "ready"
    assert tokenizers.tokenize("tiny", "completions", {"prompt": "hello"})


def test_registering_the_same_directory_again_loads_nothing(tiny_tokenizer_dir: Path) -> None:
    executor = ManualExecutor()
    tokenizers = Tokenizers(executor=executor)
    for _ in range(3):
        tokenizers.register("tiny", "vllm", str(tiny_tokenizer_dir))
    assert len(executor.pending) == 1


def test_a_new_directory_replaces_the_tokenizer_and_a_stale_load_is_ignored(
    tiny_tokenizer_dir: Path, bos_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    executor = ManualExecutor()
    tokenizers = Tokenizers(executor=executor)
    tokenizers.register("m", "vllm", str(tiny_tokenizer_dir))
    with caplog.at_level(logging.WARNING):
        tokenizers.register("m", "vllm", str(bos_tokenizer_dir))
    assert "tokenizer changes" in caplog.text
    assert len(executor.pending) == 2
    executor.run(1)  # the new directory's load finishes first
    executor.run(0)  # then the replaced one's: it must not win
    assert tokenizers.status() == {"m": "ready"}
    assert tokenizers.tokenize("m", "completions", {"prompt": "hello"}) == [BOS, 284, 78, 337]


def test_a_replaced_tokenizer_never_answers_from_the_old_cache(
    tiny_tokenizer_dir: Path, bos_tokenizer_dir: Path
) -> None:
    executor = ManualExecutor()
    tokenizers = Tokenizers(executor=executor)
    tokenizers.register("m", "vllm", str(tiny_tokenizer_dir))
    executor.run()
    assert tokenizers.tokenize("m", "completions", {"prompt": "hello"}) == [284, 78, 337]
    tokenizers.register("m", "vllm", str(bos_tokenizer_dir))
    assert tokenizers.tokenize("m", "completions", {"prompt": "hello"}) is None  # loading
    executor.run()
    assert tokenizers.tokenize("m", "completions", {"prompt": "hello"}) == [BOS, 284, 78, 337]


def test_a_missing_directory_fails_in_the_loading_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizers = Tokenizers()
    try:
        with caplog.at_level(logging.WARNING):
            tokenizers.register("m", "vllm", str(tmp_path / "absent"))

            def finished() -> str | None:
                status = tokenizers.status()["m"]
                return None if status == "loading" else status

            status = eventually_sync(finished, timeout=30, what="the load to end")
        assert status.startswith("failed: FileNotFoundError"), status
        assert tokenizers.tokenize("m", "completions", {"prompt": "hello"}) is None
        assert caplog.text.count("cannot load the tokenizer") == 1
    finally:
        tokenizers.close()


def test_without_transformers_the_status_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    executor = ManualExecutor()
    tokenizers = Tokenizers(executor=executor)
    tokenizers.register("m", "vllm", str(tmp_path))
    executor.run()
    assert tokenizers.status()["m"].startswith("failed: transformers is not installed")
    assert (
        tokenizers.tokenize("m", "chat_completions", {"messages": [{"role": "user", "content": "x"}]}) is None
    )


def test_importing_the_module_loads_neither_transformers_nor_jinja2() -> None:
    code = (
        "import sys, vllm_disagg.orchestrator.gateway.tokenize\n"
        "print(sorted(m for m in ('transformers', 'jinja2', 'tokenizers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- the cache ---------------------------------------------------------------------------------


def test_a_repeated_prompt_returns_the_cached_list(sim: Tokenizers) -> None:
    first = sim.tokenize(SIM, "completions", {"prompt": "hello", "max_tokens": 1})
    again = sim.tokenize(SIM, "completions", {"prompt": "hello", "max_tokens": 99, "stream": True})
    assert first is not None and again is first
    assert (
        sim.tokenize(SIM, "chat_completions", {"messages": [{"role": "user", "content": "hello"}]}) != first
    )


def test_the_cache_is_a_bounded_lru() -> None:
    tokenizers = Tokenizers(max_cached_prompts=3)
    tokenizers.register(SIM, "sim", "")
    lists = {p: tokenizers.tokenize(SIM, "completions", {"prompt": p}) for p in ("a", "b", "c")}
    assert tokenizers.tokenize(SIM, "completions", {"prompt": "a"}) is lists["a"]  # a is now the newest
    tokenizers.tokenize(SIM, "completions", {"prompt": "d"})  # evicts b, the oldest
    assert tokenizers.cached_prompts() == 3
    assert tokenizers.tokenize(SIM, "completions", {"prompt": "a"}) is lists["a"]
    assert tokenizers.tokenize(SIM, "completions", {"prompt": "c"}) is lists["c"]
    b = tokenizers.tokenize(SIM, "completions", {"prompt": "b"})
    assert b == lists["b"] and b is not lists["b"]


def test_a_zero_sized_cache_caches_nothing() -> None:
    tokenizers = Tokenizers(max_cached_prompts=0)
    tokenizers.register(SIM, "sim", "")
    first = tokenizers.tokenize(SIM, "completions", {"prompt": "x"})
    assert tokenizers.tokenize(SIM, "completions", {"prompt": "x"}) == first
    assert tokenizers.tokenize(SIM, "completions", {"prompt": "x"}) is not first
    assert tokenizers.cached_prompts() == 0


# --- Hugging Face tokenizers, as vLLM 0.32 uses them ---------------------------------------------

OPENAI_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
KWARGS_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['name'] is defined %}({{ message['name'] }}){% endif %}\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_tokenizer_dir() -> Path:
    pytest.importorskip("transformers")
    from vllm_disagg.cli.up import tiny_model_dir
    from vllm_disagg.model.tiny import build_tiny_model

    return build_tiny_model(tiny_model_dir()).path


def _variant(src: Path, out: Path, *, bos: bool = False, template: str | None = None) -> Path:
    """The tiny tokenizer, optionally adding a BOS token and with another chat template."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, out / name)
    if bos:
        from tokenizers import Tokenizer, processors

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS)]
        )
        tok.save(str(out / "tokenizer.json"))
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    return out


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tiny_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _variant(tiny_tokenizer_dir, tmp_path_factory.mktemp("bos") / "tok", bos=True)


@pytest.fixture(scope="module")
def hf(
    tiny_tokenizer_dir: Path, bos_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Tokenizers:
    """Tokenizers for: the tiny model, its BOS variant, an openai-format and a kwargs-reading template."""
    root = tmp_path_factory.mktemp("variants")
    dirs = {
        "tiny": tiny_tokenizer_dir,
        "bos": bos_tokenizer_dir,
        "openai": _variant(tiny_tokenizer_dir, root / "openai", bos=True, template=OPENAI_TEMPLATE),
        "kwargs": _variant(tiny_tokenizer_dir, root / "kwargs", template=KWARGS_TEMPLATE),
    }
    executor = ManualExecutor()
    tokenizers = Tokenizers(executor=executor)
    for name, directory in dirs.items():
        tokenizers.register(name, "vllm", str(directory))
    while executor.pending:
        executor.run()
    assert set(tokenizers.status().values()) == {"ready"}, tokenizers.status()
    return tokenizers


@pytest.fixture(scope="module")
def auto(bos_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bos_tokenizer_dir))


@pytest.mark.parametrize(
    "text",
    ["hello world", "naïve café 日本語 🚀", "def f(x):\n    return x  # tabs\tand  spaces", "<|eos|> inside"],
    ids=["ascii", "unicode", "code with whitespace", "special token text"],
)
def test_completion_ids_equal_autotokenizer_encode(
    hf: Tokenizers, tiny_tokenizer_dir: Path, text: str
) -> None:
    from transformers import AutoTokenizer

    tiny = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert hf.tokenize("tiny", "completions", {"prompt": text}) == tiny.encode(text)
    assert hf.tokenize("tiny", "completions", {"prompt": [text]}) == tiny.encode(text)


def test_completions_add_special_tokens_unless_the_body_says_not_to(hf: Tokenizers, auto: Any) -> None:
    with_bos = hf.tokenize("bos", "completions", {"prompt": "hello"})
    assert with_bos == auto.encode("hello") and with_bos is not None and with_bos[0] == BOS
    without = hf.tokenize("bos", "completions", {"prompt": "hello", "add_special_tokens": False})
    assert without == with_bos[1:]
    assert hf.tokenize("bos", "completions", {"prompt": [7, 8, 9]}) == [7, 8, 9]  # ids as they are


def _chat(auto: Any, messages: list[dict[str, Any]], *, special: bool = False, **kwargs: Any) -> list[int]:
    kwargs.setdefault("add_generation_prompt", True)
    text = auto.apply_chat_template(messages, tokenize=False, return_dict=False, **kwargs)
    ids: list[int] = auto(text, add_special_tokens=special)["input_ids"]
    return ids


USER = [{"role": "user", "content": "hi"}]
IMAGE = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
TOOL_CALL = {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f"}}


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


TURNS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "again"},
]


@pytest.mark.parametrize(
    ("body", "messages", "kwargs"),
    [
        ({"messages": TURNS}, TURNS, {}),
        ({"messages": TURNS, "add_special_tokens": True}, TURNS, {"special": True}),
        ({"messages": TURNS, "add_generation_prompt": False}, TURNS, {"add_generation_prompt": False}),
        (
            {"messages": TURNS, "add_generation_prompt": False, "continue_final_message": True},
            TURNS,
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        (
            {"messages": _user(*({"type": "text", "text": t} for t in ("a", "", "b")))},
            [{"role": "user", "content": "a\nb"}],
            {},
        ),
        ({"messages": [{"role": "user", "content": None}]}, [{"role": "user", "content": ""}], {}),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [], "refusal": None}]},
            [{"role": "assistant", "content": "x"}],
            {},
        ),
    ],
    ids=[
        "system and several turns, no BOS",
        "add_special_tokens adds BOS",
        "no generation prompt",
        "continue the final message",
        "text parts joined by newlines, empty ones skipped",
        "null content is empty text",
        "empty tool_calls and unknown keys are ignored",
    ],
)  # fmt: skip
def test_chat_ids_equal_the_rendered_template_encoded_without_special_tokens(
    hf: Tokenizers, auto: Any, body: dict[str, Any], messages: list[dict[str, Any]], kwargs: dict[str, Any]
) -> None:
    assert hf.tokenize("bos", "chat_completions", body) == _chat(auto, messages, **kwargs)


def test_an_openai_format_template_gets_content_parts(hf: Tokenizers, auto: Any) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}  # fmt: skip
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    expected = _chat(auto, parts, chat_template=OPENAI_TEMPLATE)
    assert hf.tokenize("openai", "chat_completions", body) == expected
    assert "[a][b]" in auto.decode(expected)


def test_template_kwargs_and_names_reach_the_template(hf: Tokenizers, tiny_tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    messages = [{"role": "user", "content": "hi", "name": "ann"}]
    body = {"messages": messages, "chat_template_kwargs": {"greeting": "hey", "unused": 1, "skipped": None}}
    text = tok.apply_chat_template(
        messages, tokenize=False, chat_template=KWARGS_TEMPLATE, add_generation_prompt=True, greeting="hey"
    )
    assert isinstance(text, str) and text.startswith("hey\n<|user|>(ann)")
    assert hf.tokenize("kwargs", "chat_completions", body) == tok.encode(text)
    # the body's add_generation_prompt wins over chat_template_kwargs', as in vLLM
    body = {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert hf.tokenize("kwargs", "chat_completions", body) == tok.encode(
        tok.apply_chat_template(
            messages, tokenize=False, chat_template=KWARGS_TEMPLATE, add_generation_prompt=True
        )
    )


def test_forwarded_prompt_token_ids_are_what_vllm_uses_for_chat(hf: Tokenizers) -> None:
    body: dict[str, Any] = {"messages": TURNS, "kv_transfer_params": {"prompt_token_ids": [4, 5, 6]}}
    assert hf.tokenize("bos", "chat_completions", body) == [4, 5, 6]
    assert hf.tokenize("bos", "chat_completions", {**body, "echo": True}) != [4, 5, 6]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        pytest.param("completions", {"prompt": ["one", "two"]}, id="several prompts"),
        pytest.param("completions", {"prompt": "x", "suffix": "y"}, id="fill-in-the-middle suffix"),
        pytest.param("completions", {"prompt": "x", "truncate_prompt_tokens": 3}, id="truncation"),
        pytest.param(
            "completions", {"prompt": "x", "cache_salt": "s"}, id="a cache salt changes block hashes"
        ),
        pytest.param("completions", {"prompt": "x", "prompt_embeds": "AAAA"}, id="prompt embeddings"),
        pytest.param(
            "completions", {"prompt": "x", "add_special_tokens": "yes"}, id="add_special_tokens not bool"
        ),
        pytest.param("chat_completions", {"messages": USER, "tools": [TOOL]}, id="tools"),
        pytest.param(
            "chat_completions", {"messages": USER, "tool_choice": "auto"}, id="tool_choice needs a parser"
        ),
        pytest.param(
            "chat_completions",
            {"messages": USER, "chat_template": "{{ messages }}"},
            id="a template in the request",
        ),
        pytest.param(
            "chat_completions",
            {"messages": USER, "chat_template_kwargs": {"tokenize": True}},
            id="tokenize in chat_template_kwargs",
        ),
        pytest.param(
            "chat_completions",
            {"messages": USER, "chat_template_kwargs": {"return_assistant_tokens_mask": True}},
            id="an apply_chat_template parameter in chat_template_kwargs",
        ),
        pytest.param(
            "chat_completions",
            {"messages": USER, "add_generation_prompt": True, "continue_final_message": True},
            id="generation prompt and continue final message (vLLM: 400)",
        ),
        pytest.param("chat_completions", {"messages": USER, "cache_salt": "s"}, id="chat with a cache salt"),
        pytest.param("chat_completions", {"messages": _user(IMAGE)}, id="an image"),
        pytest.param(
            "chat_completions",
            {"messages": _user({"type": "text", "text": "a", "x": 1})},
            id="a part with extra fields",
        ),
        pytest.param(
            "chat_completions",
            {"messages": [{"role": "developer", "content": "rules"}, *USER]},
            id="a developer turn",
        ),
        pytest.param(
            "chat_completions",
            {"messages": [{"role": "tool", "content": "4", "tool_call_id": "t"}]},
            id="a tool turn",
        ),
        pytest.param(
            "chat_completions",
            {"messages": [{"role": "assistant", "tool_calls": [TOOL_CALL]}]},
            id="assistant tool calls",
        ),
        pytest.param(
            "chat_completions",
            {"messages": [{"role": "system", "content": "x-anthropic-billing-header: 1\nhi"}]},
            id="a billing header vLLM strips",
        ),
    ],
)
def test_what_cannot_be_reproduced_exactly_is_none(
    hf: Tokenizers, route: Route, body: dict[str, Any]
) -> None:
    assert hf.tokenize("bos", route, body) is None


def test_a_tokenizer_without_chat_template_tokenizes_completions_only(
    tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = _variant(tiny_tokenizer_dir, tmp_path / "plain")
    (out / "chat_template.jinja").unlink()
    executor = ManualExecutor()
    tokenizers = Tokenizers(executor=executor)
    tokenizers.register("plain", "vllm", str(out))
    executor.run()
    assert tokenizers.status()["plain"] == "ready"
    assert tokenizers.tokenize("plain", "completions", {"prompt": "hello"}) == [284, 78, 337]
    assert tokenizers.tokenize("plain", "chat_completions", {"messages": USER}) is None


# --- content format detection: the same answer as vLLM 0.32's own -------------------------------

TEMPLATES = [
    pytest.param(None, "string", id="tiny: plain content"),
    pytest.param(OPENAI_TEMPLATE, "openai", id="a loop over content"),
    pytest.param(
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}",
        "openai",
        id="string or parts (Llama 3 style)",
    ),
    pytest.param(
        "{% set msgs = messages[1:] %}{% for m in msgs %}"
        "{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
        "openai",
        id="through an alias of messages",
    ),
    pytest.param(
        "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m['content']) }}{% endfor %}",
        "openai",
        id="through a macro parameter",
    ),
    pytest.param(
        "{% macro render(x, c=none) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(1, c=m.content) }}{% endfor %}",
        "openai",
        id="through a macro keyword",
    ),
    pytest.param(
        "{% for m in messages %}{% set content = m.content %}{% for x in content %}{{ x }}{% endfor %}"
        "{% endfor %}",
        "openai",
        id="a variable named content",
    ),
    pytest.param(
        "{% for m in messages %}{% for t in m.tool_calls %}{{ t }}{% endfor %}{{ m.content }}{% endfor %}",
        "string",
        id="loops over other fields only",
    ),
    pytest.param(
        "{% for m in messages %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}",
        "openai",
        id="a filtered loop",
    ),
    pytest.param(
        "{% for m in messages %}{% generation %}{% for p in m.content %}{{ p }}{% endfor %}"
        "{% endgeneration %}{% endfor %}",
        "openai",
        id="inside a generation block",
    ),
    pytest.param("{% for m in messages %}{{ m.content }", "string", id="a syntax error"),
    pytest.param(
        "{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}{% endfor %}",
        "string",
        id="a tuple loop target (vLLM's walk gives up)",
    ),
]


@pytest.mark.parametrize(("template", "expected"), TEMPLATES)
def test_content_format_matches_vllm(template: str | None, expected: str, tiny_tokenizer_dir: Path) -> None:
    hf_renderer = pytest.importorskip("vllm.renderers.hf")
    template = template or (tiny_tokenizer_dir / "chat_template.jinja").read_text()
    assert hf_renderer._detect_content_format.__wrapped__(template, default="string") == expected
    assert content_format(template) == expected


def test_preloading_imports_what_a_tokenizer_load_would_so_loading_later_cannot_stall() -> None:
    import sys

    from vllm_disagg.orchestrator.gateway.tokenize import preload_tokenizer_libs

    took = preload_tokenizer_libs()
    if took is None:  # transformers is not installed here: nothing to preload, nothing to stall
        assert "transformers.generation.logits_process" not in sys.modules
        return
    assert took >= 0
    assert "torch" in sys.modules, "torch, the slow native import, is loaded before serving"
    assert "transformers.generation.logits_process" in sys.modules
