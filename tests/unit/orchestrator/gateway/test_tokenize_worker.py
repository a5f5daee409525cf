"""Tokenization off the event loop: a Hugging Face tokenizer's misses run on one worker thread, with a
bounded queue and one run per prompt in flight; hits and the simulated engine's bytes stay on the loop."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_disagg.config import OrchestratorConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.gateway.tokenize import Route, Tokenizers, load_hf_tokenizer
from vllm_disagg.orchestrator.gateway.tokenize_worker import TokenizeWorker
from vllm_disagg.orchestrator.main import add_arguments, config_from_args
from vllm_disagg.orchestrator.metrics import OrchestratorMetrics
from vllm_disagg.orchestrator.state import prefix_index
from vllm_disagg.orchestrator.state.prefix_index import PromptTokens, prompt_block_hashes
from vllm_disagg.orchestrator.state.registry import Registry

MODEL = "tiny"
DEADLINE = 10.0  # seconds any wait below may take before the test fails
CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "naïve café 日本語 🚀"},
    ]
}


class Loaded(concurrent.futures.Executor):
    """A loading executor that hands back ``tokenizer`` at once, whatever the directory."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(self.tokenizer)
        return future


class Gated:
    """The tiny HF tokenizer behind a gate: each call records its thread, says on the loop that it
    started, then waits in its thread until the test opens the gate."""

    inline = False

    def __init__(self, inner: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.inner = inner
        self.loop = loop
        self.threads: list[int] = []
        self.started: asyncio.Queue[int] = asyncio.Queue()
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:  # chat_refusal, content_format: read when it is loaded
        return getattr(self.inner, name)

    def _enter(self) -> None:
        ident = threading.get_ident()
        self.threads.append(ident)
        self.loop.call_soon_threadsafe(self.started.put_nowait, ident)
        if not self.gate.wait(DEADLINE):
            raise AssertionError("the test never opened the gate")

    def completions(self, body: Mapping[str, Any]) -> list[int] | None:
        self._enter()
        ids: list[int] | None = self.inner.completions(body)
        return ids

    def chat_completions(self, body: Mapping[str, Any]) -> list[int] | None:
        self._enter()
        ids: list[int] | None = self.inner.chat_completions(body)
        return ids


@dataclass
class Setup:
    tokenizers: Tokenizers
    gated: Gated
    metrics: OrchestratorMetrics

    def sample(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name) or 0.0

    async def started(self) -> int:
        """The worker thread's id, once a tokenization has started there."""
        return await asyncio.wait_for(self.gated.started.get(), DEADLINE)


@pytest.fixture(scope="module")
def tiny_tokenizer_dir() -> Path:
    pytest.importorskip("transformers")
    from vllm_disagg.cli.up import tiny_model_dir
    from vllm_disagg.model.tiny import build_tiny_model

    return build_tiny_model(tiny_model_dir()).path


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    return load_hf_tokenizer(str(tiny_tokenizer_dir))


@pytest.fixture(scope="module")
def sync(hf_tokenizer: Any) -> Tokenizers:
    """The same tokenizer on the synchronous path: the reference."""
    tokenizers = Tokenizers(executor=Loaded(hf_tokenizer))
    tokenizers.register(MODEL, "vllm", "tiny")
    return tokenizers


@pytest.fixture
async def setup(hf_tokenizer: Any) -> AsyncIterator[Setup]:
    gated = Gated(hf_tokenizer, asyncio.get_running_loop())
    metrics = OrchestratorMetrics(Registry(1.0).snapshot)
    tokenizers = Tokenizers(executor=Loaded(gated), max_pending=2, metrics=metrics)
    tokenizers.register(MODEL, "vllm", "tiny")
    assert tokenizers.status() == {MODEL: "ready"}
    yield Setup(tokenizers, gated, metrics)
    gated.gate.set()  # never leave the worker blocked
    tokenizers.close()


def prompt(text: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": text, "max_tokens": 4}


async def spin(turns: int) -> int:
    """Yield to the loop ``turns`` times: finishes only while the loop runs."""
    for _ in range(turns):
        await asyncio.sleep(0)
    return turns


async def test_a_miss_runs_on_the_worker_thread_while_the_loop_keeps_running(
    setup: Setup, sync: Tokenizers
) -> None:
    waiting = asyncio.ensure_future(setup.tokenizers.tokenize_async(MODEL, "chat_completions", CHAT))
    worker = await setup.started()
    assert worker != threading.get_ident()
    # The tokenizer is blocked in its thread: other tasks on the loop still run to completion.
    assert await asyncio.wait_for(spin(100), DEADLINE) == 100
    assert not waiting.done()
    setup.gated.gate.set()
    ids = await asyncio.wait_for(waiting, DEADLINE)
    assert ids is not None and ids == sync.tokenize(MODEL, "chat_completions", CHAT)
    assert setup.gated.threads == [worker]
    assert setup.sample("vllm_disagg_tokenize_seconds_count") == 1


async def test_a_hit_answers_at_once_on_the_loop_without_the_worker(setup: Setup) -> None:
    setup.gated.gate.set()
    first = await asyncio.wait_for(
        setup.tokenizers.tokenize_async(MODEL, "completions", prompt("hi")), DEADLINE
    )
    # Another max_tokens and stream flag: the same prompt, the same cached list, no future.
    again = setup.tokenizers.tokenize_nowait(
        MODEL, "completions", {**prompt("hi"), "max_tokens": 9, "stream": True}
    )
    assert first is not None and again is first
    assert len(setup.gated.threads) == 1


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("completions", {"prompt": "hello"}),
        ("chat_completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=["completions", "chat"],
)
def test_the_simulated_engine_s_bytes_are_tokenized_on_the_loop_even_on_a_miss(
    route: Route, body: dict[str, Any]
) -> None:
    tokenizers = Tokenizers()
    tokenizers.register("sim-model", "sim", "")
    ids = tokenizers.tokenize_nowait("sim-model", route, body)  # no running loop: a future would fail
    assert isinstance(ids, list) and tokenizers.tokenize("sim-model", route, body) is ids  # and cached
    assert tokenizers.pending() == 0


async def test_with_the_queue_full_a_request_gets_no_ids_at_once_and_is_counted(
    setup: Setup, sync: Tokenizers
) -> None:
    tokenizers = setup.tokenizers  # max_pending=2
    running = tokenizers.tokenize_nowait(MODEL, "completions", prompt("one"))
    await setup.started()
    queued = tokenizers.tokenize_nowait(MODEL, "completions", prompt("two"))
    assert isinstance(running, asyncio.Future) and isinstance(queued, asyncio.Future)
    assert tokenizers.pending() == 2 == setup.sample("vllm_disagg_tokenize_queue_depth")

    assert tokenizers.tokenize_nowait(MODEL, "completions", prompt("three")) is None
    assert setup.sample("vllm_disagg_tokenize_queue_full_total") == 1
    shared = tokenizers.tokenize_nowait(MODEL, "completions", prompt("one"))  # in flight: not refused
    assert isinstance(shared, asyncio.Future)
    assert setup.sample("vllm_disagg_tokenize_queue_full_total") == 1

    setup.gated.gate.set()
    answers = await asyncio.wait_for(asyncio.gather(running, queued, shared), DEADLINE)
    assert list(answers) == [sync.tokenize(MODEL, "completions", prompt(p)) for p in ("one", "two", "one")]
    assert tokenizers.pending() == 0 == setup.sample("vllm_disagg_tokenize_queue_depth")
    assert setup.sample("vllm_disagg_tokenize_seconds_count") == 2
    room = tokenizers.tokenize_nowait(MODEL, "completions", prompt("three"))  # room again
    assert isinstance(room, asyncio.Future)
    assert await asyncio.wait_for(room, DEADLINE) == sync.tokenize(MODEL, "completions", prompt("three"))


async def test_identical_concurrent_misses_share_one_tokenization(setup: Setup) -> None:
    futures = [setup.tokenizers.tokenize_nowait(MODEL, "chat_completions", CHAT) for _ in range(5)]
    assert all(isinstance(f, asyncio.Future) for f in futures)
    assert setup.tokenizers.pending() == 1
    setup.gated.gate.set()
    answers = await asyncio.wait_for(
        asyncio.gather(*(f for f in futures if isinstance(f, asyncio.Future))), DEADLINE
    )
    assert answers[0] is not None and all(a is answers[0] for a in answers)
    assert len(setup.gated.threads) == 1


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("completions", {"prompt": "def f(x):\n    return x  # tabs\tand  spaces"}),
        ("completions", {"prompt": "naïve café", "add_special_tokens": False}),
        ("completions", {"prompt": [5, 17, 300]}),
        ("chat_completions", CHAT),
        ("chat_completions", {**CHAT, "add_generation_prompt": False, "continue_final_message": True}),
        ("chat_completions", {**CHAT, "tools": [{"type": "function"}]}),
    ],
    ids=["code", "unicode without special tokens", "token ids", "chat", "chat continuing", "tools: None"],
)
async def test_the_worker_s_ids_equal_the_synchronous_path_s(
    hf_tokenizer: Any, sync: Tokenizers, route: Route, body: dict[str, Any]
) -> None:
    tokenizers = Tokenizers(executor=Loaded(hf_tokenizer))
    tokenizers.register(MODEL, "vllm", "tiny")
    try:
        pending = tokenizers.tokenize_nowait(MODEL, route, body)
        assert isinstance(pending, asyncio.Future)  # a miss: the worker computes it
        assert await asyncio.wait_for(pending, DEADLINE) == sync.tokenize(MODEL, route, body)
    finally:
        tokenizers.close()


async def test_a_cancelled_waiter_still_leaves_the_answer_in_the_cache(
    setup: Setup, sync: Tokenizers, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizers = setup.tokenizers
    with caplog.at_level(logging.WARNING):
        waiting = asyncio.ensure_future(tokenizers.tokenize_async(MODEL, "completions", prompt("left")))
        await setup.started()
        waiting.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await waiting
        setup.gated.gate.set()
        # One thread, in order: once this answer is back, the cancelled one's reached the loop first.
        await asyncio.wait_for(tokenizers.tokenize_async(MODEL, "completions", prompt("next")), DEADLINE)
    cached = tokenizers.tokenize_nowait(MODEL, "completions", prompt("left"))
    assert isinstance(cached, list) and cached == sync.tokenize(MODEL, "completions", prompt("left"))
    assert len(setup.gated.threads) == 2  # "left" ran once, "next" once
    assert tokenizers.pending() == 0
    assert not caplog.records


async def test_close_drops_queued_work_and_stops_the_thread_after_the_running_one(
    setup: Setup, sync: Tokenizers
) -> None:
    tokenizers = setup.tokenizers
    running = tokenizers.tokenize_nowait(MODEL, "completions", prompt("running"))
    ident = await setup.started()
    queued = tokenizers.tokenize_nowait(MODEL, "completions", prompt("queued"))
    assert isinstance(running, asyncio.Future) and isinstance(queued, asyncio.Future)
    (thread,) = [t for t in threading.enumerate() if t.ident == ident]

    tokenizers.close()
    assert await asyncio.wait_for(queued, DEADLINE) is None  # at once: the running one is still blocked
    assert not running.done()
    assert tokenizers.tokenize_nowait(MODEL, "completions", prompt("later")) is None
    setup.gated.gate.set()
    assert await asyncio.wait_for(running, DEADLINE) == sync.tokenize(MODEL, "completions", prompt("running"))
    thread.join(DEADLINE)
    assert not thread.is_alive()
    assert setup.gated.threads == [ident]  # the queued one never ran


def test_the_queue_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        TokenizeWorker(0)
    with pytest.raises(ConfigError, match="tokenize_queue"):
        OrchestratorConfig(tokenize_queue=0)


def test_the_orchestrator_flag_sets_the_queue_bound() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).tokenize_queue == OrchestratorConfig().tokenize_queue
    assert config_from_args(parser.parse_args(["--tokenize-queue", "8"])).tokenize_queue == 8


async def test_block_keys_are_hashed_on_the_worker_thread_and_cached_with_the_ids(
    hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For each block size an instance announced, the keys come with the ids: the KV index lookup on
    the loop hashes nothing; another block size is hashed when first asked, once."""
    hashed: list[tuple[int, int]] = []  # (block size, thread)

    def recording(ids: Sequence[int], block_size: int) -> list[int]:
        hashed.append((block_size, threading.get_ident()))
        return prompt_block_hashes(ids, block_size)

    monkeypatch.setattr(prefix_index, "prompt_block_hashes", recording)
    tokenizers = Tokenizers(executor=Loaded(hf_tokenizer))
    tokenizers.register(MODEL, "vllm", "tiny")
    tokenizers.note_block_size(4)
    try:
        body = prompt("a prompt long enough for several blocks of four tokens each, and then some")
        pending = tokenizers.tokenize_nowait(MODEL, "completions", body)
        assert isinstance(pending, asyncio.Future)
        ids = await asyncio.wait_for(pending, DEADLINE)
        assert isinstance(ids, PromptTokens)
        assert [size for size, _ in hashed] == [4]
        assert hashed[0][1] != threading.get_ident(), "hashed on the worker, not on the loop"
        assert ids.block_keys(4) == prompt_block_hashes(ids, 4)
        again = tokenizers.tokenize_nowait(MODEL, "completions", body)
        assert again is ids and again.block_keys(4) is ids.block_keys(4)  # cached with the ids
        assert [size for size, _ in hashed] == [4]
        ids.block_keys(16)  # a size no instance announced: hashed when asked, on the caller's thread
        ids.block_keys(16)
        assert hashed[1:] == [(16, threading.get_ident())]
    finally:
        tokenizers.close()
